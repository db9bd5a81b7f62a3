/* RMSNorm's forward and backward on a CPU (models/rms_norm.py's default there; models/native/norm.py): torch's
 * ~4 passes of the forward and ~9 of the backward over [T, H] (each reading or writing an fp32 copy) as one pass
 * each, a row at a time while it is in the cache.
 *
 *   rms_norm_forward   out = w * E(x * r), r = 1 / sqrt(mean(x^2) + eps) per row (kept, fp32, for the backward)
 *   rms_norm_backward  g_x = E(E(g * w) * r - x * (sum_i g_i x_i w_i) r^3 / H)
 *                      g_w = E(sum_t g_t x_t r_t)                          (models/rms_norm.py's docstring)
 *
 * Rounding follows rms_norm.py's torch ops one by one, as decode.c's add_rms_norm does (its header): every value
 * torch rounds to E (bf16 or fp32) is rounded here at the same point and each op is the same fp32 op, so what
 * differs is only the order of the sums (the squares of a row, sum_i g_i x_i w_i of a row, g_w's sum over the
 * tokens). g_w's sum does not depend on the thread count (rms_norm_backward's comment).
 *
 * E-typed arrays: entry points come in pairs, _f32 (E = float) and _bf16 (E = uint16_t, bfloat16 bits); x, g,
 * out and g_x are [T, H] with the given row strides, w and g_w [H] (E) contiguous, r [T] fp32. */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define PARALLEL_ROWS "omp parallel for if (T * H >= 65536)"

#define DEFINE_RMS_NORM_FORWARD(SUF, E)                                                                                \
  void dockrl_rms_norm_forward_##SUF(const E* x, int64_t x_stride, const E* w, E* out, int64_t out_stride,             \
                                     float* r, int64_t T, int64_t H, float eps) {                                      \
    _Pragma(PARALLEL_ROWS) for (int64_t t = 0; t < T; ++t) {                                                           \
      const E* xr = x + t * x_stride;                                                                                  \
      float inverse = row_rms_inverse_##SUF(xr, H, eps);                                                               \
      r[t] = inverse;                                                                                                  \
      E* o = out + t * out_stride;                                                                                     \
      for (int64_t i = 0; i < H; ++i)                                                                                  \
        o[i] = store_result_##SUF(load_##SUF(w[i]) * ROUND_RESULT_##SUF(load_##SUF(xr[i]) * inverse));                 \
    }                                                                                                                  \
  }

/* g_w (NULL: not asked for) and g_x (NULL: not asked for). The rows are cut into CHUNKS ranges, each summing its
 * own partial g_w; the partials are then added in order, so g_w's bits depend on T, not on the thread count.
 * Returns 1 where the partials' scratch could not be allocated (nothing written), else 0. */
#define CHUNKS 16
#define DEFINE_RMS_NORM_BACKWARD(SUF, E)                                                                               \
  int dockrl_rms_norm_backward_##SUF(const E* x, int64_t x_stride, const E* w, const float* r, const E* g,             \
                                     int64_t g_stride, E* g_x, int64_t g_x_stride, E* g_w, int64_t T,                  \
                                     int64_t H) {                                                                      \
    float* partial = NULL;                                                                                             \
    if (g_w != NULL) {                                                                                                 \
      partial = calloc((size_t)CHUNKS * (size_t)H, sizeof(float));                                                     \
      if (partial == NULL) return 1;                                                                                   \
    }                                                                                                                  \
    _Pragma("omp parallel for schedule(static) if (T * H >= 65536)") for (int64_t c = 0; c < CHUNKS; ++c) {            \
      float* sums = partial == NULL ? NULL : partial + c * H;                                                          \
      for (int64_t t = T * c / CHUNKS; t < T * (c + 1) / CHUNKS; ++t) {                                                \
        const E* xr = x + t * x_stride;                                                                                \
        const E* gr = g + t * g_stride;                                                                                \
        float inverse = r[t];                                                                                          \
        if (sums != NULL)                                                                                              \
          for (int64_t i = 0; i < H; ++i) sums[i] += (load_##SUF(gr[i]) * load_##SUF(xr[i])) * inverse;                \
        if (g_x == NULL) continue;                                                                                     \
        float dot = 0.0f;                                                                                              \
        for (int64_t i = 0; i < H; ++i) dot += (load_##SUF(gr[i]) * load_##SUF(xr[i])) * load_##SUF(w[i]);             \
        float scale = dot * (inverse * inverse * inverse) / (float)H;                                                  \
        E* out = g_x + t * g_x_stride;                                                                                 \
        for (int64_t i = 0; i < H; ++i) {                                                                              \
          float g_y = ROUND_RESULT_##SUF(load_##SUF(gr[i]) * load_##SUF(w[i]));                                        \
          out[i] = store_result_##SUF(g_y * inverse - load_##SUF(xr[i]) * scale);                                      \
        }                                                                                                              \
      }                                                                                                                \
    }                                                                                                                  \
    if (g_w != NULL) {                                                                                                 \
      for (int64_t c = 1; c < CHUNKS; ++c)                                                                             \
        for (int64_t i = 0; i < H; ++i) partial[i] += partial[c * H + i];                                              \
      for (int64_t i = 0; i < H; ++i) g_w[i] = store_result_##SUF(partial[i]);                                         \
      free(partial);                                                                                                   \
    }                                                                                                                  \
    return 0;                                                                                                          \
  }

DEFINE_RMS_NORM_FORWARD(f32, float)
DEFINE_RMS_NORM_FORWARD(bf16, uint16_t)
DEFINE_RMS_NORM_BACKWARD(f32, float)
DEFINE_RMS_NORM_BACKWARD(bf16, uint16_t)
