/* Weight-only int8 matmul for a few rows on the CPU: y[m, n] = scale[n] * sum_k x[m, k] w[n, k].

   The C counterpart of int8_matmul_ref (engine/kernels/int8_matmul.py) for decode, where a step
   reads every weight once and its speed is the bandwidth at which the int8 weights stream in.
   Blocks of output rows are shared among torch's OpenMP threads; each int8 row is read once for
   all of x's rows (at most GEMV_ROWS_LIMIT), against x in int16 blocks (gemv.h: exact int32 sums
   within a block, float32 across). y is rounded to x's dtype. */

#include <stdint.h>
#include <stdlib.h>

#include "gemv.h"
#include "steal.h"

#define ROW_BLOCK 16 /* output rows per work item */

/* The row dots gemv.h compiled in here (GEMV_PATHS): "int8:<path> bf16:<path> float:<path>",
   each path avx512vnni, avx512bf16, avx512, avx2 or c (plain loops). */
const char *engine_gemv_paths(void) { return GEMV_PATHS; }

/* x [rows, K] (row stride sx, dtype dt), w [N, K] int8 contiguous, scales [N] (dtype dt), y [rows,
   N] (row stride sy, dtype dt). Returns 0, -1 for more than GEMV_ROWS_LIMIT rows, -2 without
   memory. */
int engine_int8_matmul(int dt, const void *x, const int8_t *w, const void *scales, void *y,
                       int rows, int64_t N, int64_t K, int64_t sx, int64_t sy, int num_threads) {
    if (rows > GEMV_ROWS_LIMIT || rows < 0) return -1;
    if (rows == 0 || N == 0) return 0;
    float *xf = malloc(sizeof(float) * (size_t)rows * (size_t)(K > 0 ? K : 1));
    if (!xf) return -2;
    for (int m = 0; m < rows; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = load_f32(dt, x, m * sx + k);
    RowGroups acts;
    if (groups_prepare(&acts, W_I8, xf, rows, K)) {
        free(xf);
        return -2;
    }
    const int64_t blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
    STEAL_FOR(blk, num_threads, blocks) {
        const int64_t n1 = (blk + 1) * ROW_BLOCK < N ? (blk + 1) * ROW_BLOCK : N;
        for (int64_t n = blk * ROW_BLOCK; n < n1; n++) {
            float dots[GEMV_ROWS_LIMIT];
            row_dots_groups(W_I8, &acts, w + n * K, dots);
            const float s = load_f32(dt, scales, n);
            for (int m = 0; m < rows; m++) store_f32(dt, y, m * sy + n, dots[m] * s);
        }
    }
    groups_free(&acts);
    free(xf);
    return 0;
}
