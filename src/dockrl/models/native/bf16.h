/* Element access shared by the native kernels (decode.c, head.c, attention.c): E is float or bfloat16 bits
 * (uint16_t), read as fp32 and written back as torch writes E. Included by each source; part of the build's key
 * (dockrl/models/native/__init__.py, HEADERS). */
#ifndef DOCKRL_NATIVE_BF16_H
#define DOCKRL_NATIVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }
static inline float load_bf16(uint16_t x) {
  uint32_t bits = (uint32_t)x << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
/* torch's c10::BFloat16 rounding: nearest even; a NaN stays a (quiet) NaN. */
static inline uint16_t store_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}
/* E -> E: the value torch keeps after an op whose fp32 result it stores as E. */
#define ROUND_f32(x) (x)
#define ROUND_bf16(x) load_bf16(store_bf16(x))

#endif
