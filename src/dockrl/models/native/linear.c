/* The rollout engine's bf16 projections on a CPU with AMX tiles (models/packed_linear.py): y = x @ W^T + bias,
 * with W packed once per weight version into the tiles' layout. Built beside decode.c by
 * dockrl/models/native/__init__.py; where the compiler or the CPU has no AMX (AVX2 hosts, or a kernel that does
 * not let this process use the tiles) dockrl_linear_ready() is 0 and the projections stay oneDNN's.
 *
 * Why: oneDNN's bf16 matmul costs ~35 us a call at a few rows whatever its size (its primitive lookup and
 * tile setup), and a decode step at 8 rows makes 33 of them (docs/benchmarks.md); the tiles' own work for a
 * 256 x 512 projection of 8 rows is ~10 us. Here a call costs the tiles' work and one tile configuration.
 *
 * Packing: W [N, K] (bf16, row-major) -> for each block of 16 output columns, for each block of 32 inputs, one
 * 1 KiB tile of 16 rows (input pairs) x 16 columns x 2 (the pair), zero past N and K: the layout TDPBF16PS
 * reads its second operand in, each column block's tiles contiguous over K.
 *
 * Rounding: each output is sum over k of x[k] * W[n, k] in fp32, summed by TDPBF16PS in the order of the
 * 32-input blocks (each instruction adds one block's pair products to the fp32 accumulator), then the bias
 * added in fp32 and the sum rounded to bf16 (nearest even): the order oneDNN's AMX kernel sums in where it does
 * not split K over threads (then its results are bit for bit these; tests/unit/test_native_linear.py bounds
 * them by the fp32 accumulation error either way).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where this process may use the tiles (Linux grants them per process on request), else 0. */
int dockrl_linear_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

/* Tile roles. One row block (rows0 <= 16): C 0-3 for up to four column blocks, A 4, B 5-7 (rotating).
 * Two row blocks (rows1 rows in the second): C 0, 1 (first) and 2, 3 (second) for two column blocks, A 4 and
 * 5, B 6 and 7. */
static void configure(int rows0, int rows1) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  if (rows1 == 0) {
    for (int t = 0; t < 5; ++t) cfg.rows[t] = (uint8_t)rows0;
    for (int t = 5; t < 8; ++t) cfg.rows[t] = 16;
  } else {
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)rows0;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)rows1;
    cfg.rows[6] = cfg.rows[7] = 16;
  }
  _tile_loadconfig(&cfg);
}

void dockrl_linear_pack_bf16(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  int64_t col_blocks = (N + 15) / 16, k_blocks = (K + 31) / 32;
#pragma omp parallel for
  for (int64_t nb = 0; nb < col_blocks; ++nb)
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      uint16_t* tile = out + (nb * k_blocks + kb) * 512;
      if (nb * 16 + 16 <= N && kb * 32 + 32 <= K) { /* a whole tile: a 16 x 16 transpose of input pairs */
        uint32_t* pairs = (uint32_t*)tile;
        for (int c = 0; c < 16; ++c) {
          uint32_t column[16];
          memcpy(column, w + (nb * 16 + c) * K + kb * 32, sizeof column);
          for (int r = 0; r < 16; ++r) pairs[r * 16 + c] = column[r];
        }
        continue;
      }
      for (int c = 0; c < 16; ++c) { /* an edge: zeros past N and K */
        int64_t n = nb * 16 + c;
        for (int r = 0; r < 32; ++r) {
          int64_t k = kb * 32 + r;
          tile[(r / 2) * 32 + c * 2 + (r % 2)] = (n < N && k < K) ? w[n * K + k] : 0;
        }
      }
    }
}

/* acc [rows, 16 * blocks] fp32 (row stride 64 floats) + bias -> y's columns n0 .. n0 + width (bf16). */
static void store_rows(const float* acc, int rows, const uint16_t* bias, int64_t n0, int64_t width, uint16_t* y,
                       int64_t y_stride) {
  for (int r = 0; r < rows; ++r) {
    uint16_t* yr = y + r * y_stride + n0;
    for (int64_t c = 0; c < width; c += 16) {
      int64_t left = width - c;
      __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
      __m512 v = _mm512_load_ps(acc + r * 64 + c);
      if (bias != NULL) {
        __m256i b = _mm256_maskz_loadu_epi16(mask, bias + n0 + c);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
      _mm256_mask_storeu_epi16(yr + c, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

/* y [M, N] (bf16, row stride y_stride) = x [M, K] (bf16, row stride x_stride) @ W^T + bias (bf16 [N] or
 * NULL), W packed by dockrl_linear_pack_bf16. Returns 0, or 2 where a K that is not a multiple of 32 needed a
 * zero-padded copy of x that could not be allocated. Threads (OpenMP) take blocks of rows x columns. */
int dockrl_linear_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed, const uint16_t* bias,
                       uint16_t* y, int64_t y_stride, int64_t M, int64_t N, int64_t K) {
  int64_t k_blocks = (K + 31) / 32, col_blocks = (N + 15) / 16;
  uint16_t* padded = NULL;
  if (K % 32 != 0) {  /* the tiles read 32 inputs a block: the last block's tail must read zeros */
    padded = calloc((size_t)(M * k_blocks * 32), sizeof(uint16_t));
    if (padded == NULL) return 2;
    for (int64_t m = 0; m < M; ++m) memcpy(padded + m * k_blocks * 32, x + m * x_stride, (size_t)K * 2);
    x = padded;
    x_stride = k_blocks * 32;
  }
  /* decode (M <= 16): one row block, four column blocks per task; otherwise 32 rows x two column blocks */
  int64_t block_rows = M <= 16 ? 16 : 32, group = M <= 16 ? 4 : 2;
  int64_t row_tasks = (M + block_rows - 1) / block_rows, col_tasks = (col_blocks + group - 1) / group;
#pragma omp parallel if (row_tasks * col_tasks > 1)
  {
    float acc[32 * 64] __attribute__((aligned(64)));
    int config0 = -1, config1 = -1;
#pragma omp for schedule(static) collapse(2)
    for (int64_t rt = 0; rt < row_tasks; ++rt)
      for (int64_t ct = 0; ct < col_tasks; ++ct) {
        int64_t m0 = rt * block_rows, nb0 = ct * group;
        int64_t rows = M - m0 < block_rows ? M - m0 : block_rows;
        int rows0 = rows < 16 ? (int)rows : 16, rows1 = rows > 16 ? (int)(rows - 16) : 0;
        int blocks = (int)(col_blocks - nb0 < group ? col_blocks - nb0 : group);
        if (rows0 != config0 || rows1 != config1) {
          configure(rows0, rows1);
          config0 = rows0, config1 = rows1;
        }
        const uint16_t* a = x + m0 * x_stride;
        const uint16_t* b = packed + nb0 * k_blocks * 512;
        const int64_t step = k_blocks * 512;  /* from one column block's tiles to the next's */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (rows1 == 0) {
          for (int64_t kb = 0; kb < k_blocks; ++kb) {
            _tile_loadd(4, a + kb * 32, x_stride * 2);
            _tile_loadd(5, b + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (blocks > 1) {
              _tile_loadd(6, b + step + kb * 512, 64);
              _tile_dpbf16ps(1, 4, 6);
            }
            if (blocks > 2) {
              _tile_loadd(7, b + 2 * step + kb * 512, 64);
              _tile_dpbf16ps(2, 4, 7);
            }
            if (blocks > 3) {
              _tile_loadd(5, b + 3 * step + kb * 512, 64);
              _tile_dpbf16ps(3, 4, 5);
            }
          }
          _tile_stored(0, acc, 256);
          _tile_stored(1, acc + 16, 256);
          _tile_stored(2, acc + 32, 256);
          _tile_stored(3, acc + 48, 256);
        } else {
          for (int64_t kb = 0; kb < k_blocks; ++kb) {
            _tile_loadd(4, a + kb * 32, x_stride * 2);
            _tile_loadd(6, b + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, a + 16 * x_stride + kb * 32, x_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (blocks > 1) {
              _tile_loadd(7, b + step + kb * 512, 64);
              _tile_dpbf16ps(1, 4, 7);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          _tile_stored(0, acc, 256);
          _tile_stored(1, acc + 16, 256);
          _tile_stored(2, acc + 16 * 64, 256);
          _tile_stored(3, acc + 16 * 64 + 16, 256);
        }
        int64_t n0 = nb0 * 16, width = N - n0 < blocks * 16 ? N - n0 : blocks * 16;
        store_rows(acc, (int)rows, bias, n0, width, y + m0 * y_stride, y_stride);
      }
    if (config0 >= 0) _tile_release();
  }
  free(padded);
  return 0;
}


/* ---- decode_layers ------------------------------------------------------------------------------------------
 * A decode step's dense decoder layers in one call, each as decoder.DecoderModel._decode_natively runs it with
 * the packed projections on tiles (the same kernels in the same order, so the same values): for each layer,
 *   h = add_rms_norm(x += pending, ln1); qkv = h @ Wqkv^T; out = rope_attention(qkv); pending = out @ Wo^T;
 *   h = add_rms_norm(x += pending, ln2); gu = h @ Wgu^T; act = swiglu(gu); pending = act @ Wdown^T
 * (the first layer adds nothing to x; the last layer's pending is left in `pending` for the final norm). What each layer owns is a DecodeLayer; what the step shares (the rows, their offsets and
 * mask, the buffers) a DecodeRows. Returns 0, or the first non-zero code of rope_attention (1, 2, 3) or of a
 * projection (2). */
typedef struct {
  const uint16_t *ln1, *ln2, *q_norm, *k_norm; /* q_norm, k_norm NULL: none */
  float eps1, eps2, qk_eps;
  const uint16_t *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias; /* tiles */
  uint16_t *cache_k, *cache_v;
  int64_t row, head, block, slot; /* the cache's strides (rope_attention's) */
} DecodeLayer;

typedef struct {
  uint16_t *x, *h, *qkv, *attn, *pending, *gate_up, *act; /* x [B, H] in place; the rest buffers */
  const uint16_t *cos, *sin;
  const int64_t *table, *cache_rows, *offsets, *lengths;
  const float* bias;
  int64_t table_stride, block_size, num_blocks, capacity, num_rows, num_keys, bias_stride;
  int64_t B, H, N, K, D, I; /* rows, hidden, query and key/value heads, head size, MLP width */
  float scale;
} DecodeRows;

void dockrl_add_rms_norm_bf16(uint16_t* x, int64_t x_stride, const uint16_t* add, int64_t add_stride,
                              const uint16_t* w, uint16_t* h, int64_t B, int64_t H, float eps);
void dockrl_swiglu_bf16(const uint16_t* gate, int64_t gate_stride, const uint16_t* up, int64_t up_stride,
                        uint16_t* out, int64_t B, int64_t I);
int dockrl_rope_attention_bf16(const uint16_t* q_rows, int64_t q_stride, const uint16_t* k_rows, int64_t k_stride,
                               const uint16_t* v_rows, int64_t v_stride, const uint16_t* q_norm,
                               const uint16_t* k_norm, float eps, const uint16_t* cos, const uint16_t* sin,
                               uint16_t* cache_k, uint16_t* cache_v, int64_t row, int64_t head, int64_t block,
                               int64_t slot, const int64_t* table, int64_t table_stride, int64_t block_size,
                               int64_t num_blocks, int64_t capacity, const int64_t* cache_rows, int64_t num_rows,
                               const int64_t* offsets, const int64_t* lengths, int64_t num_keys,
                               const float* bias, int64_t bias_stride, uint16_t* out, int64_t B, int64_t N,
                               int64_t K, int64_t D, float scale);

int dockrl_decode_layers_bf16(const DecodeLayer* layers, int64_t count, const DecodeRows* r) {
  int64_t B = r->B, H = r->H, D = r->D, I = r->I;
  int64_t q_width = r->N * D, kv_width = r->K * D, qkv_width = q_width + 2 * kv_width;
  int code;
  for (int64_t l = 0; l < count; ++l) {
    const DecodeLayer* L = layers + l;
    dockrl_add_rms_norm_bf16(r->x, H, l > 0 ? r->pending : NULL, H, L->ln1, r->h, B, H, L->eps1);
    if ((code = dockrl_linear_bf16(r->h, H, L->qkv, L->qkv_bias, r->qkv, qkv_width, B, qkv_width, H))) return code;
    code = dockrl_rope_attention_bf16(
        r->qkv, qkv_width, r->qkv + q_width, qkv_width, r->qkv + q_width + kv_width, qkv_width, L->q_norm,
        L->k_norm, L->qk_eps, r->cos, r->sin, L->cache_k, L->cache_v, L->row, L->head, L->block, L->slot, r->table,
        r->table_stride, r->block_size, r->num_blocks, r->capacity, r->cache_rows, r->num_rows, r->offsets,
        r->lengths, r->num_keys, r->bias, r->bias_stride, r->attn, B, r->N, r->K, D, r->scale);
    if (code) return code;
    if ((code = dockrl_linear_bf16(r->attn, q_width, L->o, L->o_bias, r->pending, H, B, H, q_width))) return code;
    dockrl_add_rms_norm_bf16(r->x, H, r->pending, H, L->ln2, r->h, B, H, L->eps2);
    if ((code = dockrl_linear_bf16(r->h, H, L->gate_up, L->gate_up_bias, r->gate_up, 2 * I, B, 2 * I, H))) return code;
    dockrl_swiglu_bf16(r->gate_up, 2 * I, r->gate_up + I, 2 * I, r->act, B, I);
    if ((code = dockrl_linear_bf16(r->act, I, L->down, L->down_bias, r->pending, H, B, H, I))) return code;
  }
  return 0;
}

#else

int dockrl_linear_ready(void) { return 0; }
void dockrl_linear_pack_bf16(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  (void)w, (void)N, (void)K, (void)out;
}
int dockrl_linear_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* packed, const uint16_t* bias,
                       uint16_t* y, int64_t y_stride, int64_t M, int64_t N, int64_t K) {
  (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)y_stride, (void)M, (void)N, (void)K;
  return 1;
}
int dockrl_decode_layers_bf16(const void* layers, int64_t count, const void* rows) {
  (void)layers, (void)count, (void)rows;
  return 1;
}

#endif
