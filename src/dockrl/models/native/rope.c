/* RoPE's forward and backward on a CPU (models/native/rope.py, decoder.apply_rope): torch's five passes of the
 * forward (two products, the roll, the sum, a layout copy downstream) and four of the backward as one each.
 *
 *   rope_forward   out[b, h, t] = E(E(x * cos) + E(roll(x, D/2) * signed_sin))       (decoder.apply_rope)
 *   rope_backward  dx[b, t, h]  = E(E(g * cos) + roll(E(g * signed_sin), -D/2))      (autograd's, summed as it sums)
 *
 * Elementwise only, each value rounded to E where torch rounds it, so the results are torch's bit for bit
 * (tests/unit/test_rope_native.py). x is read as the projection wrote it, [B, T, H, D] with strides (x_b, x_t,
 * x_h) and a contiguous last dim; out is written [B, H, T, D] contiguous (attention's layout). The backward reads
 * g [B, H, T, D] with strides (g_b, g_h, g_t) and writes dx [B, T, H, D] contiguous (the projection's layout).
 * cos and signed_sin are [B, T, D] with strides (c_b, c_t) (c_b = 0: one set of angles for every row).
 *
 * E-typed arrays: entry points come in pairs, _f32 (E = float) and _bf16 (E = uint16_t, bfloat16 bits). All
 * strides are in elements. */
#include <stdint.h>

#include "bf16.h"

#define PARALLEL "omp parallel for collapse(2) if (B * T * H * D >= 65536)"

#define DEFINE_ROPE(SUF, E)                                                                                     \
  void dockrl_rope_forward_##SUF(const E* x, int64_t x_b, int64_t x_t, int64_t x_h, const E* cos,              \
                                 const E* sin, int64_t c_b, int64_t c_t, E* out, int64_t B, int64_t T,         \
                                 int64_t H, int64_t D) {                                                       \
    int64_t half = D / 2;                                                                                      \
    _Pragma(PARALLEL) for (int64_t b = 0; b < B; ++b) {                                                        \
      for (int64_t t = 0; t < T; ++t) {                                                                        \
        const E* restrict c = cos + b * c_b + t * c_t;                                                                  \
        const E* restrict s = sin + b * c_b + t * c_t;                                                                  \
        for (int64_t h = 0; h < H; ++h) {                                                                      \
          const E* restrict xr = x + b * x_b + t * x_t + h * x_h;                                                       \
          E* restrict o = out + ((b * H + h) * T + t) * D;                                                              \
          for (int64_t d = 0; d < half; ++d) { /* the two halves apart: each a plain vector loop */           \
            float first = ROUND_##SUF(load_##SUF(xr[d]) * load_##SUF(c[d]));                                   \
            o[d] = store_##SUF(first + ROUND_##SUF(load_##SUF(xr[d + half]) * load_##SUF(s[d])));              \
          }                                                                                                    \
          for (int64_t d = half; d < D; ++d) {                                                                 \
            float first = ROUND_##SUF(load_##SUF(xr[d]) * load_##SUF(c[d]));                                   \
            o[d] = store_##SUF(first + ROUND_##SUF(load_##SUF(xr[d - half]) * load_##SUF(s[d])));              \
          }                                                                                                    \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
  }                                                                                                            \
                                                                                                               \
  void dockrl_rope_backward_##SUF(const E* g, int64_t g_b, int64_t g_h, int64_t g_t, const E* cos,             \
                                  const E* sin, int64_t c_b, int64_t c_t, E* dx, int64_t B, int64_t T,         \
                                  int64_t H, int64_t D) {                                                      \
    int64_t half = D / 2;                                                                                      \
    _Pragma(PARALLEL) for (int64_t b = 0; b < B; ++b) {                                                        \
      for (int64_t t = 0; t < T; ++t) {                                                                        \
        const E* restrict c = cos + b * c_b + t * c_t;                                                                  \
        const E* restrict s = sin + b * c_b + t * c_t;                                                                  \
        for (int64_t h = 0; h < H; ++h) {                                                                      \
          const E* restrict gr = g + b * g_b + h * g_h + t * g_t;                                                       \
          E* restrict o = dx + ((b * T + t) * H + h) * D;                                                               \
          for (int64_t d = 0; d < half; ++d) {                                                                 \
            float first = ROUND_##SUF(load_##SUF(gr[d]) * load_##SUF(c[d]));                                   \
            o[d] = store_##SUF(first + ROUND_##SUF(load_##SUF(gr[d + half]) * load_##SUF(s[d + half])));       \
          }                                                                                                    \
          for (int64_t d = half; d < D; ++d) {                                                                 \
            float first = ROUND_##SUF(load_##SUF(gr[d]) * load_##SUF(c[d]));                                   \
            o[d] = store_##SUF(first + ROUND_##SUF(load_##SUF(gr[d - half]) * load_##SUF(s[d - half])));       \
          }                                                                                                    \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
  }

DEFINE_ROPE(f32, float)
DEFINE_ROPE(bf16, uint16_t)
