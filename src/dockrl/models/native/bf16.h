/* Element access and roundings shared by the native kernels (decode.c, head.c, attention.c, norm.c, rope.c): E
 * is float or bfloat16 bits (uint16_t), read as fp32 and written back as torch writes E. Included by each source;
 * part of the build's key (dockrl/models/native/__init__.py, HEADERS). */
#ifndef DOCKRL_NATIVE_BF16_H
#define DOCKRL_NATIVE_BF16_H

#include <math.h>
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

/* The same for v the result of an fp32 op (a product, a sum), without store_bf16's NaN case, which such a v does
 * not need: an op's NaN is quiet (its top mantissa bit set), so the rounding's carry cannot reach the exponent.
 * Its NaNs keep their sign and payload, as store_bf16's do. About half the vector work of store_bf16. */
static inline float store_result_f32(float v) { return v; }
static inline uint16_t store_result_bf16(float v) {
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
#define ROUND_RESULT_f32(x) (x)
#define ROUND_RESULT_bf16(x) load_bf16(store_result_bf16(x))

/* 1 / sqrt(v) with two roundings, as torch.rsqrt on a CPU (RMSNorm's inverse root: decode.c, norm.c):
 * -ffast-math would otherwise turn 1.0f / sqrtf(v) into the rsqrt approximation; the empty asm hides the square
 * root from that rewrite. */
static inline float rms_inverse(float v) {
  float root = sqrtf(v);
  __asm__("" : "+x"(root));
  return 1.0f / root;
}

/* RMSNorm's inverse root of a row x [H] of E (decode.c, norm.c): the squares summed in fp32, their mean plus eps,
 * rms_inverse. */
#define DEFINE_ROW_RMS_INVERSE(SUF, E)                                                                          \
  static inline __attribute__((always_inline)) float row_rms_inverse_##SUF(const E* x, int64_t H, float eps) {  \
    float squares = 0.0f;                                                                                       \
    for (int64_t i = 0; i < H; ++i) {                                                                           \
      float v = load_##SUF(x[i]);                                                                               \
      squares += v * v;                                                                                         \
    }                                                                                                           \
    return rms_inverse(squares / (float)H + eps);                                                               \
  }
DEFINE_ROW_RMS_INVERSE(f32, float)
DEFINE_ROW_RMS_INVERSE(bf16, uint16_t)

#endif
