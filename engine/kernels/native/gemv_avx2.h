/* The row dots on AVX2 with FMA and F16C (x86-64-v3, GEMV_AVX2; for int8 also AVX-512 without
   VNNI; gemv.h calls them): the same sums as the AVX-512 paths in 8-lane registers, a few
   activation rows at a time (their accumulators in registers): bfloat16 weights widened by a
   16-bit shift and float16 ones by F16C (vcvtph2ps), against float32 activations with FMAs (for
   bfloat16 the activations are bfloat16 values already, so the products are vdpbf16ps' exact
   ones; only the order of the float32 sums differs); int8 weights sign-extended to int16 and
   multiplied in pairs with the int16 activation blocks (vpmaddwd) into exact int32 sums per
   block. For int8 each pair of 8-lane accumulators holds the lanes of one 16-lane AVX-512
   accumulator, and the final sum adds them in the tree of gcc's _mm512_reduce_add_ps, so the
   int8 path gives the bits of the AVX512-VNNI one; the float path has its own order
   (tile_float_avx2: one accumulator per dot, so that many rows can run in tiles of weight rows)
   and its own bits. */

#ifndef ENGINE_NATIVE_GEMV_AVX2_H
#define ENGINE_NATIVE_GEMV_AVX2_H

#include "gemv_acts.h"

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
    /* one row: prefetch the rows after this one, ~GEMV_PF_BYTES ahead (gemv_acts.h) */
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
   is where this pays (below, gemv.h row_dots). */
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

#endif
