/* The rollout engine's decode step on a CPU, between its matmuls: the work of one decoder layer for one new
 * token per row that torch would spread over ~50 calls, in three. Built and loaded by
 * dockrl/models/native/__init__.py (the host's C compiler, -O3 -march=native, OpenMP from torch's own
 * runtime); decoder.DecoderModel._decode_natively calls them, the projections stay torch's.
 *
 *   add_rms_norm   x += add (the sublayer's output), h = RMSNorm(x)               (the residual and the norm)
 *   rope_attention RoPE of q and k, k and v into the cache at each row's offset,  (attention, grouped heads
 *                  softmax attention of q over the row's own slots only           read in place)
 *   swiglu         silu(gate) * up                                                (the MLP between its matmuls)
 *
 * Why: at a few rows a decode step's time is the number of calls, not their work (docs/benchmarks.md); and
 * torch's attention runs every row over the batch's longest context (the shorter rows' tail masked, not
 * skipped), where rope_attention reads each row's own slots.
 *
 * Rounding follows torch's ops one by one: every value torch rounds to the activations' dtype E (bf16 or
 * fp32) is rounded here at the same point (round to nearest even), and each op computes in fp32 as torch's
 * CPU kernels do, so the elementwise results are torch's (tests/unit/test_native_decode.py). What differs is
 * the order of sums: RMSNorm's sum of squares and attention's dot products and weighted sums are vectorised
 * here in another order than torch's reductions and batched matmuls (fp32 accumulation-order rounding).
 * The source is compiled with -ffast-math for those sums (reassociation, vector expf); floating-point
 * contraction is off (no FMA where torch rounds a product first), and the one reciprocal square root is a
 * true division (see bf16.h's rms_inverse). Inside attention's dot products and weighted sums, FMAs are written out
 * (score_16, weigh_group): a sum's products unrounded, within the same bound as another order of the sums.
 *
 * E-typed arrays: entry points come in pairs, _f32 (E = float) and _bf16 (E = uint16_t, bfloat16 bits); the KV
 * cache is in E too (kv_layouts.cache_dtype), its values the E values torch would write, and attention reads
 * them as fp32. All strides are in elements.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_GROUP 64
#define MAX_HEAD_DIM 512

/* ---- add_rms_norm ------------------------------------------------------------------------------------------
 * x [B, H] (E, row stride x_stride) += add [B, H] (E, row stride add_stride; NULL: nothing added), then
 * h [B, H] (E, contiguous) = w * E(float(x) * rsqrt(mean(float(x)^2) + eps))   (Hugging Face's RMSNorm order) */
#define DEFINE_ADD_RMS_NORM(SUF, E)                                                                            \
  void dockrl_add_rms_norm_##SUF(E* x, int64_t x_stride, const E* add, int64_t add_stride, const E* w, E* h,  \
                                 int64_t B, int64_t H, float eps) {                                            \
    _Pragma("omp parallel for if (B * H >= 262144)") for (int64_t b = 0; b < B; ++b) {                        \
      E* xr = x + b * x_stride;                                                                                \
      if (add != NULL) {                                                                                       \
        const E* ar = add + b * add_stride;                                                                    \
        for (int64_t i = 0; i < H; ++i) xr[i] = store_##SUF(load_##SUF(xr[i]) + load_##SUF(ar[i]));         \
      }                                                                                                        \
      float inverse = row_rms_inverse_##SUF(xr, H, eps);                                                       \
      E* hr = h + b * H;                                                                                       \
      for (int64_t i = 0; i < H; ++i) {                                                                        \
        float normed = ROUND_##SUF(load_##SUF(xr[i]) * inverse);                                               \
        hr[i] = store_##SUF(load_##SUF(w[i]) * normed);                                                        \
      }                                                                                                        \
    }                                                                                                          \
  }

DEFINE_ADD_RMS_NORM(f32, float)
DEFINE_ADD_RMS_NORM(bf16, uint16_t)

/* ---- swiglu ------------------------------------------------------------------------------------------------
 * out [B, I] (E, contiguous) = E(silu(gate)) * up, gate and up [B, I] (E, row strides given). */
#define DEFINE_SWIGLU(SUF, E)                                                                                  \
  void dockrl_swiglu_##SUF(const E* gate, int64_t gate_stride, const E* up, int64_t up_stride, E* out,        \
                           int64_t B, int64_t I) {                                                             \
    _Pragma("omp parallel for if (B * I >= 262144)") for (int64_t b = 0; b < B; ++b) {                        \
      const E* g = gate + b * gate_stride;                                                                     \
      const E* u = up + b * up_stride;                                                                         \
      E* o = out + b * I;                                                                                      \
      for (int64_t i = 0; i < I; ++i) {                                                                        \
        float x = load_##SUF(g[i]);                                                                            \
        float silu = ROUND_##SUF(x / (1.0f + expf(-x)));                                                       \
        o[i] = store_##SUF(silu * load_##SUF(u[i]));                                                           \
      }                                                                                                        \
    }                                                                                                          \
  }

DEFINE_SWIGLU(f32, float)
DEFINE_SWIGLU(bf16, uint16_t)

/* ---- rope_attention ----------------------------------------------------------------------------------------
 * Per query row b (offset o = offsets[b], length L = lengths[b], its sequence c = cache_rows[b]; cache_rows
 * NULL: c = b, one query per sequence, a decode step):
 *   q [N, D], k [K, D], v [K, D] (E; each a row of q_rows / k_rows / v_rows at its row stride);
 *   q_norm, k_norm [D] (E; NULL: none): per-head RMSNorm first (Qwen3), eps its epsilon;
 *   RoPE as decoder.apply_rope: r = E(E(x * cos) + E(roll(x, D/2) * signed_sin)), cos / signed_sin [B, D] (E);
 *   cache slot o of sequence c, head h gets r(k_h) and v_h (E: the values, exactly), every row's before any
 *   row attends: several query rows of one sequence (a returning turn's new tokens, each at its own offset)
 *   see each other's keys as a prefill would;
 *   out[b, n] = E(softmax(r(q_n) . key_s * scale + bias[b, s]) over s < L, times value_s), key/value head
 *   n / G, G = N / K; bias [B, >= L] fp32 (0 or -inf; NULL: none), a row's last slot never masked.
 * The cache (one layer's keys and values in E, the same layout and strides; read as fp32), num_rows sequences:
 *   slots (table NULL):  [C, K, S, D], slot s of sequence c, head h at c * row + h * head + s * slot;
 *   paged (table [C, M] int64, row stride table_stride): [K, num_blocks, block_size, D], slot s at
 *                        h * head + table[c, s / block_size] * block + (s % block_size) * slot.
 * Returns 0; 1 when G or D is past the bounds below; 2 when scratch memory could not be had; 3 when an
 * offset, a length or a sequence is out of range (o >= capacity, L < 1, L > num_keys, c >= num_rows) or a
 * block a row reads is not in the pool. */
typedef struct {
  const void* keys; /* slot 0 of this (row, head): slots layout; the pool's head h: paged (E elements) */
  const void* vals;
  const int64_t* table; /* this row's blocks, or NULL (slots) */
  int64_t block, block_size, slot;
} Slots;

/* The first slot of a run of contiguous slots [s, s + *count) (count: at most `want`). */
static inline int64_t run_offset(const Slots* at, int64_t s, int64_t want, int64_t* count) {
  if (at->table == NULL) {
    *count = want;
    return s * at->slot;
  }
  int64_t within = s % at->block_size;
  int64_t room = at->block_size - within;
  *count = want < room ? want : room;
  return at->table[s / at->block_size] * at->block + within * at->slot;
}

/* scores[g * len + t] = scale * (q_g . key_t) for the 16 slots t < 16 from k (each `slot` apart), D a
 * multiple of 16. With AVX-512: each slot's D products summed lane-wise in one register, then the 16 registers
 * reduced together (a transpose-and-add tree: 15 adds and 30 shuffles for 16 dot products, where reducing each
 * on its own costs 4 adds and 4 shuffles). Without AVX-512, attend_head's 4-key loop scores every key. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 load16_f32(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 load16_bf16(const uint16_t* x) {
  __m256i bits = _mm256_loadu_si256((const __m256i*)x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
/* r[t] = the sum of v[t]'s 16 lanes. */
static inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {
    __m512d c = _mm512_castps_pd(w[2 * j]), d = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  /* x[j]'s 128-bit lane L holds lane L's partial sums of slots 4j .. 4j + 3 */
  __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
  __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
}
#define DEFINE_SCORE_16(SUF, E)                                                                                \
  static inline void score_16_##SUF(const float* q, const E* k, int64_t slot, int64_t G, int64_t D,           \
                                    int64_t len, float scale, float* scores) {                                 \
    for (int64_t g = 0; g < G; ++g) {                                                                          \
      const float* qg = q + g * D;                                                                             \
      __m512 dots[16];                                                                                         \
      for (int t = 0; t < 16; ++t) dots[t] = _mm512_setzero_ps();                                              \
      for (int64_t d = 0; d < D; d += 16) {                                                                    \
        __m512 qd = _mm512_loadu_ps(qg + d);                                                                   \
        for (int t = 0; t < 16; ++t) dots[t] = _mm512_fmadd_ps(qd, load16_##SUF(k + t * slot + d), dots[t]);  \
      }                                                                                                        \
      _mm512_storeu_ps(scores + g * len, _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale)));                   \
    }                                                                                                          \
  }
/* attend_head's scores in blocks of 16 keys while a run has them (the 4-key loop takes the rest). */
#define SCORE_BLOCKS_OF_16(SUF)                                                                                \
  if (D % 16 == 0)                                                                                             \
    for (; s + 16 <= count; s += 16, k0 += 16 * slot) score_16_##SUF(q, k0, slot, G, D, len, scale, scores + start + s);
#else
#define DEFINE_SCORE_16(SUF, E)
#define SCORE_BLOCKS_OF_16(SUF)
#endif

DEFINE_SCORE_16(f32, float)
DEFINE_SCORE_16(bf16, uint16_t)

/* out[i] = inverse * sum over slots s < len of p[s] * value_s[d + i], i < VALUE_BLOCK: the sums in registers
 * (a fixed-size block the compiler keeps in vector registers), two interleaved sums (even and odd slots) so
 * each add waits on the one before it half as often. */
#define VALUE_BLOCK 32
#define DEFINE_WEIGH_VALUES(SUF, E)                                                                            \
  static inline void weigh_values_##SUF(const Slots* at, const float* p, int64_t len, int64_t d, float inverse,\
                                        float* out) {                                                          \
    float even[VALUE_BLOCK] = {0}, odd[VALUE_BLOCK] = {0};                                                     \
    for (int64_t start = 0; start < len;) {                                                                    \
      int64_t count;                                                                                           \
      const E* v = (const E*)at->vals + run_offset(at, start, len - start, &count) + d;                        \
      const float* w = p + start;                                                                              \
      int64_t s = 0;                                                                                           \
      for (; s + 2 <= count; s += 2, v += 2 * at->slot) {                                                      \
        const E* v1 = v + at->slot;                                                                            \
        for (int64_t i = 0; i < VALUE_BLOCK; ++i) even[i] += w[s] * load_##SUF(v[i]);                          \
        for (int64_t i = 0; i < VALUE_BLOCK; ++i) odd[i] += w[s + 1] * load_##SUF(v1[i]);                      \
      }                                                                                                        \
      if (s < count)                                                                                           \
        for (int64_t i = 0; i < VALUE_BLOCK; ++i) even[i] += w[s] * load_##SUF(v[i]);                          \
      start += count;                                                                                          \
    }                                                                                                          \
    for (int64_t i = 0; i < VALUE_BLOCK; ++i) out[i] = (even[i] + odd[i]) * inverse;                           \
  }                                                                                                            \
  /* The same for the last width < VALUE_BLOCK entries, summed in memory. */                                   \
  static void weigh_values_tail_##SUF(const Slots* at, const float* p, int64_t len, int64_t d, int64_t width,  \
                                      float inverse, float* out) {                                             \
    memset(out, 0, (size_t)width * sizeof(float));                                                             \
    for (int64_t start = 0; start < len;) {                                                                    \
      int64_t count;                                                                                           \
      const E* v = (const E*)at->vals + run_offset(at, start, len - start, &count) + d;                        \
      for (int64_t s = 0; s < count; ++s, v += at->slot)                                                       \
        for (int64_t i = 0; i < width; ++i) out[i] += p[start + s] * load_##SUF(v[i]);                         \
      start += count;                                                                                          \
    }                                                                                                          \
    for (int64_t i = 0; i < width; ++i) out[i] *= inverse;                                                     \
  }

DEFINE_WEIGH_VALUES(f32, float)
DEFINE_WEIGH_VALUES(bf16, uint16_t)

/* With AVX-512, bf16 values and D a multiple of 32: the weighted values of up to 4 query heads of a group in
 * one pass over the keys (weigh_values reads every value once per query head). A row of 32 bf16 values is one
 * 64-byte load, widened in two instructions into its even and its odd entries (each bf16 is the top half of
 * an fp32), each summed in its own registers with FMAs, two interleaved sums (even and odd slots) per head;
 * the entries are put back in order at the end. out[g * D + d] = inverse[g] * sum_s p[g * len + s] * value_s[d]. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define DEFINE_WEIGH_GROUP(GN)                                                                                 \
  static void weigh_group_##GN(const Slots* at, const float* p, int64_t len, int64_t D, const float* inverse,  \
                               float* out, int64_t out_stride) {                                               \
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);                                                  \
    for (int64_t d = 0; d < D; d += 32) {                                                                      \
      __m512 even[GN][2], odd[GN][2];                                                                          \
      for (int g = 0; g < GN; ++g)                                                                             \
        even[g][0] = even[g][1] = odd[g][0] = odd[g][1] = _mm512_setzero_ps();                                 \
      for (int64_t start = 0; start < len;) {                                                                  \
        int64_t count;                                                                                         \
        const uint16_t* v = (const uint16_t*)at->vals + run_offset(at, start, len - start, &count) + d;        \
        int64_t s = 0;                                                                                         \
        for (; s + 2 <= count; s += 2, v += 2 * at->slot) {                                                    \
          __m512i x0 = _mm512_loadu_si512((const void*)v), x1 = _mm512_loadu_si512((const void*)(v + at->slot));\
          __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16));                                          \
          __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(x0, high));                                         \
          __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16));                                          \
          __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(x1, high));                                         \
          for (int g = 0; g < GN; ++g) {                                                                       \
            __m512 w0 = _mm512_set1_ps(p[g * len + start + s]), w1 = _mm512_set1_ps(p[g * len + start + s + 1]);\
            even[g][0] = _mm512_fmadd_ps(w0, e0, even[g][0]);                                                  \
            odd[g][0] = _mm512_fmadd_ps(w0, o0, odd[g][0]);                                                    \
            even[g][1] = _mm512_fmadd_ps(w1, e1, even[g][1]);                                                  \
            odd[g][1] = _mm512_fmadd_ps(w1, o1, odd[g][1]);                                                    \
          }                                                                                                    \
        }                                                                                                      \
        if (s < count) {                                                                                       \
          __m512i x0 = _mm512_loadu_si512((const void*)v);                                                     \
          __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16));                                          \
          __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(x0, high));                                         \
          for (int g = 0; g < GN; ++g) {                                                                       \
            __m512 w0 = _mm512_set1_ps(p[g * len + start + s]);                                                \
            even[g][0] = _mm512_fmadd_ps(w0, e0, even[g][0]);                                                  \
            odd[g][0] = _mm512_fmadd_ps(w0, o0, odd[g][0]);                                                    \
          }                                                                                                    \
        }                                                                                                      \
        start += count;                                                                                        \
      }                                                                                                        \
      for (int g = 0; g < GN; ++g) {                                                                           \
        float e[16], o[16];                                                                                    \
        __m512 scale = _mm512_set1_ps(inverse[g]);                                                             \
        _mm512_storeu_ps(e, _mm512_mul_ps(_mm512_add_ps(even[g][0], even[g][1]), scale));                      \
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_add_ps(odd[g][0], odd[g][1]), scale));                        \
        float* og = out + g * out_stride + d;                                                                  \
        for (int i = 0; i < 16; ++i) {                                                                         \
          og[2 * i] = e[i];                                                                                    \
          og[2 * i + 1] = o[i];                                                                                \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
  }
DEFINE_WEIGH_GROUP(1)
DEFINE_WEIGH_GROUP(2)
DEFINE_WEIGH_GROUP(3)
DEFINE_WEIGH_GROUP(4)
/* bf16 values, D % 32 == 0: every head of the group, four at a time (1 where it does not apply). */
static int weigh_grouped_bf16(const Slots* at, const float* scores, int64_t len, int64_t G, int64_t D,
                              const float* inverse, float* out) {
  if (D % 32 != 0) return 0;
  for (int64_t g = 0; g < G; g += 4) {
    const float* p = scores + g * len;
    switch (G - g < 4 ? G - g : 4) {
      case 1: weigh_group_1(at, p, len, D, inverse + g, out + g * D, D); break;
      case 2: weigh_group_2(at, p, len, D, inverse + g, out + g * D, D); break;
      case 3: weigh_group_3(at, p, len, D, inverse + g, out + g * D, D); break;
      default: weigh_group_4(at, p, len, D, inverse + g, out + g * D, D); break;
    }
  }
  return 1;
}
#define WEIGH_GROUPED_bf16(at, scores, len, G, D, inverse, out) weigh_grouped_bf16(at, scores, len, G, D, inverse, out)
#else
#define WEIGH_GROUPED_bf16(at, scores, len, G, D, inverse, out) 0
#endif
#define WEIGH_GROUPED_f32(at, scores, len, G, D, inverse, out) 0

#define DEFINE_ATTEND_HEAD(SUF, E)                                                                                     \
  static void attend_head_##SUF(const float* q, const Slots* at, int64_t len, const float* bias, float* out, int64_t G,\
                          int64_t D, float scale, float* scores) {                                                     \
    float top[MAX_GROUP], total[MAX_GROUP];                                                                            \
    int64_t slot = at->slot;                                                                                           \
    /* Scores four slots at a time: four independent sums per query head keep the vector units busy where one          \
     * dot product of D terms would wait on its own horizontal reduction. */                                           \
    for (int64_t start = 0; start < len;) {                                                                            \
      int64_t count;                                                                                                   \
      const E* k0 = (const E*)at->keys + run_offset(at, start, len - start, &count);                                   \
      int64_t s = 0;                                                                                                   \
      SCORE_BLOCKS_OF_16(SUF)                                                                                          \
      for (; s + 4 <= count; s += 4) {                                                                                 \
        const E* k1 = k0 + slot;                                                                                       \
        const E* k2 = k1 + slot;                                                                                       \
        const E* k3 = k2 + slot;                                                                                       \
        for (int64_t g = 0; g < G; ++g) {                                                                              \
          const float* qg = q + g * D;                                                                                 \
          float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;                                                            \
          for (int64_t d = 0; d < D; ++d) {                                                                            \
            d0 += qg[d] * load_##SUF(k0[d]);                                                                           \
            d1 += qg[d] * load_##SUF(k1[d]);                                                                           \
            d2 += qg[d] * load_##SUF(k2[d]);                                                                           \
            d3 += qg[d] * load_##SUF(k3[d]);                                                                           \
          }                                                                                                            \
          float* sc = scores + g * len + start + s;                                                                    \
          sc[0] = d0 * scale;                                                                                          \
          sc[1] = d1 * scale;                                                                                          \
          sc[2] = d2 * scale;                                                                                          \
          sc[3] = d3 * scale;                                                                                          \
        }                                                                                                              \
        k0 = k3 + slot;                                                                                                \
      }                                                                                                                \
      for (; s < count; ++s, k0 += slot) {                                                                             \
        for (int64_t g = 0; g < G; ++g) {                                                                              \
          const float* qg = q + g * D;                                                                                 \
          float dot = 0.0f;                                                                                            \
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * load_##SUF(k0[d]);                                            \
          scores[g * len + start + s] = dot * scale;                                                                   \
        }                                                                                                              \
      }                                                                                                                \
      start += count;                                                                                                  \
    }                                                                                                                  \
    /* The bias: 0 adds nothing (exact, as torch's bias + scale * scores); a masked slot is set to -FLT_MAX,           \
     * whose exponential below underflows to 0. A row's own (last) slot is never masked. */                            \
    if (bias != NULL) {                                                                                                \
      for (int64_t g = 0; g < G; ++g) {                                                                                \
        float* sc = scores + g * len;                                                                                  \
        for (int64_t t = 0; t + 1 < len; ++t) sc[t] = bias[t] <= -1e30f ? -FLT_MAX : sc[t] + bias[t];                  \
      }                                                                                                                \
    }                                                                                                                  \
    for (int64_t g = 0; g < G; ++g) {                                                                                  \
      const float* sc = scores + g * len;                                                                              \
      float m = -FLT_MAX;                                                                                              \
      for (int64_t t = 0; t < len; ++t) m = fmaxf(m, sc[t]);                                                           \
      top[g] = m;                                                                                                      \
    }                                                                                                                  \
    for (int64_t g = 0; g < G; ++g) {                                                                                  \
      float* sc = scores + g * len;                                                                                    \
      float sum = 0.0f;                                                                                                \
      for (int64_t t = 0; t < len; ++t) {                                                                              \
        float e = expf(sc[t] - top[g]);                                                                                \
        sc[t] = e;                                                                                                     \
        sum += e;                                                                                                      \
      }                                                                                                                \
      total[g] = sum;                                                                                                  \
    }                                                                                                                  \
    float inverses[MAX_GROUP];                                                                                         \
    for (int64_t g = 0; g < G; ++g) inverses[g] = 1.0f / total[g];                                                     \
    if (WEIGH_GROUPED_##SUF(at, scores, len, G, D, inverses, out)) return;                                            \
    for (int64_t g = 0; g < G; ++g) {                                                                                  \
      const float* p = scores + g * len;                                                                               \
      int64_t d = 0;                                                                                                   \
      for (; d + VALUE_BLOCK <= D; d += VALUE_BLOCK) weigh_values_##SUF(at, p, len, d, inverses[g], out + g * D + d);  \
      if (d < D) weigh_values_tail_##SUF(at, p, len, d, D - d, inverses[g], out + g * D + d);                         \
    }                                                                                                                  \
  }

DEFINE_ATTEND_HEAD(f32, float)
DEFINE_ATTEND_HEAD(bf16, uint16_t)

/* One head's E values as floats, RMS-normed per head first when norm_w is given (Qwen3's q_norm / k_norm,
 * the same rounding as add_rms_norm), then RoPE as decoder.apply_rope:
 * out = E(E(x * cos) + E(roll(x, D/2) * signed_sin)). */
#define DEFINE_ROPE(SUF, E)                                                                                    \
  static inline void rope_##SUF(const E* src, const E* norm_w, float eps, const E* cos, const E* sin,         \
                                float* x, float* out, int64_t D) {                                             \
    for (int64_t d = 0; d < D; ++d) x[d] = load_##SUF(src[d]);                                                 \
    if (norm_w != NULL) {                                                                                      \
      float squares = 0.0f;                                                                                    \
      for (int64_t d = 0; d < D; ++d) squares += x[d] * x[d];                                                  \
      float inverse = rms_inverse(squares / (float)D + eps);                                                   \
      for (int64_t d = 0; d < D; ++d) x[d] = ROUND_##SUF(load_##SUF(norm_w[d]) * ROUND_##SUF(x[d] * inverse)); \
    }                                                                                                          \
    int64_t half = D / 2;                                                                                      \
    for (int64_t d = 0; d < half; ++d) {                                                                       \
      float a = ROUND_##SUF(x[d] * load_##SUF(cos[d]));                                                        \
      float b = ROUND_##SUF(x[d + half] * load_##SUF(sin[d]));                                                 \
      out[d] = ROUND_##SUF(a + b);                                                                             \
    }                                                                                                          \
    for (int64_t d = half; d < D; ++d) {                                                                       \
      float a = ROUND_##SUF(x[d] * load_##SUF(cos[d]));                                                        \
      float b = ROUND_##SUF(x[d - half] * load_##SUF(sin[d]));                                                 \
      out[d] = ROUND_##SUF(a + b);                                                                             \
    }                                                                                                          \
  }

DEFINE_ROPE(f32, float)
DEFINE_ROPE(bf16, uint16_t)

/* Whether row b's offset and length are in range and every block it touches is in the pool. */
static int row_in_range(int64_t offset, int64_t length, int64_t num_keys, int64_t capacity, const int64_t* table,
                        int64_t block_size, int64_t num_blocks) {
  if (offset < 0 || offset >= capacity || length < 1 || length > num_keys) return 0;
  if (table == NULL) return 1;
  int64_t last = (offset > length - 1 ? offset : length - 1) / block_size;
  for (int64_t j = 0; j <= last; ++j)
    if (table[j] < 0 || table[j] >= num_blocks) return 0;
  return 1;
}

#define DEFINE_ROPE_ATTENTION(SUF, E)                                                                          \
  int dockrl_rope_attention_##SUF(                                                                             \
      const E* q_rows, int64_t q_stride, const E* k_rows, int64_t k_stride, const E* v_rows, int64_t v_stride, \
      const E* q_norm, const E* k_norm, float eps, const E* cos, const E* sin, E* cache_k, E* cache_v,         \
      int64_t row, int64_t head, int64_t block, int64_t slot, const int64_t* table, int64_t table_stride,     \
      int64_t block_size, int64_t num_blocks, int64_t capacity, const int64_t* cache_rows, int64_t num_rows,  \
      const int64_t* offsets, const int64_t* lengths, int64_t num_keys, const float* bias, int64_t bias_stride,\
      E* out, int64_t B, int64_t N, int64_t K, int64_t D, float scale) {                                       \
    int64_t G = N / K;                                                                                         \
    if (G > MAX_GROUP || D > MAX_HEAD_DIM || G * K != N || D % 2 != 0) return 1;                               \
    int64_t longest = 1;                                                                                       \
    for (int64_t b = 0; b < B; ++b) {                                                                          \
      int64_t c = cache_rows == NULL ? b : cache_rows[b];                                                      \
      if (c < 0 || c >= num_rows ||                                                                            \
          !row_in_range(offsets[b], lengths[b], num_keys, capacity,                                            \
                        table == NULL ? NULL : table + c * table_stride, block_size, num_blocks))              \
        return 3;                                                                                              \
      longest = lengths[b] > longest ? lengths[b] : longest;                                                   \
    }                                                                                                          \
    int failed = 0;                                                                                            \
    _Pragma("omp parallel if (B * N * longest >= 16384)") {                                                    \
      float* scratch = malloc((size_t)(G * longest + 2 * G * D + D) * sizeof(float));                         \
      if (scratch == NULL) {                                                                                   \
        _Pragma("omp atomic write") failed = 1;                                                                \
      }                                                                                                        \
      _Pragma("omp barrier") if (!failed) {                                                                    \
        float* q_rot = scratch + G * longest;                                                                  \
        float* attended = q_rot + G * D;                                                                       \
        float* one_head = attended + G * D;                                                                    \
        /* every row's key and value into the cache first (the loop's end is a barrier) */                     \
        _Pragma("omp for schedule(static)") for (int64_t task = 0; task < B * K; ++task) {                     \
          int64_t b = task / K, h = task % K;                                                                  \
          int64_t c = cache_rows == NULL ? b : cache_rows[b];                                                  \
          Slots at = {NULL, NULL, table == NULL ? NULL : table + c * table_stride, block, block_size, slot};   \
          int64_t base = h * head + (table == NULL ? c * row : 0);                                             \
          int64_t count;                                                                                       \
          int64_t here = base + run_offset(&at, offsets[b], 1, &count);                                        \
          rope_##SUF(k_rows + b * k_stride + h * D, k_norm, eps, cos + b * D, sin + b * D, one_head, q_rot, D);\
          for (int64_t d = 0; d < D; ++d) cache_k[here + d] = store_##SUF(q_rot[d]);                           \
          memcpy(cache_v + here, v_rows + b * v_stride + h * D, (size_t)D * sizeof(E));                        \
        }                                                                                                      \
        _Pragma("omp for schedule(dynamic, 2)") for (int64_t task = 0; task < B * K; ++task) {                \
          int64_t b = task / K, h = task % K;                                                                  \
          int64_t c = cache_rows == NULL ? b : cache_rows[b];                                                  \
          Slots at = {NULL, NULL, table == NULL ? NULL : table + c * table_stride, block, block_size, slot};   \
          int64_t base = h * head + (table == NULL ? c * row : 0);                                             \
          at.keys = cache_k + base;                                                                            \
          at.vals = cache_v + base;                                                                            \
          for (int64_t g = 0; g < G; ++g)                                                                      \
            rope_##SUF(q_rows + b * q_stride + (h * G + g) * D, q_norm, eps, cos + b * D, sin + b * D,        \
                       one_head, q_rot + g * D, D);                                                            \
          attend_head_##SUF(q_rot, &at, lengths[b], bias == NULL ? NULL : bias + b * bias_stride, attended, G, \
                            D, scale, scratch);                                                                \
          E* o = out + b * N * D + h * G * D;                                                                  \
          for (int64_t i = 0; i < G * D; ++i) o[i] = store_##SUF(attended[i]);                                 \
        }                                                                                                      \
      }                                                                                                        \
      free(scratch);                                                                                           \
    }                                                                                                          \
    return failed ? 2 : 0;                                                                                     \
  }

DEFINE_ROPE_ATTENTION(f32, float)
DEFINE_ROPE_ATTENTION(bf16, uint16_t)
