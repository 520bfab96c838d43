/* Dot products of one weight row with a few activation rows: the inner loop of the
   weight-streaming matmuls (int8_matmul.c, decode_layer.c). At a few rows a matmul's speed is the
   bandwidth at which the weights stream in, so each weight row is read once for every activation
   row, and the arithmetic per weight byte must stay below what the memory delivers.

   Weight codes: the 16-bit and float32 codes of dtypes.h, and W_I8 for int8 (scaled by the
   caller). The activations are prepared once per matmul (acts_prepare) in the form that suits
   the weights:

   - int8 weights: each activation row in blocks of GEMV_BLOCK values, as int16 times a power of
     two per block (2^(e - 15) for a block whose largest magnitude is below 2^e). Every value
     within 2^7 of its block's largest is exact (a 16-bit float has at most 11 significant bits,
     bfloat16 8), smaller ones are off by at most 2^-16 of the block's largest. Products and
     their sums within a block are exact int32 (AVX512-VNNI vpdpwssd: 32 multiply-adds per
     instruction against 16 for float32 FMAs after widening, which capped int8 at ~17 GB/s
     against the ~24 GB/s this machine reads); blocks are summed in float32.
   - bfloat16 weights: the activations as bfloat16 (exact: the layers round them to the model's
     dtype already), multiplied in pairs into float32 sums (AVX512-BF16 vdpbf16ps).
   - float16 and float32 weights: float32 activations and FMAs after widening.

   On AVX2 with FMA and F16C (x86-64-v3, GEMV_AVX2; for int8 also AVX-512 without VNNI) the same
   sums in 8-lane registers, a few activation rows at a time (their accumulators in registers):
   bfloat16 weights widened by a 16-bit shift and float16 ones by F16C (vcvtph2ps), against
   float32 activations with FMAs (for bfloat16 the activations are bfloat16 values already, so the
   products are vdpbf16ps' exact ones; only the order of the float32 sums differs); int8 weights
   sign-extended to int16 and multiplied in pairs with the int16 activation blocks (vpmaddwd) into
   exact int32 sums per block. For int8 each pair of 8-lane accumulators holds the lanes of one
   16-lane AVX-512 accumulator, and the final sum adds them in the tree of gcc's
   _mm512_reduce_add_ps, so the int8 path gives the bits of the AVX512-VNNI one; the float path
   has its own order (tile_float_avx2: one accumulator per dot, so that many rows can run in
   tiles of weight rows) and its own bits. Elsewhere plain loops (GEMV_PATHS names what was compiled in,
   engine_gemv_paths reports it).

   The sums of a given weight code and K are formed in the same order whatever the row count, so a
   row's result does not depend on the rows beside it. */

#ifndef ENGINE_NATIVE_GEMV_H
#define ENGINE_NATIVE_GEMV_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dtypes.h"

#define GEMV_MAX_ROWS 8
#define GEMV_BLOCK 256 /* activation values per int16 scale; 16 products per int32 lane */
#define W_I8 3         /* int8 weight rows (per-row scales applied by the caller) */
/* One activation row on AVX2 (int8 weights without VNNI, 16-bit and float32 weights without
   AVX-512): the weights GEMV_PF_BYTES ahead are prefetched as the dot goes (into the rows after
   it, which the same thread takes next; every caller's weight rows are contiguous). There the
   kernel's own work per byte (sign extension and vpmaddwd for int8, widening and FMAs for bf16)
   is near what the memory delivers and the hardware prefetcher alone lags. The default model's
   120 projections streamed from memory at one row, 2 threads, a Zen 3 EPYC, passes of each in
   turn, median (profiling/bench_int8.py --prefetch): int8 8.4-9.4 -> 6.3-7.1 ms (11-13 -> 15-17
   GB/s; a plain read of the same bytes: ~19), bf16 16.0 -> 14.0 ms. In variants of that harness
   2 KB to 8 KB ahead all helped int8, bf16 was best at 4 KB, float32 gained ~5-10%. Who takes
   these row dots at one row: the int8 projections and LM head, the float LM head
   (float_matmul.c); float projections of a decode layer take tiles there (GEMV_TILES_FOR).
   Several rows: decode_layer.c prefetches whole rows ahead (PF_ROWS). The same prefetch in the
   AVX-512 row dots (VNNI int8, AVX512-BF16, AVX-512 float) measured no gain on a Zen 4 EPYC
   (bench_int8.py --prefetch --reps 40, twice: int8 5.2 ms on against 4.5-5.3 off, bf16 6.7-7.2
   against 5.5-6.9), so it reaches only the AVX2 paths. */
#ifndef GEMV_PF_BYTES
#define GEMV_PF_BYTES 4096
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GEMV_VNNI 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GEMV_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GEMV_AVX2 1
#endif

/* The row dots compiled in, by weight code: "int8:<path> bf16:<path> float:<path>". */
#if defined(GEMV_VNNI)
#define GEMV_PATH_I8 "avx512vnni"
#elif defined(GEMV_AVX2)
#define GEMV_PATH_I8 "avx2"
#else
#define GEMV_PATH_I8 "c"
#endif
#if defined(__AVX512F__)
#define GEMV_PATH_FLOAT "avx512"
#elif defined(GEMV_AVX2)
#define GEMV_PATH_FLOAT "avx2"
#else
#define GEMV_PATH_FLOAT "c"
#endif
#if defined(GEMV_BF16)
#define GEMV_PATH_BF16 "avx512bf16"
#else
#define GEMV_PATH_BF16 GEMV_PATH_FLOAT
#endif
#define GEMV_PATHS "int8:" GEMV_PATH_I8 " bf16:" GEMV_PATH_BF16 " float:" GEMV_PATH_FLOAT

typedef struct {
    int rows;
    int64_t K, nb;  /* values per row, int16 blocks per row */
    const float *f; /* [rows, K] float32 (the caller's) */
    int16_t *q;     /* [rows, K] int8 weights: value / its block's scale */
    float *qs;      /* [rows, nb] the blocks' scales (powers of two; NaN for a non-finite block) */
    uint16_t *b;    /* [rows, K] bfloat16 weights: the values as bfloat16 */
} Acts;

static inline void acts_free(Acts *a) {
    free(a->q), free(a->qs), free(a->b);
    a->q = NULL, a->qs = NULL, a->b = NULL;
}

/* Prepares xf [rows, K] for row dots against weights of code wt. Returns 0, or -2 without
   memory. */
static inline int acts_prepare(Acts *a, int wt, const float *xf, int rows, int64_t K) {
    a->rows = rows, a->K = K, a->nb = (K + GEMV_BLOCK - 1) / GEMV_BLOCK, a->f = xf;
    a->q = NULL, a->qs = NULL, a->b = NULL;
    const size_t n = (size_t)rows * (size_t)(K > 0 ? K : 1);
    if (wt == W_I8) {
        a->q = malloc(sizeof(int16_t) * n);
        a->qs = malloc(sizeof(float) * (size_t)rows * (size_t)(a->nb > 0 ? a->nb : 1));
        if (!a->q || !a->qs) {
            acts_free(a);
            return -2;
        }
        for (int m = 0; m < rows; m++)
            for (int64_t blk = 0; blk < a->nb; blk++) {
                const int64_t k0 = blk * GEMV_BLOCK;
                const int64_t k1 = k0 + GEMV_BLOCK < K ? k0 + GEMV_BLOCK : K;
                const float *x = xf + (int64_t)m * K;
                int16_t *q = a->q + (int64_t)m * K;
                float mx = 0.f;
                int bad = 0;
                int64_t k = k0;
#if defined(__AVX512F__)
                __m512 vmx = _mm512_setzero_ps();
                __mmask16 vbad = 0;
                for (; k + 16 <= k1; k += 16) {
                    const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + k));
                    vbad |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(3.4e38f), _CMP_NLE_UQ);
                    vmx = _mm512_max_ps(vmx, v);
                }
                mx = _mm512_reduce_max_ps(vmx);
                bad = vbad != 0;
#endif
                for (; k < k1; k++) {
                    const float v = fabsf(x[k]);
                    bad |= !(v <= 3.4e38f); /* inf or NaN */
                    mx = v > mx ? v : mx;
                }
                if (bad) {
                    a->qs[(int64_t)m * a->nb + blk] = NAN;
                    for (int64_t k = k0; k < k1; k++) q[k] = 0;
                    continue;
                }
                int e = 0;
                if (mx > 0.f) frexpf(mx, &e); /* mx < 2^e */
                const float inv = ldexpf(1.f, 15 - e);
                a->qs[(int64_t)m * a->nb + blk] = ldexpf(1.f, e - 15);
                k = k0;
#if defined(__AVX512F__)
                /* rounded to nearest even as nearbyintf does; the pack saturates as the clamp */
                for (; k + 16 <= k1; k += 16) {
                    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k),
                                                                       _mm512_set1_ps(inv)));
                    _mm256_storeu_si256((__m256i *)(q + k), _mm512_cvtsepi32_epi16(r));
                }
#endif
                for (; k < k1; k++) {
                    float v = nearbyintf(x[k] * inv);
                    v = v > 32767.f ? 32767.f : (v < -32767.f ? -32767.f : v);
                    q[k] = (int16_t)v;
                }
            }
    } else if (wt == DT_BF16) {
#if defined(GEMV_BF16) /* elsewhere dots_bf16 reads the float32 rows (bfloat16 values already) */
        a->b = malloc(sizeof(uint16_t) * n);
        if (!a->b) return -2;
        for (size_t i = 0; i < (size_t)rows * (size_t)K; i++) a->b[i] = f32_to_bf16(xf[i]);
#endif
    }
    return 0;
}

#if defined(__AVX512F__)
/* 16 weights from element k of w (16-bit or float32 codes), as float32. */
static inline __attribute__((always_inline)) __m512 widen16_w(int wt, const void *w, int64_t k) {
    if (wt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k))),
            16));
    if (wt == DT_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k)));
    return _mm512_loadu_ps((const float *)w + k);
}
#endif
#if defined(GEMV_AVX2)
/* 8 weights from element k of w (16-bit or float32 codes), as float32. */
static inline __attribute__((always_inline)) __m256 widen8_w(int wt, const void *w, int64_t k) {
    if (wt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k))),
            16));
    if (wt == DT_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
    return _mm256_loadu_ps((const float *)w + k);
}
#endif

#if defined(GEMV_AVX2)
/* The sum of the 16 lanes (lo: 0-7, hi: 8-15) of one AVX-512 register, added in the order of
   gcc's _mm512_reduce_add_ps: halves, quarters, then lanes {0, 2} and {1, 3}. */
static inline __attribute__((always_inline)) float gemv_hsum16(__m256 lo, __m256 hi) {
    const __m256 h = _mm256_add_ps(hi, lo);
    const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, 1));
}

static inline __attribute__((always_inline)) float gemv_hsum8(__m256 v) {
    const __m128 q = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, 1));
}

/* Float weights on AVX2 (without AVX-512): one order for every dot, whoever computes it, so a
   row's result never depends on the rows beside it: one 8-lane accumulator over k (8 values at a
   time), its lanes summed (gemv_hsum8), then the K % 8 tail in order. Two ways to form them:

   - a few activation rows (up to GEMV_TILE_MIN_ROWS - 1, in sets of up to 8, one accumulator
     each) against one weight row at a time: the weights stream in order, as fast as the 4-way
     accumulators this replaced (1 to 4 rows over a 141 MB float32 matrix, one thread: 6.9 / 7.0
     / 8.9 ms against 7.1 / 6.9 / 8.7);
   - more rows in tiles of GEMV_TILE_ROWS activation rows x GEMV_TILE_COLS weight rows (12
     accumulators, 3 weight vectors and one activation vector in the 16 registers; 3 weight and 4
     activation loads feed 12 FMAs), each tile prefetching the weight rows GEMV_TILE_PF ahead as
     it goes. One weight row at a time, every activation row was loaded again for each weight
     row, from L2 once 16 rows of K = 576 or 1536 outgrow L1: 16 rows took 31.7-34.0 ms on that
     matrix (~35 GFLOP/s), tiles 17.6 (64 GFLOP/s); 12 rows 24.2 against 14.7. (8 rows: 13.3
     against 13.0 ms; the 4-way accumulators took 9.4-12.9 there, a cost of the single order.)

   The bits differ from the AVX-512 F path's (two 16-lane accumulators). */
#define GEMV_TILE_ROWS 4
#define GEMV_TILE_COLS 3
#define GEMV_TILE_PF 6
#define GEMV_TILE_MIN_ROWS 5
/* Whether a decode layer's projections (decode_layer.c) at `rows` activation rows take the tiles
   (float_tiles) rather than the row dots: from GEMV_TILE_MIN_ROWS rows, and at one row, where a
   tile of 3 weight rows loads each activation vector once for 3 FMAs (the same bits: one order
   per dot). Default model, float32 activations with bf16 weights, Zen 3 EPYC, 2 threads: the
   30 layers of a 1-row decode step 22.3-23.8 -> 19.3-22.1 ms; `bench_step.py --cases 1x128`
   best of 30, builds alternated twice: 24.6, 25.0 -> 19.9, 20.1 ms. The float LM head
   (float_matmul.c, 49152 rows) measured slower with tiles at one row (3.8-4.2 -> 4.4-5.0 ms),
   so it keeps the row dots there. */
#define GEMV_TILES_FOR(rows) ((rows) >= GEMV_TILE_MIN_ROWS || (rows) == 1)

/* out[c * ldo + r] = x[r] . w_c for r < R, c < C (constants once inlined; R * C <= 12, R <= 8),
   x [R, K] float32 rows, w_c = w + c * wstride bytes (float code wt); pf: prefetch the weight
   rows pf rows ahead (0: none). */
static inline __attribute__((always_inline)) void tile_float_avx2(int wt, const float *x,
                                                                  int64_t K, int R, int C,
                                                                  const char *w, int64_t wstride,
                                                                  float *out, int ldo, int pf) {
    __m256 acc[8][GEMV_TILE_COLS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t esize = wt == DT_F32 ? 4 : 2;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (pf && (k & 15) == 0) /* a cache line of each weight row pf rows ahead */
            for (int c = 0; c < C; c++) __builtin_prefetch(w + (c + pf) * wstride + k * esize, 0, 0);
        __m256 wv[GEMV_TILE_COLS];
        for (int c = 0; c < C; c++) wv[c] = widen8_w(wt, w + c * wstride, k);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * K + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = gemv_hsum8(acc[r][c]);
            for (int64_t t = k; t < K; t++) s += x[r * K + t] * load_f32(wt, w + c * wstride, t);
            out[c * ldo + r] = s;
        }
}

/* dots_float's AVX2 part: rows (1 to GEMV_MAX_ROWS, a constant once inlined) against one weight
   row, tails included. */
static inline __attribute__((always_inline)) void dots_float_avx2(int wt, const float *xf,
                                                                  int64_t K, int rows,
                                                                  const void *w, float *out) {
    /* one row: prefetch the rows after this one, ~GEMV_PF_BYTES ahead (above) */
    const int64_t row = K * (wt == DT_F32 ? 4 : 2);
    const int pf =
        rows == 1 && GEMV_PF_BYTES > 0 && row > 0 ? (int)((GEMV_PF_BYTES + row - 1) / row) : 0;
    tile_float_avx2(wt, xf, K, rows, 1, (const char *)w, row, out, 1, pf);
}

#define GEMV_TILE_BY_ROWS(WT, C)                                                                  \
    switch (R) {                                                                                  \
    case 1: tile_float_avx2(WT, xm, K, 1, C, w, wstride, out, ldo, GEMV_TILE_PF); break;          \
    case 2: tile_float_avx2(WT, xm, K, 2, C, w, wstride, out, ldo, GEMV_TILE_PF); break;          \
    case 3: tile_float_avx2(WT, xm, K, 3, C, w, wstride, out, ldo, GEMV_TILE_PF); break;          \
    default: tile_float_avx2(WT, xm, K, 4, C, w, wstride, out, ldo, GEMV_TILE_PF); break;         \
    }
#define GEMV_TILE_BY_COLS(WT)                                                                     \
    switch (C) {                                                                                  \
    case 1: GEMV_TILE_BY_ROWS(WT, 1); break;                                                      \
    case 2: GEMV_TILE_BY_ROWS(WT, 2); break;                                                      \
    default: GEMV_TILE_BY_ROWS(WT, 3); break;                                                     \
    }

/* out[c * ldo + m] = x[m] . w_c for every m < rows and c < C (1 to GEMV_TILE_COLS weight rows,
   w_c = w + c * wstride bytes, float code wt), x [rows, K] float32; rows >= GEMV_TILE_MIN_ROWS
   is where this pays (below, row_dots). */
#if !defined(__AVX512F__) /* with AVX-512 its own float path serves (dots_float) */
#define GEMV_FLOAT_TILES 1
#endif
static inline void float_tiles(int wt, const float *x0, int rows, int64_t K, const void *wp,
                               int64_t wstride, int C, float *out0, int ldo) {
    const char *w = (const char *)wp;
    for (int m0 = 0; m0 < rows; m0 += GEMV_TILE_ROWS) {
        const int R = rows - m0 < GEMV_TILE_ROWS ? rows - m0 : GEMV_TILE_ROWS;
        const float *xm = x0 + (int64_t)m0 * K;
        float *out = out0 + m0;
        switch (wt) {
        case DT_BF16: GEMV_TILE_BY_COLS(DT_BF16); break;
        case DT_F16: GEMV_TILE_BY_COLS(DT_F16); break;
        default: GEMV_TILE_BY_COLS(DT_F32); break;
        }
    }
}
#endif

#if defined(GEMV_AVX2)
/* dots_i8's exact int32 sums over one block (k0 up to a multiple of 32 below k1) for rows m0 to
   m0 + R - 1 (R <= 4: 2R accumulators and two weight vectors in registers), added to accf
   scaled. acc[h]: the pair sums of elements 16h to 16h + 15 of every 32, the int32 lanes 8h to
   8h + 7 of the AVX512-VNNI path's (exact, so the same values whatever the order). */
static inline __attribute__((always_inline)) void block_i8_avx2(const Acts *a, int m0, int R,
                                                                const int8_t *w, int64_t blk,
                                                                int64_t k0, int64_t k1,
                                                                __m256 accf[2][GEMV_MAX_ROWS],
                                                                int64_t pf) {
    const int64_t K = a->K;
    __m256i acc[2][4];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_si256();
    for (int64_t k = k0; k + 32 <= k1; k += 32) {
        if (pf) __builtin_prefetch(w + k + pf, 0, 0);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k + 16)));
        for (int r = 0; r < R; r++) {
            const int16_t *x = a->q + (m0 + r) * K + k;
            acc[0][r] = _mm256_add_epi32(
                acc[0][r], _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)));
            acc[1][r] = _mm256_add_epi32(
                acc[1][r],
                _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
        }
    }
    for (int r = 0; r < R; r++) {
        const int m = m0 + r;
        const __m256 s = _mm256_set1_ps(a->qs[m * a->nb + blk]);
        accf[0][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[0][r]), s, accf[0][m]);
        accf[1][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[1][r]), s, accf[1][m]);
    }
}
#endif

/* Float weights (W_I8 excluded) against float32 activations: FMAs after widening. */
static inline __attribute__((always_inline)) void dots_float(int wt, const Acts *a, int rows,
                                                             const void *w, float *out) {
    const int64_t K = a->K;
    const float *xf = a->f;
    int64_t k = 0;
    for (int m = 0; m < rows; m++) out[m] = 0.f;
#if defined(__AVX512F__)
    __m512 acc[2][GEMV_MAX_ROWS];
    for (int m = 0; m < rows; m++) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        const __m512 w0 = widen16_w(wt, w, k), w1 = widen16_w(wt, w, k + 16);
        for (int m = 0; m < rows; m++) {
            acc[0][m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + m * K + k), acc[0][m]);
            acc[1][m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + m * K + k + 16), acc[1][m]);
        }
    }
    for (int m = 0; m < rows; m++) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]));
#elif defined(GEMV_AVX2)
    dots_float_avx2(wt, xf, K, rows, w, out); /* tails included */
    k = K;
#endif
    for (; k < K; k++) {
        const float wk = load_f32(wt, w, k);
        for (int m = 0; m < rows; m++) out[m] += xf[m * K + k] * wk;
    }
}

/* bfloat16 weights against bfloat16 activations: pairs multiplied exactly, summed in float32. */
static inline __attribute__((always_inline)) void dots_bf16(const Acts *a, int rows,
                                                            const uint16_t *w, float *out) {
#if defined(GEMV_BF16)
    const int64_t K = a->K;
    int64_t k = 0;
    __m512 acc[2][GEMV_MAX_ROWS];
    for (int m = 0; m < rows; m++) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    for (; k + 64 <= K; k += 64) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
        for (int m = 0; m < rows; m++) {
            const uint16_t *x = a->b + m * K + k;
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)_mm512_loadu_si512(x), w0);
            acc[1][m] = _mm512_dpbf16_ps(acc[1][m], (__m512bh)_mm512_loadu_si512(x + 32), w1);
        }
    }
    for (; k + 32 <= K; k += 32) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
        for (int m = 0; m < rows; m++)
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)_mm512_loadu_si512(a->b + m * K + k),
                                         w0);
    }
    for (int m = 0; m < rows; m++) {
        float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]));
        for (int64_t j = k; j < K; j++) s += bf16_to_f32(a->b[m * K + j]) * bf16_to_f32(w[j]);
        out[m] = s;
    }
#else
    dots_float(DT_BF16, a, rows, w, out);
#endif
}

/* int8 weights against int16 activation blocks: exact int32 sums per block, float32 across. */
static inline __attribute__((always_inline)) void dots_i8(const Acts *a, int rows,
                                                          const int8_t *w, float *out) {
    const int64_t K = a->K, nb = a->nb;
    float tail[GEMV_MAX_ROWS];
    for (int m = 0; m < rows; m++) tail[m] = 0.f;
#if defined(GEMV_VNNI)
    __m512 accf[GEMV_MAX_ROWS];
    for (int m = 0; m < rows; m++) accf[m] = _mm512_setzero_ps();
#elif defined(GEMV_AVX2)
    __m256 accf[2][GEMV_MAX_ROWS]; /* lanes 0-7 and 8-15 of the AVX512-VNNI path's accf */
    for (int m = 0; m < rows; m++) accf[0][m] = accf[1][m] = _mm256_setzero_ps();
#endif
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t k0 = blk * GEMV_BLOCK, k1 = k0 + GEMV_BLOCK < K ? k0 + GEMV_BLOCK : K;
        int64_t k = k0;
#if defined(GEMV_VNNI)
        __m512i acc[2][GEMV_MAX_ROWS];
        for (int m = 0; m < rows; m++) acc[0][m] = acc[1][m] = _mm512_setzero_si512();
        for (; k + 64 <= k1; k += 64) {
            const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k)));
            const __m512i w1 =
                _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k + 32)));
            for (int m = 0; m < rows; m++) {
                const int16_t *x = a->q + m * K + k;
                acc[0][m] = _mm512_dpwssd_epi32(acc[0][m], w0, _mm512_loadu_si512(x));
                acc[1][m] = _mm512_dpwssd_epi32(acc[1][m], w1, _mm512_loadu_si512(x + 32));
            }
        }
        for (; k + 32 <= k1; k += 32) {
            const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + k)));
            for (int m = 0; m < rows; m++)
                acc[0][m] = _mm512_dpwssd_epi32(acc[0][m], w0, _mm512_loadu_si512(a->q + m * K + k));
        }
        for (int m = 0; m < rows; m++) {
            const __m512 s = _mm512_set1_ps(a->qs[m * nb + blk]);
            const __m512i sum = _mm512_add_epi32(acc[0][m], acc[1][m]);
            accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, accf[m]);
        }
#elif defined(GEMV_AVX2)
        int m0 = 0; /* rows in sets of 4 (a constant row count unrolls this) */
        for (; m0 + 4 <= rows; m0 += 4) block_i8_avx2(a, m0, 4, w, blk, k0, k1, accf, 0);
        if (rows - m0 >= 2) block_i8_avx2(a, m0, 2, w, blk, k0, k1, accf, 0), m0 += 2;
        if (rows - m0 == 1)
            block_i8_avx2(a, m0, 1, w, blk, k0, k1, accf, rows == 1 ? GEMV_PF_BYTES : 0);
        k = k0 + (k1 - k0) / 32 * 32;
#endif
        for (int m = 0; m < rows; m++) {
            int32_t s = 0;
            for (int64_t j = k; j < k1; j++) s += (int32_t)a->q[m * K + j] * (int32_t)w[j];
            tail[m] += (float)s * a->qs[m * nb + blk];
        }
    }
    for (int m = 0; m < rows; m++) {
#if defined(GEMV_VNNI)
        out[m] = _mm512_reduce_add_ps(accf[m]) + tail[m];
#elif defined(GEMV_AVX2)
        out[m] = gemv_hsum16(accf[0][m], accf[1][m]) + tail[m];
#else
        out[m] = tail[m];
#endif
    }
}

static inline __attribute__((always_inline)) void row_dots_wt(int wt, const Acts *a, int rows,
                                                              const void *w, float *out) {
    if (wt == W_I8)
        dots_i8(a, rows, (const int8_t *)w, out);
    else if (wt == DT_BF16)
        dots_bf16(a, rows, (const uint16_t *)w, out);
    else
        dots_float(wt, a, rows, w, out);
}

/* The loops for one weight code, with the row count a constant: the accumulators then stay in
   registers (indexed by a run-time count they live in memory). */
#define ROW_DOTS_BY_ROWS(WT)                                                                      \
    switch (a->rows) {                                                                            \
    case 1: row_dots_wt(WT, a, 1, w, out); break;                                                 \
    case 2: row_dots_wt(WT, a, 2, w, out); break;                                                 \
    case 3: row_dots_wt(WT, a, 3, w, out); break;                                                 \
    case 4: row_dots_wt(WT, a, 4, w, out); break;                                                 \
    case 5: row_dots_wt(WT, a, 5, w, out); break;                                                 \
    case 6: row_dots_wt(WT, a, 6, w, out); break;                                                 \
    case 7: row_dots_wt(WT, a, 7, w, out); break;                                                 \
    default: row_dots_wt(WT, a, 8, w, out); break;                                                \
    }

/* out[m] = x[m] . w for the a->rows (1 to GEMV_MAX_ROWS) activation rows a was prepared with
   (for weight code wt), over a->K values; w one weight row. */
static inline void row_dots(int wt, const Acts *a, const void *w, float *out) {
    switch (wt) {
    case W_I8: ROW_DOTS_BY_ROWS(W_I8); break;
    case DT_BF16: ROW_DOTS_BY_ROWS(DT_BF16); break;
    case DT_F16: ROW_DOTS_BY_ROWS(DT_F16); break;
    default: ROW_DOTS_BY_ROWS(DT_F32); break;
    }
}

/* More rows than a set of registers holds: groups of GEMV_MAX_ROWS, each weight row taken by
   every group in turn while it is in the core's cache (the weights still stream once). */
#define GEMV_MAX_GROUPS 8
#define GEMV_ROWS_LIMIT (GEMV_MAX_ROWS * GEMV_MAX_GROUPS)

typedef struct {
    int groups;
    Acts g[GEMV_MAX_GROUPS];
} RowGroups;

static inline void groups_free(RowGroups *r) {
    for (int i = 0; i < r->groups; i++) acts_free(&r->g[i]);
    r->groups = 0;
}

/* xf [rows, K] (1 <= rows <= GEMV_ROWS_LIMIT) prepared for weights of code wt. Returns 0, or -2
   without memory. */
static inline int groups_prepare(RowGroups *r, int wt, const float *xf, int rows, int64_t K) {
    r->groups = 0;
    for (int m0 = 0; m0 < rows; m0 += GEMV_MAX_ROWS) {
        const int n = rows - m0 < GEMV_MAX_ROWS ? rows - m0 : GEMV_MAX_ROWS;
        if (acts_prepare(&r->g[r->groups], wt, xf + (int64_t)m0 * K, n, K)) {
            groups_free(r);
            return -2;
        }
        r->groups++;
    }
    return 0;
}

/* out[m] = x[m] . w for every row of every group. */
static inline void row_dots_groups(int wt, const RowGroups *r, const void *w, float *out) {
    for (int i = 0; i < r->groups; i++) row_dots(wt, &r->g[i], w, out + i * GEMV_MAX_ROWS);
}

#endif
