/* Dot products of one weight row with a few activation rows: the inner loop of the
   weight-streaming matmuls (int8_matmul.c, float_matmul.c, decode_layer.c). At a few rows a
   matmul's speed is the bandwidth at which the weights stream in, so each weight row is read once
   for every activation row, and the arithmetic per weight byte must stay below what the memory
   delivers.

   Weight codes: the 16-bit and float32 codes of dtypes.h, and W_I8 for int8 (scaled by the
   caller). The activations are prepared once per matmul (acts_prepare, gemv_acts.h) in the form
   that suits the weights: int16 blocks for int8, bfloat16 for bfloat16 (with AVX512-BF16),
   float32 for the rest. The row dots here are the AVX-512 paths (VNNI for int8, AVX512-BF16 for
   bfloat16, AVX-512 F for the float codes); on AVX2 with FMA and F16C they call those of
   gemv_avx2.h; elsewhere plain loops (GEMV_PATHS, gemv_acts.h, names what was compiled in;
   engine_gemv_paths reports it).

   The sums of a given weight code and K are formed in the same order whatever the row count, so a
   row's result does not depend on the rows beside it. */

#ifndef ENGINE_NATIVE_GEMV_H
#define ENGINE_NATIVE_GEMV_H

#include "gemv_acts.h"
#include "gemv_avx2.h"


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
