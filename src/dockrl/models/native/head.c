/* The fused LM head's softmax work on a CPU (dockrl.algos.head_logprobs), between its matmuls: what torch would
 * do in ~10 passes over a chunk's [c, V] fp32 logits, in one pass over the matmul's own output. Built and
 * loaded by dockrl/models/native/__init__.py with decode.c; called through models/native/head.py.
 *
 *   head_max    peak[r] = max_j z[r, j] / T                                   (the forward's shift)
 *   head_sums   sum_exp[r] = sum_j e^(x_j - peak[r]),                         (logsumexp and sum p z, as
 *               weighted[r] = sum_j e^(x_j - peak[r]) (x_j - peak[r])           _logit_stats)
 *   head_grad   dz[r, j] = (-(p_j coef_r) + sum_i g_i [id_i = j]) / T           (d loss / d z, as _chunk_grad,
 *               p_j = e^(x_j - lse[r]), coef_r = (x_j - mean_z[r]) g_H[r] + sum_i g_i  written in z's place)
 *   accumulate  dst (fp32) += src (E)                                           (the head weight's gradient)
 *
 * with x_j = z[r, j] / T, z the matmul's output [rows, V] (E, row stride ldz). What torch computes per element
 * in fp32 (the logits widened from E, divided by T, the same products and sums in the same order per element)
 * is computed here per element the same way, except for three roundings: x is z times the rounded 1 / T
 * (-ffast-math's reciprocal, which gcc applies even with -fno-reciprocal-math: within 2 ulps of torch's z / T,
 * the same at T = 1), the order of each row's two sums (vectorised here, torch's reduction elsewhere), and the
 * exponential (glibc's vector expf against torch's Sleef, each within an ulp or two of the true value). The
 * tests bound what that moves (tests/unit/test_head_logprobs.py).
 * The E-rounding of dz happens once, at the end, where _chunk_grad's result is cast to the compute dtype.
 *
 * -ffast-math lets the sums vectorise (reassociation) and expf take glibc's vector variants; contraction is off
 * (no FMA where torch rounds a product first). A NaN in the logits is not guaranteed to propagate here
 * (-ffinite-math-only): the caller checks the losses it builds from these (the update's non-finite check).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Rows in parallel where a chunk is large enough to pay for the threads' start (a chunk is ~2M elements). */
#define HEAD_PARALLEL _Pragma("omp parallel for schedule(static) if (rows * vocab >= 262144)")

#define DEFINE_HEAD(SUF, E)                                                                                    \
  void dockrl_head_max_##SUF(const E* z, int64_t rows, int64_t vocab, int64_t ldz, float temperature,         \
                             float* peak) {                                                                    \
    HEAD_PARALLEL for (int64_t r = 0; r < rows; ++r) {                                                         \
      const E* zr = z + r * ldz;                                                                               \
      float top = -FLT_MAX;                                                                                    \
      _Pragma("omp simd reduction(max : top)") for (int64_t j = 0; j < vocab; ++j) top =                      \
          fmaxf(top, load_##SUF(zr[j]));                                                                  \
      peak[r] = top / temperature; /* max(z) / T = max(z / T): division by T > 0 keeps the order */          \
    }                                                                                                          \
  }                                                                                                            \
                                                                                                               \
  void dockrl_head_sums_##SUF(const E* z, int64_t rows, int64_t vocab, int64_t ldz, float temperature,        \
                              const float* peak, float* sum_exp, float* weighted) {                           \
    HEAD_PARALLEL for (int64_t r = 0; r < rows; ++r) {                                                         \
      const E* zr = z + r * ldz;                                                                               \
      const float top = peak[r];                                                                               \
      float total = 0.0f, moment = 0.0f;                                                                       \
      _Pragma("omp simd reduction(+ : total, moment)") for (int64_t j = 0; j < vocab; ++j) {                  \
        float x = load_##SUF(zr[j]) / temperature - top;                                                  \
        float e = expf(x);                                                                                     \
        total += e;                                                                                            \
        moment += e * x;                                                                                       \
      }                                                                                                        \
      sum_exp[r] = total;                                                                                      \
      weighted[r] = moment;                                                                                    \
    }                                                                                                          \
  }                                                                                                            \
                                                                                                               \
  /* g_entropy [rows] (NULL: no entropy term), g_sum [rows] (sum_i g_i; NULL: none), ids [rows, m] local ids   \
   * (-1: outside this rank's slice; NULL: none) with their gradients g_ids and logits z_ids [rows, m] (z's    \
   * entries at ids, taken before dz overwrites them: dz may be z). */                                         \
  void dockrl_head_grad_##SUF(const E* z, int64_t rows, int64_t vocab, int64_t ldz, float temperature,        \
                              const float* lse, const float* mean_z, const float* g_entropy,                  \
                              const float* g_sum, const int64_t* ids, const float* g_ids,                     \
                              const float* z_ids, int64_t m, E* dz, int64_t ldd) {                            \
    HEAD_PARALLEL for (int64_t r = 0; r < rows; ++r) {                                                         \
      const E* zr = z + r * ldz;                                                                               \
      E* dr = dz + r * ldd;                                                                                    \
      const float shift = lse[r], mean = mean_z[r];                                                            \
      const float ge = g_entropy != NULL ? g_entropy[r] : 0.0f, gs = g_sum != NULL ? g_sum[r] : 0.0f;        \
      const int entropy = g_entropy != NULL;                                                                   \
      _Pragma("omp simd") for (int64_t j = 0; j < vocab; ++j) {                                                \
        float x = load_##SUF(zr[j]) / temperature;                                                        \
        float p = expf(x - shift);                                                                             \
        float coef = (entropy ? (x - mean) * ge : 0.0f) + gs;                                                  \
        dr[j] = store_##SUF(-(p * coef) / temperature);                                                   \
      }                                                                                                        \
      if (ids == NULL) continue;                                                                               \
      const int64_t* row_ids = ids + r * m;                                                                    \
      for (int64_t i = 0; i < m; ++i) { /* each id once, its gradients added in order (torch's scatter_add) */ \
        int64_t j = row_ids[i], seen = 0;                                                                      \
        for (int64_t k = 0; k < i; ++k) seen |= row_ids[k] == j;                                               \
        if (j < 0 || seen) continue;                                                                           \
        float x = z_ids[r * m + i] / temperature;                                                              \
        float p = expf(x - shift);                                                                             \
        float value = -(p * ((entropy ? (x - mean) * ge : 0.0f) + gs));                                        \
        for (int64_t k = i; k < m; ++k)                                                                        \
          if (row_ids[k] == j) value += g_ids[r * m + k];                                                      \
        dr[j] = store_##SUF(value / temperature);                                                         \
      }                                                                                                        \
    }                                                                                                          \
  }                                                                                                            \
                                                                                                               \
  void dockrl_head_accumulate_##SUF(float* dst, const E* src, int64_t n) {                                     \
    _Pragma("omp parallel for simd schedule(static) if (n >= 262144)") for (int64_t i = 0; i < n; ++i) dst[i] += \
        load_##SUF(src[i]);                                                                               \
  }

DEFINE_HEAD(f32, float)
DEFINE_HEAD(bf16, uint16_t)
