/* Weight-only int8 matmul for a few rows on the CPU: y[m, n] = scale[n] * sum_k x[m, k] w[n, k].

   The C counterpart of int8_matmul_ref (engine/kernels/int8_matmul.py) for decode, where a step
   reads every weight once and its speed is the bandwidth at which the int8 weights stream in.
   Blocks of output rows are shared among torch's OpenMP threads; each int8 row is read once for
   all of x's rows (at most MAX_ROWS) and widened to float32 in registers. Sums in float32; y is
   rounded to x's dtype. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dtypes.h"

#define MAX_ROWS 8
#define ROW_BLOCK 16 /* output rows per work item */

#if defined(__AVX512F__)
static inline __m512 widen16(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}
#endif

/* out[m] = sum_k xf[m * K + k] * w[k] for m < rows. */
static inline void row_dots(const float *xf, int rows, int64_t K, const int8_t *w, float *out) {
    int64_t k = 0;
    for (int m = 0; m < rows; m++) out[m] = 0.f;
#if defined(__AVX512F__)
    if (rows == 1) { /* four independent sums: one FMA chain would wait on its own latency */
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; k + 64 <= K; k += 64) {
            a0 = _mm512_fmadd_ps(widen16(w + k), _mm512_loadu_ps(xf + k), a0);
            a1 = _mm512_fmadd_ps(widen16(w + k + 16), _mm512_loadu_ps(xf + k + 16), a1);
            a2 = _mm512_fmadd_ps(widen16(w + k + 32), _mm512_loadu_ps(xf + k + 32), a2);
            a3 = _mm512_fmadd_ps(widen16(w + k + 48), _mm512_loadu_ps(xf + k + 48), a3);
        }
        for (; k + 16 <= K; k += 16)
            a0 = _mm512_fmadd_ps(widen16(w + k), _mm512_loadu_ps(xf + k), a0);
        out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    } else {
        __m512 acc[MAX_ROWS];
        for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) {
            const __m512 wf = widen16(w + k);
            for (int m = 0; m < rows; m++)
                acc[m] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(xf + m * K + k), acc[m]);
        }
        for (int m = 0; m < rows; m++) out[m] = _mm512_reduce_add_ps(acc[m]);
    }
#endif
    for (; k < K; k++)
        for (int m = 0; m < rows; m++) out[m] += xf[m * K + k] * (float)w[k];
}

/* x [rows, K] (row stride sx, dtype dt), w [N, K] int8 contiguous, scales [N] (dtype dt), y [rows,
   N] (row stride sy, dtype dt). Returns 0, -1 for more than MAX_ROWS rows, -2 without memory. */
int engine_int8_matmul(int dt, const void *x, const int8_t *w, const void *scales, void *y,
                       int rows, int64_t N, int64_t K, int64_t sx, int64_t sy, int num_threads) {
    if (rows > MAX_ROWS || rows < 0) return -1;
    if (rows == 0 || N == 0) return 0;
    float *xf = malloc(sizeof(float) * (size_t)rows * (size_t)(K > 0 ? K : 1));
    if (!xf) return -2;
    for (int m = 0; m < rows; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = load_f32(dt, x, m * sx + k);
    const int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n1 = (blk + 1) * ROW_BLOCK < N ? (blk + 1) * ROW_BLOCK : N;
        for (int64_t n = blk * ROW_BLOCK; n < n1; n++) {
            float dots[MAX_ROWS];
            row_dots(xf, rows, K, w + n * K, dots);
            const float s = load_f32(dt, scales, n);
            for (int m = 0; m < rows; m++) store_f32(dt, y, m * sy + n, dots[m] * s);
        }
    }
    free(xf);
    return 0;
}
