/* RoPE's forward and backward on a CPU (models/native/rope.py, decoder.apply_rope): torch's passes (two
 * products, the roll, the sum; a layout copy downstream) as one each way.
 *
 *   rope_forward   out[b, t, h] = E(E(x * cos) + E(roll(x, D/2) * signed_sin))       (decoder.apply_rope)
 *   rope_backward  dx[b, t, h]  = E(E(g * cos) + roll(E(g * signed_sin), -D/2))      (autograd's, summed as it sums)
 *
 * Elementwise only, each value rounded to E where torch rounds it (bf16.h's ROUND_RESULT: every value rounded
 * here is an op's result), so the results are torch's bit for bit
 * (tests/unit/test_rope_native.py). x is read as the projection wrote it, [B, T, H, D] with strides (x_b, x_t,
 * x_h) and a contiguous last dim, and out is written in that order, [B, T, H, D] contiguous, as torch's ops keep
 * their input's order: attention's output then comes out in it too, and o_proj reads it in place, as with torch's
 * ops (a [B, H, T, D] output would cost a copy before o_proj and a saved tensor more a layer). The backward
 * reads g [B, H, T, D] with strides (g_b, g_h, g_t) and writes dx [B, T, H, D] contiguous.
 * cos and signed_sin are [B, T, D] with strides (c_b, c_t) (c_b = 0: one set of angles for every row). A head
 * of 32, 64 or 128 runs with its size known to the compiler (whole vectors, no remainder loop).
 *
 * E-typed arrays: entry points come in pairs, _f32 (E = float) and _bf16 (E = uint16_t, bfloat16 bits). All
 * strides are in elements. */
#include <stdint.h>

#include "bf16.h"

#define PARALLEL "omp parallel for collapse(2) if (B * T * H * D >= 65536)"

/* One head's D values, j = (d + D/2) mod D: o[d] = E(E(a[d] c[d]) + E(a[j] s[d])) (the forward) or, with
 * `rolled_angles`, E(E(a[d] c[d]) + E(a[j] s[j])) (the backward); the two halves apart, each a plain vector loop. */
#define DEFINE_ROPE_ROW(SUF, E)                                                                                        \
  static inline __attribute__((always_inline)) void rope_row_##SUF(                                                    \
      const E* restrict a, const E* restrict c, const E* restrict s, E* restrict o, const int64_t D,                   \
      const int rolled_angles) {                                                                                       \
    const int64_t half = D / 2;                                                                                        \
    for (int64_t d = 0; d < half; ++d) {                                                                               \
      float first = ROUND_RESULT_##SUF(load_##SUF(a[d]) * load_##SUF(c[d]));                                           \
      float sine = load_##SUF(s[rolled_angles ? d + half : d]);                                                        \
      o[d] = store_result_##SUF(first + ROUND_RESULT_##SUF(load_##SUF(a[d + half]) * sine));                           \
    }                                                                                                                  \
    for (int64_t d = half; d < D; ++d) {                                                                               \
      float first = ROUND_RESULT_##SUF(load_##SUF(a[d]) * load_##SUF(c[d]));                                           \
      float sine = load_##SUF(s[rolled_angles ? d - half : d]);                                                        \
      o[d] = store_result_##SUF(first + ROUND_RESULT_##SUF(load_##SUF(a[d - half]) * sine));                           \
    }                                                                                                                  \
  }                                                                                                                    \
  static inline __attribute__((always_inline)) void rope_head_##SUF(                                                   \
      const E* a, const E* c, const E* s, E* o, int64_t D, int rolled_angles) {                                        \
    switch (D) { /* constant sizes: the loops unrolled into whole vectors */                                           \
      case 32: rope_row_##SUF(a, c, s, o, 32, rolled_angles); break;                                                   \
      case 64: rope_row_##SUF(a, c, s, o, 64, rolled_angles); break;                                                   \
      case 128: rope_row_##SUF(a, c, s, o, 128, rolled_angles); break;                                                 \
      default: rope_row_##SUF(a, c, s, o, D, rolled_angles);                                                           \
    }                                                                                                                  \
  }

#define DEFINE_ROPE(SUF, E)                                                                                            \
  DEFINE_ROPE_ROW(SUF, E)                                                                                              \
  /* in [B, T, H, D] by strides (in_b, in_t, in_h) -> out [B, T, H, D] contiguous, head by head */                     \
  static inline __attribute__((always_inline)) void rope_rows_##SUF(                                                   \
      const E* in, int64_t in_b, int64_t in_t, int64_t in_h, const E* cos, const E* sin, int64_t c_b, int64_t c_t,     \
      E* out, int64_t B, int64_t T, int64_t H, int64_t D, int rolled_angles) {                                         \
    _Pragma(PARALLEL) for (int64_t b = 0; b < B; ++b) {                                                                \
      for (int64_t t = 0; t < T; ++t) {                                                                                \
        const E* c = cos + b * c_b + t * c_t;                                                                          \
        const E* s = sin + b * c_b + t * c_t;                                                                          \
        for (int64_t h = 0; h < H; ++h)                                                                                \
          rope_head_##SUF(in + b * in_b + t * in_t + h * in_h, c, s, out + ((b * T + t) * H + h) * D, D,               \
                          rolled_angles);                                                                              \
      }                                                                                                                \
    }                                                                                                                  \
  }                                                                                                                    \
                                                                                                                       \
  void dockrl_rope_forward_##SUF(const E* x, int64_t x_b, int64_t x_t, int64_t x_h, const E* cos,                      \
                                 const E* sin, int64_t c_b, int64_t c_t, E* out, int64_t B, int64_t T,                 \
                                 int64_t H, int64_t D) {                                                               \
    rope_rows_##SUF(x, x_b, x_t, x_h, cos, sin, c_b, c_t, out, B, T, H, D, 0);                                         \
  }                                                                                                                    \
                                                                                                                       \
  void dockrl_rope_backward_##SUF(const E* g, int64_t g_b, int64_t g_h, int64_t g_t, const E* cos,                     \
                                  const E* sin, int64_t c_b, int64_t c_t, E* dx, int64_t B, int64_t T,                 \
                                  int64_t H, int64_t D) {                                                              \
    rope_rows_##SUF(g, g_b, g_t, g_h, cos, sin, c_b, c_t, dx, B, T, H, D, 1);                                          \
  }

DEFINE_ROPE(f32, float)
DEFINE_ROPE(bf16, uint16_t)
