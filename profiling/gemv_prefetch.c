/* The row dots of engine/kernels/native/gemv.h at one activation row, as a decode step runs
   them, with and without their prefetch: profiling/bench_int8.py --prefetch builds this file
   twice (PASS=pass_default with gemv.h's GEMV_PF_BYTES; PASS=pass_off with it 0) and once with
   -DMAIN, then times the two passes in turn, for int8 and for bfloat16 weights.

   A pass: every projection of the default model's 30 layers (qkv 576->960, o 576->576, gate_up
   576->3072, down 1536->576: 106 M weights, more than the caches hold) against one activation
   row, output rows in blocks of 16 shared among the OpenMP threads, as decode_layer.c's project.
   Prints the best and the median of the passes of each, and the bandwidth at the median. */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "gemv.h"

#define LAYERS 30
#define PROJS 4
static const int64_t OUT[PROJS] = {960, 576, 3072, 576}, IN[PROJS] = {576, 576, 576, 1536};

#ifndef MAIN
/* w: the LAYERS * PROJS weights of code wt (W_I8 or DT_BF16); acts prepared for it. */
void PASS(int wt, void *const *w, const Acts *acts, float *y, int threads) {
    const int64_t esize = wt == W_I8 ? 1 : 2;
    for (int i = 0; i < LAYERS * PROJS; i++) {
        const int64_t N = OUT[i % PROJS], K = IN[i % PROJS];
        const Acts *a = &acts[i % PROJS];
        const char *wi = (const char *)w[i];
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t blk = 0; blk < (N + 15) / 16; blk++)
            for (int64_t n = blk * 16; n < N && n < blk * 16 + 16; n++)
                row_dots(wt, a, wi + n * K * esize, y + n);
    }
}
#else
#include <time.h>
void pass_default(int wt, void *const *w, const Acts *acts, float *y, int threads);
void pass_off(int wt, void *const *w, const Acts *acts, float *y, int threads);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 60, threads = argc > 2 ? atoi(argv[2]) : 2;
    if (reps < 1 || threads < 1) return 2;
    printf("%d threads, %d passes of each in turn, prefetch %d bytes ahead\n", threads, reps,
           GEMV_PF_BYTES);
    printf("%-9s %-14s %8s %10s %7s\n", "weights", "prefetch", "best ms", "median ms", "GB/s");
    srand(0);
    float x[1536], y[3072];
    for (int k = 0; k < 1536; k++) x[k] = (float)rand() / RAND_MAX - 0.5f;
    const int codes[2] = {W_I8, DT_BF16};
    for (int c = 0; c < 2; c++) {
        const int wt = codes[c];
        const int64_t esize = wt == W_I8 ? 1 : 2;
        void *w[LAYERS * PROJS];
        double bytes = 0;
        for (int i = 0; i < LAYERS * PROJS; i++) {
            const int64_t n = OUT[i % PROJS] * IN[i % PROJS];
            if (!(w[i] = malloc(n * esize))) return 3;
            for (int64_t j = 0; j < n; j++) {
                if (wt == W_I8)
                    ((int8_t *)w[i])[j] = (int8_t)(rand() % 255 - 127);
                else
                    ((uint16_t *)w[i])[j] = f32_to_bf16((float)rand() / RAND_MAX - 0.5f);
            }
            bytes += (double)(n * esize);
        }
        Acts acts[PROJS];
        for (int p = 0; p < PROJS; p++)
            if (acts_prepare(&acts[p], wt, x, 1, IN[p])) return 3;
        double *t[2] = {malloc(sizeof(double) * reps), malloc(sizeof(double) * reps)};
        for (int r = 0; r < reps; r++)
            for (int v = 0; v < 2; v++) {
                const double t0 = now();
                (v ? pass_off : pass_default)(wt, w, acts, y, threads);
                t[v][r] = now() - t0;
            }
        for (int v = 0; v < 2; v++) {
            qsort(t[v], reps, sizeof(double), by_value);
            printf("%-9s %-14s %8.2f %10.2f %7.1f\n", wt == W_I8 ? "int8" : "bfloat16",
                   v ? "off" : "on (default)", t[v][0] * 1e3, t[v][reps / 2] * 1e3,
                   bytes / t[v][reps / 2] / 1e9);
        }
        for (int p = 0; p < PROJS; p++) acts_free(&acts[p]);
        for (int i = 0; i < LAYERS * PROJS; i++) free(w[i]);
        free(t[0]), free(t[1]);
    }
    return 0;
}
#endif
