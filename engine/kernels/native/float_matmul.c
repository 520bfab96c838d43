/* A matmul with float weights for a few rows on the CPU: y[m, n] = sum_k x[m, k] w[n, k] in
   float32, y float32 (the LM head's logits at a decode step).

   The C counterpart of float_matmul_ref (engine/kernels/float_matmul.py). At a few rows torch's
   float32 GEMM copies (packs) the whole weight on every call: for the default model's LM head
   (49152 x 576, 113 MB) at 16 rows that took ~31 ms of a ~180 ms decode step under
   ENGINE_CPU_ISA=avx2 (one thread), about 4 GB/s. Here every weight row is read once for all of
   x's rows (gemv.h's row dots, or its tiles of weight rows from GEMV_TILE_MIN_ROWS rows on AVX2),
   blocks of output rows shared among torch's OpenMP threads; a row's sums do not depend on the
   rows beside it. */

#include <stdint.h>
#include <stdlib.h>

#include "gemv.h"
#include "steal.h"

#define ROW_BLOCK 18 /* output rows per work item (6 tiles of 3) */

/* x [rows, K] (row stride sx, dtype dt), w [N, K] contiguous (weight code wt: a float dtype),
   y [rows, N] float32 (row stride sy). Returns 0, -1 for more than GEMV_ROWS_LIMIT rows or an
   int8 weight code, -2 without memory. */
int engine_float_matmul(int dt, int wt, const void *x, const void *w, float *y, int rows,
                        int64_t N, int64_t K, int64_t sx, int64_t sy, int num_threads) {
    if (rows > GEMV_ROWS_LIMIT || rows < 0 || wt == W_I8) return -1;
    if (rows == 0 || N == 0) return 0;
    const int64_t wsize = wt == DT_F32 ? 4 : 2;
    float *xf = malloc(sizeof(float) * (size_t)rows * (size_t)(K > 0 ? K : 1));
    if (!xf) return -2;
    for (int m = 0; m < rows; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = load_f32(dt, x, m * sx + k);
    const int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
#if defined(GEMV_FLOAT_TILES)
    if (rows >= GEMV_TILE_MIN_ROWS) {
        STEAL_FOR(blk, num_threads, blocks) {
            const int64_t n1 = (blk + 1) * ROW_BLOCK < N ? (blk + 1) * ROW_BLOCK : N;
            for (int64_t n = blk * ROW_BLOCK; n < n1; n += GEMV_TILE_COLS) {
                const int C = n1 - n < GEMV_TILE_COLS ? (int)(n1 - n) : GEMV_TILE_COLS;
                float dots[GEMV_TILE_COLS][GEMV_ROWS_LIMIT];
                float_tiles(wt, xf, rows, K, (const char *)w + n * K * wsize, K * wsize, C,
                            &dots[0][0], GEMV_ROWS_LIMIT);
                for (int c = 0; c < C; c++)
                    for (int m = 0; m < rows; m++) y[m * sy + n + c] = dots[c][m];
            }
        }
        free(xf);
        return 0;
    }
#endif
    RowGroups acts;
    if (groups_prepare(&acts, wt, xf, rows, K)) {
        free(xf);
        return -2;
    }
    STEAL_FOR(blk, num_threads, blocks) {
        const int64_t n1 = (blk + 1) * ROW_BLOCK < N ? (blk + 1) * ROW_BLOCK : N;
        for (int64_t n = blk * ROW_BLOCK; n < n1; n++) {
            float dots[GEMV_ROWS_LIMIT];
            row_dots_groups(wt, &acts, (const char *)w + n * K * wsize, dots);
            for (int m = 0; m < rows; m++) y[m * sy + n] = dots[m];
        }
    }
    groups_free(&acts);
    free(xf);
    return 0;
}
