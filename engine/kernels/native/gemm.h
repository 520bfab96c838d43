/* y = x W^T for any number of rows, with one order for every output element: the fixed-order
   GEMM that makes a row's result independent of the rows beside it (issue 41).

   W is packed once, at load, in panels of GEMM_NR weight rows (engine/kernels/gemm.py
   pack_panels): wp[p][k][j] = W[p * GEMM_NR + j][k], zero past N, in the weight's dtype (float32,
   bfloat16 or float16). Every output is one float32 chain from zero,

       acc = fma(x[m][k], w[n][k], acc)   for k = 0, 1, ..., K - 1,

   whichever tile, row count, thread or path computes it: the AVX2 micro-kernel holds one output
   per lane (GEMM_MR rows x GEMM_NR columns in 12 registers, x broadcast, W's panel row widened
   exactly in registers), the AVX-512 one the same per lane of 16 (12 rows x two panels in 24
   registers: a k step feeds 24 FMAs from 2 weight loads and 12 broadcasts), the plain-C path
   calls fmaf in the same order, so the three agree bit for bit: an FMA is one rounding whatever
   the register width. There are no horizontal sums and no split of K. Prefill chunks and decode
   steps therefore give the same bits for the same row, whatever the batch, the chunk budget,
   the thread count or the CPU class.

   The products of 16-bit weights with float32 (or 16-bit) activations are exact in float32; only
   the sums round, once per k. */

#ifndef ENGINE_NATIVE_GEMM_H
#define ENGINE_NATIVE_GEMM_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "gemv_avx2.h" /* GEMV_AVX2 (AVX2, FMA, F16C) and widen8_w: weights widened exactly */
#include "steal.h"

#if defined(GEMV_AVX2) && defined(__AVX512F__)
#define GEMM_AVX512 1
#if defined(__AVX512BF16__)
#define GEMM_PATH "avx512bf16" /* the FMA tiles, and bf16 steps' own chain (gemm_packed_bf16) */
#else
#define GEMM_PATH "avx512"
#endif
#elif defined(GEMV_AVX2)
#define GEMM_AVX2 1
#define GEMM_PATH "avx2"
#else
#define GEMM_PATH "c"
#endif

#if defined(GEMM_AVX512) && defined(__AVX512BF16__)
/* bf16 weights times bf16-valued activations: pairs of k per vdpbf16ps (gemm_tile_bf16) */
#define GEMM_BF16DOT 1
#endif

#define GEMM_NR 16 /* weight rows per panel: two 8-lane registers, or one 16-lane one */
#if defined(GEMM_AVX512)
#define GEMM_MR 12 /* rows per tile: 12 x 2 accumulators + 2 weights + 1 broadcast of 32 */
#else
#define GEMM_MR 6 /* activation rows per tile: 12 accumulators + 2 weights + 1 broadcast */
#endif
#define GEMM_MC 96 /* activation rows per work item (16 tiles): K x 96 floats stay in L2 */
/* Rows up to which a work item is a few panels for all rows (the weights stream once, as in
   a decode step), rather than a block of rows against a few panels. */
#define GEMM_FEW_ROWS GEMM_MR
#define GEMM_PANELS_PER_ITEM 2
#define GEMM_PF_BYTES 2048 /* streaming a panel at a few rows: prefetch this far ahead */

static inline int64_t gemm_esize(int wt) { return wt == DT_F32 ? 4 : 2; }

#if defined(GEMM_AVX512)
/* The cases of a last tile of 1 to 11 rows (AVX-512 tiles), each a call with R constant. */
#define GEMM_REST_CASES_11                                                                     \
    case 1: GEMM_REST(1); break;                                                               \
    case 2: GEMM_REST(2); break;                                                               \
    case 3: GEMM_REST(3); break;                                                               \
    case 4: GEMM_REST(4); break;                                                               \
    case 5: GEMM_REST(5); break;                                                               \
    case 6: GEMM_REST(6); break;                                                               \
    case 7: GEMM_REST(7); break;                                                               \
    case 8: GEMM_REST(8); break;                                                               \
    case 9: GEMM_REST(9); break;                                                               \
    case 10: GEMM_REST(10); break;                                                             \
    case 11: GEMM_REST(11); break;

/* The AVX-512 tile: R rows (<= GEMM_MR) against NP (1 or 2) panels, the second pstride bytes
   after the first; y's columns [0, cols), cols <= NP * GEMM_NR. One 16-lane accumulator per row
   and panel: lane j of acc[r][c] is the chain of output (r, c * GEMM_NR + j). R and NP constants
   once inlined. */
static inline __attribute__((always_inline)) void gemm_tile512(int wt, const float *x,
                                                               int64_t ldx, int R, int NP,
                                                               const char *panel, int64_t pstride,
                                                               int64_t K, float *y, int64_t ldy,
                                                               int cols, int pf) {
    __m512 acc[GEMM_MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t row = GEMM_NR * gemm_esize(wt);
    for (int64_t k = 0; k < K; k++) {
        __m512 b[2];
        for (int c = 0; c < NP; c++) {
            if (pf && (k & 1) == 0)
                __builtin_prefetch(panel + c * pstride + k * row + GEMM_PF_BYTES, 0, 0);
            b[c] = widen16_w(wt, panel + c * pstride, k * GEMM_NR);
        }
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
            for (int c = 0; c < NP; c++) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
        }
    }
    for (int c = 0; c < NP; c++) {
        const int left = cols - c * GEMM_NR;
        const __mmask16 m = left >= GEMM_NR ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy + c * GEMM_NR, m, acc[r][c]);
    }
}

/* Rows [0, M) in tiles of GEMM_MR (the last smaller) against NP panels. */
static inline __attribute__((always_inline)) void gemm_rows512(int wt, const float *x,
                                                               int64_t ldx, int64_t M, int NP,
                                                               const char *panel, int64_t pstride,
                                                               int64_t K, float *y, int64_t ldy,
                                                               int cols, int pf) {
    int64_t m = 0;
    for (; m + GEMM_MR <= M; m += GEMM_MR)
        gemm_tile512(wt, x + m * ldx, ldx, GEMM_MR, NP, panel, pstride, K, y + m * ldy, ldy,
                     cols, pf);
#define GEMM_REST(R) \
    gemm_tile512(wt, x + m * ldx, ldx, R, NP, panel, pstride, K, y + m * ldy, ldy, cols, pf)
    switch (M - m) { GEMM_REST_CASES_11 default: break; }
#undef GEMM_REST
}
#endif

/* y[r * ldy + j] for r < R, j < cols (<= GEMM_NR): rows x[r * ldx ...] against one panel. R a
   constant once inlined (the accumulators then live in registers). */
static inline __attribute__((always_inline)) void gemm_tile(int wt, const float *x, int64_t ldx,
                                                            int R, const void *panel, int64_t K,
                                                            float *y, int64_t ldy, int cols,
                                                            int pf) {
#if defined(GEMM_AVX2)
    __m256 acc[GEMM_MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const char *pb = (const char *)panel;
    const int64_t row = GEMM_NR * gemm_esize(wt);
    for (int64_t k = 0; k < K; k++) {
        if (pf && (k & 1) == 0) __builtin_prefetch(pb + k * row + GEMM_PF_BYTES, 0, 0);
        const __m256 b0 = widen8_w(wt, panel, k * GEMM_NR);
        const __m256 b1 = widen8_w(wt, panel, k * GEMM_NR + 8);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (cols == GEMM_NR) {
            _mm256_storeu_ps(y + r * ldy, acc[r][0]);
            _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
        } else {
            float t[GEMM_NR];
            _mm256_storeu_ps(t, acc[r][0]);
            _mm256_storeu_ps(t + 8, acc[r][1]);
            memcpy(y + r * ldy, t, sizeof(float) * (size_t)cols);
        }
    }
#else
    (void)pf;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < cols; j++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++)
                acc = fmaf(x[r * ldx + k], load_f32(wt, panel, k * GEMM_NR + j), acc);
            y[r * ldy + j] = acc;
        }
#endif
}

/* Rows [0, M) in tiles of GEMM_MR (the last tile smaller) against one panel. */
static inline __attribute__((always_inline)) void gemm_rows(int wt, const float *x, int64_t ldx,
                                                            int64_t M, const void *panel,
                                                            int64_t K, float *y, int64_t ldy,
                                                            int cols, int pf) {
    int64_t m = 0;
    for (; m + GEMM_MR <= M; m += GEMM_MR)
        gemm_tile(wt, x + m * ldx, ldx, GEMM_MR, panel, K, y + m * ldy, ldy, cols, pf);
#define GEMM_REST(R) \
    gemm_tile(wt, x + m * ldx, ldx, R, panel, K, y + m * ldy, ldy, cols, pf)
    switch (M - m) {
    case 1: GEMM_REST(1); break;
    case 2: GEMM_REST(2); break;
    case 3: GEMM_REST(3); break;
    case 4: GEMM_REST(4); break;
    case 5: GEMM_REST(5); break;
    default: break;
    }
#undef GEMM_REST
}

/* Rows [0, M) against np (1 or 2) panels, the second pstride bytes after the first; cols of y
   in all (<= np * GEMM_NR). */
static void gemm_rows_wt(int wt, const float *x, int64_t ldx, int64_t M, const char *panel,
                         int64_t pstride, int np, int64_t K, float *y, int64_t ldy, int cols,
                         int pf) {
#if defined(GEMM_AVX512)
#define GEMM_WT(W)                                                                           \
    (np == 2 ? gemm_rows512(W, x, ldx, M, 2, panel, pstride, K, y, ldy, cols, pf)            \
             : gemm_rows512(W, x, ldx, M, 1, panel, pstride, K, y, ldy, cols, pf))
#else
#define GEMM_WT(W)                                                                           \
    for (int c = 0; c < np; c++)                                                             \
        gemm_rows(W, x, ldx, M, panel + c * pstride, K, y + c * GEMM_NR, ldy,                \
                  cols - c * GEMM_NR < GEMM_NR ? cols - c * GEMM_NR : GEMM_NR, pf)
#endif
    switch (wt) {
    case DT_BF16: GEMM_WT(DT_BF16); break;
    case DT_F16: GEMM_WT(DT_F16); break;
    default: GEMM_WT(DT_F32); break;
    }
#undef GEMM_WT
}

/* A work item of the packed GEMMs: rows [m0, m1) against the np panels from p0 (columns from
   n0, cols of them). Items run panel group major, mblocks row blocks of mc rows each. */
typedef struct {
    int64_t m0, m1, p0, n0;
    int np, cols;
} GemmItem;

static inline GemmItem gemm_item(int64_t item, int64_t mblocks, int64_t mc, int64_t M,
                                 int64_t panels, int64_t N) {
    GemmItem it;
    const int64_t g = item / mblocks, mb = item % mblocks;
    it.m0 = mb * mc, it.m1 = it.m0 + mc < M ? it.m0 + mc : M;
    it.p0 = g * GEMM_PANELS_PER_ITEM;
    it.np = panels - it.p0 < GEMM_PANELS_PER_ITEM ? (int)(panels - it.p0) : GEMM_PANELS_PER_ITEM;
    it.n0 = it.p0 * GEMM_NR;
    it.cols = N - it.n0 < it.np * GEMM_NR ? (int)(N - it.n0) : it.np * GEMM_NR;
    return it;
}

/* y[m * ldy + n] = sum_k x[m * ldx + k] * W[n][k] in the one order above, for m < M, n < N;
   wp W's panels (weight code wt, a float code), x float32. Work items: at a few rows, a few
   panels for every row (the weights stream once, widened in registers); beyond, GEMM_MC rows
   against a few panels, each 16-bit panel widened once into a float32 copy in the thread's
   cache that all the item's tiles read (exact, so the same bits: the widening took shuffle
   slots the FMAs need). Which thread takes an item never changes a bit. */
static void gemm_packed_rows(int wt, const float *x, int64_t ldx, int64_t M, int64_t K,
                             const void *wp, int64_t N, float *y, int64_t ldy, int threads) {
    if (M <= 0 || N <= 0) return;
    const int64_t panels = (N + GEMM_NR - 1) / GEMM_NR;
    const int64_t pstride = K * GEMM_NR * gemm_esize(wt); /* bytes per panel */
    const int64_t pgroups = (panels + GEMM_PANELS_PER_ITEM - 1) / GEMM_PANELS_PER_ITEM;
    const int few = M <= GEMM_FEW_ROWS;
    const int64_t mblocks = few ? 1 : (M + GEMM_MC - 1) / GEMM_MC;
    const int64_t mc = few ? M : GEMM_MC;
    const int pf = M <= 2, widen = !few && wt != DT_F32;
    /* items: panel group major, so that a thread's consecutive items share their panels */
    StealRange steal_ranges_[STEAL_MAX_PARTS];
    const int parts = steal_init(steal_ranges_, threads, pgroups * mblocks);
#pragma omp parallel num_threads(parts)
    {
        StealCursor cur = steal_cursor(parts);
        float *wide =
            widen ? malloc(sizeof(float) * (size_t)(K > 0 ? K : 1) * GEMM_NR * GEMM_PANELS_PER_ITEM)
                  : NULL;
        const int64_t wstride = (int64_t)sizeof(float) * K * GEMM_NR; /* bytes per wide panel */
        int64_t wide_panel = -1;
        for (int64_t item; (item = steal_next(steal_ranges_, &cur)) >= 0;) {
            const GemmItem it = gemm_item(item, mblocks, mc, M, panels, N);
            const int64_t m0 = it.m0, m1 = it.m1, p0 = it.p0, n0 = it.n0;
            const int np = it.np, cols = it.cols;
            const char *panel = (const char *)wp + p0 * pstride;
            if (wide) {
                if (wide_panel != p0) {
                    for (int64_t i = 0; i < np * K * GEMM_NR; i++)
                        wide[i] = load_f32(wt, panel, i); /* the np panels are contiguous */
                    wide_panel = p0;
                }
                gemm_rows_wt(DT_F32, x + m0 * ldx, ldx, m1 - m0, (const char *)wide, wstride, np,
                             K, y + m0 * ldy + n0, ldy, cols, pf);
            } else {
                gemm_rows_wt(wt, x + m0 * ldx, ldx, m1 - m0, panel, pstride, np, K,
                             y + m0 * ldy + n0, ldy, cols, pf);
            }
        }
        free(wide);
    }
}

#if defined(GEMM_BF16DOT)
/* The AVX512-BF16 chain (bf16 weights, activations that are bf16 values): every output is
       acc = vdpbf16ps(acc, (x[2i], x[2i+1]), (w[2i], w[2i+1]))   for i = 0, 1, ..., ceil(K/2)-1
   from zero (the products are exact in float32; the instruction's sums round to float32,
   denormals flushed), x and w zero past K. One chain per lane whatever the tile, the rows or the
   thread, as the FMA chain above; its own bits (not the FMA chain's), so a CPU with AVX512-BF16
   agrees with itself, not with the AVX2 class, on steps in bf16. Operands: xb the rows in
   bf16, ldx (even) apart; pp NP panels of K2 pairs x 16 columns (gemm_pairs), pstride bytes
   apart. */
static inline __attribute__((always_inline)) void gemm_tile_bf16(const uint16_t *xb, int64_t ldx,
                                                                 int R, int NP, const char *pp,
                                                                 int64_t pstride, int64_t K2,
                                                                 float *y, int64_t ldy, int cols,
                                                                 int64_t K) {
    __m512 acc[GEMM_MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    /* K > 0: pp holds plain panels ([K][16] bf16, a few rows' step: the pairs are formed in
       registers as the weights stream, vpermt2w interleaving rows 2i and 2i+1) */
    const __m512i mix = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                         8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int64_t i = 0; i < K2; i++) {
        __m512bh b[2];
        for (int c = 0; c < NP; c++) {
            if (K) {
                const uint16_t *w = (const uint16_t *)(pp + c * pstride) + 2 * i * GEMM_NR;
                if ((i & 1) == 0) __builtin_prefetch((const char *)w + GEMM_PF_BYTES, 0, 0);
                const __m256i lo = _mm256_loadu_si256((const __m256i *)w);
                const __m256i hi = 2 * i + 1 < K ? _mm256_loadu_si256((const __m256i *)(w + GEMM_NR))
                                                 : _mm256_setzero_si256();
                b[c] = (__m512bh)_mm512_permutex2var_epi16(_mm512_castsi256_si512(lo), mix,
                                                           _mm512_castsi256_si512(hi));
            } else {
                b[c] = (__m512bh)_mm512_loadu_si512((const void *)(pp + c * pstride + i * 64));
            }
        }
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, xb + r * ldx + 2 * i, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < NP; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
        }
    }
    for (int c = 0; c < NP; c++) {
        const int left = cols - c * GEMM_NR;
        const __mmask16 m = left >= GEMM_NR ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy + c * GEMM_NR, m, acc[r][c]);
    }
}

/* Rows [0, M) in tiles of GEMM_MR (the last smaller) against NP pair panels. */
static inline __attribute__((always_inline)) void gemm_rows_bf16(const uint16_t *xb, int64_t ldx,
                                                                 int64_t M, int NP,
                                                                 const char *pp, int64_t pstride,
                                                                 int64_t K2, float *y,
                                                                 int64_t ldy, int cols,
                                                                 int64_t K) {
    int64_t m = 0;
    for (; m + GEMM_MR <= M; m += GEMM_MR)
        gemm_tile_bf16(xb + m * ldx, ldx, GEMM_MR, NP, pp, pstride, K2, y + m * ldy, ldy, cols,
                       K);
#define GEMM_REST(R) \
    gemm_tile_bf16(xb + m * ldx, ldx, R, NP, pp, pstride, K2, y + m * ldy, ldy, cols, K)
    switch (M - m) { GEMM_REST_CASES_11 default: break; }
#undef GEMM_REST
}

/* One bf16 panel ([K][16]) as K2 = ceil(K/2) pairs of k for each column: out[i][j] = (w[2i][j],
   w[2i+1][j]), 32 bf16 per i, zero past K. */
static inline void gemm_pairs(const uint16_t *panel, int64_t K, uint16_t *out) {
    for (int64_t i = 0; 2 * i < K; i++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(panel + 2 * i * GEMM_NR));
        const __m256i b = 2 * i + 1 < K
                              ? _mm256_loadu_si256((const __m256i *)(panel + (2 * i + 1) * GEMM_NR))
                              : _mm256_setzero_si256();
        const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
        _mm256_storeu_si256((__m256i *)(out + i * 32), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)(out + i * 32 + 16),
                            _mm256_permute2x128_si256(lo, hi, 0x31));
    }
}

/* gemm_packed_rows for bf16 panels and float32 rows x that hold bf16 values: the chain above.
   Returns 0, or -1 without memory (nothing written). Work items as gemm_packed_rows'; each
   thread turns an item's panels into pairs once for all its rows. */
static int gemm_packed_bf16(const float *x, int64_t ldx, int64_t M, int64_t K, const void *wp,
                            int64_t N, float *y, int64_t ldy, int threads) {
    const int64_t K2 = (K + 1) / 2, ldb = 2 * K2;
    const int64_t panels = (N + GEMM_NR - 1) / GEMM_NR;
    const int64_t pstride = K * GEMM_NR * 2, qstride = K2 * 64; /* bytes per panel, pair panel */
    const int64_t pgroups = (panels + GEMM_PANELS_PER_ITEM - 1) / GEMM_PANELS_PER_ITEM;
    const int few = M <= GEMM_FEW_ROWS;
    const int64_t mblocks = few ? 1 : (M + GEMM_MC - 1) / GEMM_MC;
    const int64_t mc = few ? M : GEMM_MC;
    StealRange steal_ranges_[STEAL_MAX_PARTS];
    const int parts = steal_init(steal_ranges_, threads, pgroups * mblocks);
    const size_t per = (size_t)(qstride * GEMM_PANELS_PER_ITEM);
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(M * ldb));
    char *pairs = malloc(per * (size_t)(parts > 0 ? parts : 1));
    if (!xb || !pairs) {
        free(xb), free(pairs);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++) xb[m * ldb + k] = f32_to_bf16(x[m * ldx + k]);
        if (K % 2) xb[m * ldb + K] = 0;
    }
#pragma omp parallel num_threads(parts)
    {
        StealCursor cur = steal_cursor(parts);
        char *pp = pairs + per * (size_t)cur.self;
        int64_t have = -1;
        for (int64_t item; (item = steal_next(steal_ranges_, &cur)) >= 0;) {
            const GemmItem it = gemm_item(item, mblocks, mc, M, panels, N);
            const int64_t m0 = it.m0, m1 = it.m1, p0 = it.p0, n0 = it.n0;
            const int np = it.np, cols = it.cols;
            if (few) { /* the weights stream once: pairs formed in registers */
                const char *panel = (const char *)wp + p0 * pstride;
                if (np == 2)
                    gemm_rows_bf16(xb, ldb, M, 2, panel, pstride, K2, y + n0, ldy, cols, K);
                else
                    gemm_rows_bf16(xb, ldb, M, 1, panel, pstride, K2, y + n0, ldy, cols, K);
                continue;
            }
            if (have != p0) {
                for (int c = 0; c < np; c++)
                    gemm_pairs((const uint16_t *)((const char *)wp + (p0 + c) * pstride), K,
                               (uint16_t *)(pp + c * qstride));
                have = p0;
            }
            if (np == 2)
                gemm_rows_bf16(xb + m0 * ldb, ldb, m1 - m0, 2, pp, qstride, K2,
                               y + m0 * ldy + n0, ldy, cols, 0);
            else
                gemm_rows_bf16(xb + m0 * ldb, ldb, m1 - m0, 1, pp, qstride, K2,
                               y + m0 * ldy + n0, ldy, cols, 0);
        }
    }
    free(xb), free(pairs);
    return 0;
}
#endif

/* Rows up to which a row count that is not a multiple of GEMM_MR is padded with zero rows to one:
   a last tile of 1 to 5 rows streams (or reads) a whole panel for few FMAs, and measured on a
   2-core AVX2 EPYC a 1536x576 bf16 projection took 162 us at 3 rows, 121 us at 6, 218 us at 7
   and 197 us at 12 (the rows of a step that verifies speculative drafts). A row's outputs are
   its own chains, so padding changes none of their bits. One and two rows (decode steps) stay
   as they are: they stream the weights at memory speed. */
#ifndef GEMM_PAD_ROWS /* -DGEMM_PAD_ROWS=0 to measure without */
#if defined(GEMM_AVX512) /* a Zen 5 EPYC, bf16, 576 <-> 1536: 3 rows 18 us unpadded, 47 padded */
#define GEMM_PAD_ROWS 0  /* (12 rows 44); 13 rows 68 against 104: a partial tile costs its rows */
#else
#define GEMM_PAD_ROWS 48
#endif
#endif

/* xbf: x holds bf16 values (a step in bf16), which on AVX512-BF16 takes that chain for bf16
   weights (gemm_packed_bf16). */
static __attribute__((unused)) void gemm_packed(int wt, const float *x, int64_t ldx, int64_t M,
                                                int64_t K, const void *wp, int64_t N, float *y,
                                                int64_t ldy, int threads, int xbf) {
#if defined(GEMM_BF16DOT)
    /* (without memory for it, the FMA chain: other bits, still one order per output) */
    if (xbf && wt == DT_BF16 && M > 0 && N > 0 && K > 0 &&
        gemm_packed_bf16(x, ldx, M, K, wp, N, y, ldy, threads) == 0)
        return;
#else
    (void)xbf;
#endif
    const int64_t rest = M % GEMM_MR;
    if (M <= 2 || M > GEMM_PAD_ROWS || rest == 0 || N <= 0 || K <= 0) {
        gemm_packed_rows(wt, x, ldx, M, K, wp, N, y, ldy, threads);
        return;
    }
    const int64_t Mp = M + GEMM_MR - rest;
    float *xp = calloc((size_t)(Mp * K), sizeof(float));
    float *yp = malloc(sizeof(float) * (size_t)(Mp * N));
    if (!xp || !yp) { /* no memory for the padding: the same bits, unpadded */
        free(xp), free(yp);
        gemm_packed_rows(wt, x, ldx, M, K, wp, N, y, ldy, threads);
        return;
    }
    for (int64_t m = 0; m < M; m++) memcpy(xp + m * K, x + m * ldx, sizeof(float) * (size_t)K);
    gemm_packed_rows(wt, xp, K, Mp, K, wp, N, yp, N, threads);
    for (int64_t m = 0; m < M; m++) memcpy(y + m * ldy, yp + m * N, sizeof(float) * (size_t)N);
    free(xp), free(yp);
}

#endif
