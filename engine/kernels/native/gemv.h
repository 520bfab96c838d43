/* Dot products of one weight row with a few float32 activation rows: the inner loop of the
   weight-streaming matmuls (int8_matmul.c, decode_layer.c). At a few rows a matmul's speed is the
   bandwidth at which the weights stream in, so each weight row is read once for every activation
   row and widened to float32 in registers. Sums in float32.

   Weight codes: the 16-bit and float32 codes of dtypes.h, and W_I8 for int8 (scaled by the
   caller). The sums of a given code, K and row count are always formed in the same order. */

#ifndef ENGINE_NATIVE_GEMV_H
#define ENGINE_NATIVE_GEMV_H

#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dtypes.h"

#define GEMV_MAX_ROWS 8
#define W_I8 3 /* int8 weight rows (per-row scales applied by the caller) */

static inline float load_w(int wt, const void *w, int64_t k) {
    return wt == W_I8 ? (float)((const int8_t *)w)[k] : load_f32(wt, w, k);
}

#if defined(__AVX512F__)
/* 16 weights from element k of w, as float32. */
static inline __attribute__((always_inline)) __m512 widen16_w(int wt, const void *w, int64_t k) {
    if (wt == W_I8)
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + k))));
    if (wt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k))),
            16));
    if (wt == DT_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k)));
    return _mm512_loadu_ps((const float *)w + k);
}
#endif

/* out[m] = sum_k xf[m * K + k] * w[k] for m < rows (rows <= GEMV_MAX_ROWS). Inlined with a
   constant wt at each call site of row_dots, so every weight code gets its own loop. */
static inline __attribute__((always_inline)) void row_dots_wt(int wt, const float *xf, int rows,
                                                              int64_t K, const void *w,
                                                              float *out) {
    int64_t k = 0;
    for (int m = 0; m < rows; m++) out[m] = 0.f;
#if defined(__AVX512F__)
    if (rows == 1) { /* four independent sums: one FMA chain would wait on its own latency */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; k + 64 <= K; k += 64) {
            a0 = _mm512_fmadd_ps(widen16_w(wt, w, k), _mm512_loadu_ps(xf + k), a0);
            a1 = _mm512_fmadd_ps(widen16_w(wt, w, k + 16), _mm512_loadu_ps(xf + k + 16), a1);
            a2 = _mm512_fmadd_ps(widen16_w(wt, w, k + 32), _mm512_loadu_ps(xf + k + 32), a2);
            a3 = _mm512_fmadd_ps(widen16_w(wt, w, k + 48), _mm512_loadu_ps(xf + k + 48), a3);
        }
        for (; k + 16 <= K; k += 16)
            a0 = _mm512_fmadd_ps(widen16_w(wt, w, k), _mm512_loadu_ps(xf + k), a0);
        out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    } else {
        __m512 acc[GEMV_MAX_ROWS];
        for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) {
            const __m512 wf = widen16_w(wt, w, k);
            for (int m = 0; m < rows; m++)
                acc[m] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(xf + m * K + k), acc[m]);
        }
        for (int m = 0; m < rows; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
    }
#endif
    for (; k < K; k++) {
        const float wk = load_w(wt, w, k);
        for (int m = 0; m < rows; m++) out[m] += xf[m * K + k] * wk;
    }
}

static inline void row_dots(int wt, const float *xf, int rows, int64_t K, const void *w,
                            float *out) {
    switch (wt) {
    case W_I8: row_dots_wt(W_I8, xf, rows, K, w, out); break;
    case DT_BF16: row_dots_wt(DT_BF16, xf, rows, K, w, out); break;
    case DT_F16: row_dots_wt(DT_F16, xf, rows, K, w, out); break;
    default: row_dots_wt(DT_F32, xf, rows, K, w, out); break;
    }
}

#endif
