/* Training's causal attention backward on a CPU (dockrl.models.attention._CpuCausalAttention), in one call per
 * layer instead of torch's ~12 calls per query block over fp32 score buffers. Built and loaded by
 * dockrl/models/native/__init__.py (`attention_backward`).
 *
 *   per batch row b and key/value head h (in parallel), keys and values widened to fp32 once, then per query head
 *   n of its group and per block of QB queries [i0, i0 + R), keys [0, i0 + R):
 *     s_ij   = q_i . k_j * scale              (QB x 16 scores at a time, in registers)
 *     dp_ij  = dout_i . v_j
 *     p_ij   = softmax_j<=i(s_ij)             (the row's own keys only: causal)
 *     ds_ij  = p_ij (dp_ij - delta_i) scale    delta_i = dout_i . out_i
 *     dq_i   = sum_j ds_ij k_j                (written once per query)
 *     dk_j  += sum_i ds_ij q_i, dv_j += sum_i p_ij dout_i   (fp32 sums over the group and the blocks, written once)
 *
 * Every product and sum is fp32 from the E values (E = float or bfloat16 bits); the results are rounded to E once.
 * torch's path rounds the probabilities, dp and ds to bf16 on the way (its matmuls take bf16 operands), so this
 * is the same math with fewer roundings: the tests hold both to the same bf16 bounds against float64
 * (tests/unit/test_attention.py). -ffast-math lets the sums vectorise in another order (fp32 rounding).
 *
 * Strides are in elements: q, out, dout, dq [B, N, T, D] and k, v, dk, dv [B, K, T, D], each given as its (b,
 * head, token) strides, D contiguous. Returns 0, or 1 where a thread's scratch could not be allocated.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define QB 8  /* queries per block: the keys' gradients are read and written once per block */
#define JB 16 /* keys per score block: one vector */

/* 16 floats in one vector (two on AVX2), loaded and stored unaligned: sums held in registers */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
static inline v16 load16(const float* p) { return *(const v16u*)p; }
static inline void store16(float* p, v16 x) { *(v16u*)p = x; }

/* out[r][j0 + l] = sum_d rows[r][d] cols[d][j0 + l] for QB rows [QB, D] and 16 columns of cols [D, ld_cols] */
static inline void block_dots(const float* rows, const float* cols, int64_t ld_cols, int64_t D, int64_t j0,
                              float* out, int64_t ld_out) {
  v16 acc[QB];
  for (int r = 0; r < QB; ++r) acc[r] = (v16){0};
  for (int64_t d = 0; d < D; ++d) {
    const v16 col = load16(cols + d * ld_cols + j0);
    for (int r = 0; r < QB; ++r) acc[r] += rows[r * D + d] * col;
  }
  for (int r = 0; r < QB; ++r) store16(out + r * ld_out + j0, acc[r]);
}

/* out[d] = sum_{j < n} w[j] rows[j][d] (rows [n, D]); the sums in registers where D is 32, 64 or 128 */
#define DEFINE_WEIGH(NV)                                                                                      \
  static void weigh_##NV(const float* w, const float* rows, int64_t n, float* out) {                          \
    v16 acc[NV];                                                                                              \
    for (int c = 0; c < NV; ++c) acc[c] = (v16){0};                                                           \
    for (int64_t j = 0; j < n; ++j)                                                                           \
      for (int c = 0; c < NV; ++c) acc[c] += w[j] * load16(rows + j * 16 * NV + 16 * c);                     \
    for (int c = 0; c < NV; ++c) store16(out + 16 * c, acc[c]);                                               \
  }
DEFINE_WEIGH(2)
DEFINE_WEIGH(4)
DEFINE_WEIGH(8)

static void weigh_rows(const float* w, const float* rows, int64_t n, int64_t D, float* out) {
  if (D == 32) {
    weigh_2(w, rows, n, out);
    return;
  }
  if (D == 64) {
    weigh_4(w, rows, n, out);
    return;
  }
  if (D == 128) {
    weigh_8(w, rows, n, out);
    return;
  }
  for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) out[d] += w[j] * rows[j * D + d];
}

/* dk[j] += sum_r ds[r][j] q[r], dv[j] += sum_r p[r][j] dout[r] for keys j < L and rows r < R (ds, p [R, ld]) */
#define DEFINE_KEYS(NV)                                                                                       \
  static void keys_##NV(const float* ds, const float* p, int64_t ld, const float* q, const float* dout,      \
                        int64_t R, int64_t L, float* dk, float* dv) {                                         \
    for (int64_t j = 0; j < L; ++j) {                                                                         \
      v16 ak[NV], av[NV];                                                                                     \
      float* dkj = dk + j * 16 * NV;                                                                          \
      float* dvj = dv + j * 16 * NV;                                                                          \
      for (int c = 0; c < NV; ++c) {                                                                          \
        ak[c] = load16(dkj + 16 * c);                                                                         \
        av[c] = load16(dvj + 16 * c);                                                                         \
      }                                                                                                       \
      for (int64_t r = 0; r < R; ++r) {                                                                       \
        const float dsr = ds[r * ld + j], pr = p[r * ld + j];                                                 \
        for (int c = 0; c < NV; ++c) {                                                                        \
          ak[c] += dsr * load16(q + r * 16 * NV + 16 * c);                                                    \
          av[c] += pr * load16(dout + r * 16 * NV + 16 * c);                                                  \
        }                                                                                                     \
      }                                                                                                       \
      for (int c = 0; c < NV; ++c) {                                                                          \
        store16(dkj + 16 * c, ak[c]);                                                                         \
        store16(dvj + 16 * c, av[c]);                                                                         \
      }                                                                                                       \
    }                                                                                                         \
  }
DEFINE_KEYS(2)
DEFINE_KEYS(4)
DEFINE_KEYS(8)

static void accumulate_keys(const float* ds, const float* p, int64_t ld, const float* q, const float* dout,
                            int64_t R, int64_t L, int64_t D, float* dk, float* dv) {
  if (D == 32) {
    keys_2(ds, p, ld, q, dout, R, L, dk, dv);
    return;
  }
  if (D == 64) {
    keys_4(ds, p, ld, q, dout, R, L, dk, dv);
    return;
  }
  if (D == 128) {
    keys_8(ds, p, ld, q, dout, R, L, dk, dv);
    return;
  }
  for (int64_t j = 0; j < L; ++j)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t d = 0; d < D; ++d) {
        dk[j * D + d] += ds[r * ld + j] * q[r * D + d];
        dv[j * D + d] += p[r * ld + j] * dout[r * D + d];
      }
}

/* One query block's probabilities (in s) and ds (in dp) for rows r < R, each over its own keys j <= i0 + r, zero
 * past them up to L; dq of each row into dq [QB, D]. s and dp hold the raw dot products on entry. */
static void block_softmax_grads(float* s, float* dp, int64_t ld, const float* delta, int64_t i0, int64_t R,
                                int64_t L, const float* keys, int64_t D, float scale, float* dq) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * ld;
    float* dpr = dp + r * ld;
    const int64_t own = i0 + r + 1;
    float top = -FLT_MAX;
    for (int64_t j = 0; j < own; ++j) {
      sr[j] *= scale;
      top = fmaxf(top, sr[j]);
    }
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < own; ++j) {
      sr[j] = expf(sr[j] - top);
      total += sr[j];
    }
    const float inverse = 1.0f / total, dr = delta[r];
#pragma omp simd
    for (int64_t j = 0; j < own; ++j) {
      const float p = sr[j] * inverse;
      sr[j] = p;
      dpr[j] = p * (dpr[j] - dr) * scale;
    }
    for (int64_t j = own; j < L; ++j) sr[j] = dpr[j] = 0.0f;
    weigh_rows(dpr, keys, own, D, dq + r * D);
  }
}

#define DEFINE_ATTENTION_BACKWARD(SUF, E)                                                                     \
  int dockrl_attention_backward_##SUF(const E* q, const int64_t* qs, const E* k, const int64_t* ks,          \
                                      const E* v, const int64_t* vs, const E* out, const int64_t* os,        \
                                      const E* dout, const int64_t* dos, E* dq, const int64_t* dqs, E* dk,   \
                                      const int64_t* dks, E* dv, const int64_t* dvs, int64_t B, int64_t N,   \
                                      int64_t K, int64_t T, int64_t D, float scale) {                        \
    const int64_t G = N / K, TP = (T + JB - 1) / JB * JB; /* TP: T padded to whole score blocks */          \
    int failed = 0;                                                                                           \
    _Pragma("omp parallel") {                                                                                 \
      float* scratch = malloc(sizeof(float) * (3 * TP * D + 2 * T * D + 2 * QB * TP + 3 * QB * D + QB));    \
      if (scratch == NULL) {                                                                                  \
        _Pragma("omp atomic write") failed = 1;                                                               \
      }                                                                                                       \
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t bh = 0; bh < B * K; ++bh) {                        \
        if (scratch == NULL) continue;                                                                        \
        const int64_t b = bh / K, h = bh % K;                                                                 \
        /* keys and values by column (the score blocks), keys by row (dq); the fp32 sums of dk and dv */      \
        float *k_cols = scratch, *v_cols = k_cols + TP * D, *k_rows = v_cols + TP * D;                        \
        float *dk_sum = k_rows + TP * D, *dv_sum = dk_sum + T * D;                                            \
        float *s = dv_sum + T * D, *dp = s + QB * TP, *q_blk = dp + QB * TP, *dout_blk = q_blk + QB * D;     \
        float *dq_blk = dout_blk + QB * D, *delta = dq_blk + QB * D;                                          \
        const E* kb = k + b * ks[0] + h * ks[1];                                                              \
        const E* vb = v + b * vs[0] + h * vs[1];                                                              \
        for (int64_t j = 0; j < TP; ++j)                                                                      \
          for (int64_t d = 0; d < D; ++d) {                                                                   \
            const float kv = j < T ? load_##SUF(kb[j * ks[2] + d]) : 0.0f;                                \
            const float vv = j < T ? load_##SUF(vb[j * vs[2] + d]) : 0.0f;                                \
            k_cols[d * TP + j] = kv;                                                                          \
            v_cols[d * TP + j] = vv;                                                                          \
            k_rows[j * D + d] = kv;                                                                           \
          }                                                                                                   \
        memset(dk_sum, 0, sizeof(float) * 2 * T * D);                                                        \
        for (int64_t n = h * G; n < (h + 1) * G; ++n) {                                                       \
          for (int64_t i0 = 0; i0 < T; i0 += QB) {                                                            \
            const int64_t R = T - i0 < QB ? T - i0 : QB, L = i0 + R;                                          \
            for (int64_t r = 0; r < QB; ++r) { /* rows past R are zeros: their scores are never read */       \
              float dl = 0.0f;                                                                                \
              if (r < R) {                                                                                    \
                const int64_t i = i0 + r;                                                                     \
                const E* qr = q + b * qs[0] + n * qs[1] + i * qs[2];                                          \
                const E* orow = out + b * os[0] + n * os[1] + i * os[2];                                      \
                const E* gr = dout + b * dos[0] + n * dos[1] + i * dos[2];                                    \
                for (int64_t d = 0; d < D; ++d) {                                                             \
                  q_blk[r * D + d] = load_##SUF(qr[d]);                                                   \
                  dout_blk[r * D + d] = load_##SUF(gr[d]);                                                \
                  dl += dout_blk[r * D + d] * load_##SUF(orow[d]);                                        \
                }                                                                                             \
              } else {                                                                                        \
                memset(q_blk + r * D, 0, sizeof(float) * D);                                                  \
                memset(dout_blk + r * D, 0, sizeof(float) * D);                                               \
              }                                                                                               \
              delta[r] = dl;                                                                                  \
            }                                                                                                 \
            for (int64_t j0 = 0; j0 < L; j0 += JB) {                                                          \
              block_dots(q_blk, k_cols, TP, D, j0, s, TP);                                                    \
              block_dots(dout_blk, v_cols, TP, D, j0, dp, TP);                                                \
            }                                                                                                 \
            block_softmax_grads(s, dp, TP, delta, i0, R, L, k_rows, D, scale, dq_blk);                        \
            for (int64_t r = 0; r < R; ++r) {                                                                 \
              E* dqr = dq + b * dqs[0] + n * dqs[1] + (i0 + r) * dqs[2];                                      \
              for (int64_t d = 0; d < D; ++d) dqr[d] = store_##SUF(dq_blk[r * D + d]);                   \
            }                                                                                                 \
            accumulate_keys(dp, s, TP, q_blk, dout_blk, R, L, D, dk_sum, dv_sum);                             \
          }                                                                                                   \
        }                                                                                                     \
        E* dkb = dk + b * dks[0] + h * dks[1];                                                                \
        E* dvb = dv + b * dvs[0] + h * dvs[1];                                                                \
        for (int64_t j = 0; j < T; ++j)                                                                       \
          for (int64_t d = 0; d < D; ++d) {                                                                   \
            dkb[j * dks[2] + d] = store_##SUF(dk_sum[j * D + d]);                                         \
            dvb[j * dvs[2] + d] = store_##SUF(dv_sum[j * D + d]);                                         \
          }                                                                                                   \
      }                                                                                                       \
      free(scratch);                                                                                          \
    }                                                                                                         \
    return failed;                                                                                            \
  }

DEFINE_ATTENTION_BACKWARD(f32, float)
DEFINE_ATTENTION_BACKWARD(bf16, uint16_t)
