/* The fixed-order GEMM (gemm.h) as a call of its own: y = x W^T in float32 for any number of
   rows, W packed in panels. The C counterpart of gemm_ref (engine/kernels/gemm.py): the LM head
   of every step, and the kernel the tests hold to one order. */

#include <stdint.h>
#include <stdlib.h>

#include "gemm.h"
#include "gemm_q8.h"

/* The path compiled in: "avx2" or "c" (plain loops with fmaf; the same bits). */
const char *engine_gemm_path(void) { return GEMM_PATH; }

/* The W8A8 GEMM's path (gemm_q8.h): "avx512vnni", "avx2" or "c"; the same bits. */
const char *engine_gemm_q8_path(void) { return Q8_PATH; }

/* x [M, K] (dtype dt, row stride sx), wp W's panels (weight code wt, a float code; N rows of K),
   y [M, N] float32 (row stride sy). Returns 0, -1 for a weight code that is not a float one, -2
   without memory. */
int engine_gemm(int dt, int wt, const void *x, const void *wp, float *y, int64_t M, int64_t N,
                int64_t K, int64_t sx, int64_t sy, int num_threads) {
    if (M < 0 || N < 0 || K < 0 || (wt != DT_F32 && wt != DT_BF16 && wt != DT_F16)) return -1;
    if (M == 0 || N == 0) return 0;
    const float *xf = (const float *)x;
    float *buf = NULL;
    int64_t ldx = sx;
    if (dt != DT_F32) {
        buf = malloc(sizeof(float) * (size_t)M * (size_t)(K > 0 ? K : 1));
        if (!buf) return -2;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) buf[m * K + k] = load_f32(dt, x, m * sx + k);
        xf = buf, ldx = K;
    }
    gemm_packed(wt, xf, ldx, M, K, wp, N, y, sy, num_threads, dt == DT_BF16);
    free(buf);
    return 0;
}

/* x [M, K] (dtype dt, row stride sx), wp W's W8A8 panels (gemm_q8.py pack_q8; N rows of K), y
   [M, N] float32 (row stride sy): gemm_q8.h's chain. Returns 0, -1 for bad shapes, -2 without
   memory. */
int engine_gemm_q8(int dt, const void *x, const void *wp, float *y, int64_t M, int64_t N,
                   int64_t K, int64_t sx, int64_t sy, int num_threads) {
    if (M < 0 || N < 0 || K < 0) return -1;
    return gemm_q8(dt, x, sx, M, K, wp, N, y, sy, num_threads);
}
