/* The most products per second this CPU's vector instructions give, each mix alone in a loop of
   independent chains (inline assembly: no loads, no spills, nothing else), on every OpenMP
   thread at once: profiling/bench_product_peak.py builds this file with the engine's compiler
   and target flags (so under ENGINE_CPU_ISA=avx2, -march=x86-64-v3: the AVX2 mixes only) and
   runs it.

   Each mix is what a kernel's inner step does per product chain:
     fma f32 ymm            vfmadd231ps                          8 products
     int16 ymm              vpmaddwd + vpaddd                    16 (the int8 cache's attention)
     int8 ymm               vpmaddubsw + vpmaddwd + vpaddd       32 (the W8A8 GEMM on AVX2)
     fma f32 zmm            vfmadd231ps                          16
     bf16 zmm               vdpbf16ps                            32 (the bf16 GEMM natively)
     int8 zmm               vpdpbusd                             64 (the W8A8 GEMM natively)
   Usage: product_peak ITERATIONS THREADS; prints "mix<TAB>products per step<TAB>GMAC/s". */

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define CHAINS12(op) \
    op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11)

#define FMA_Y(i) "vfmadd231ps %%ymm12, %%ymm13, %%ymm" #i "\n\t"
#define MADD_Y(i) "vpmaddwd %%ymm12, %%ymm13, %%ymm14\n\tvpaddd %%ymm14, %%ymm" #i ", %%ymm" #i "\n\t"
#define UBS_Y(i) \
    "vpmaddubsw %%ymm12, %%ymm13, %%ymm14\n\tvpmaddwd %%ymm15, %%ymm14, %%ymm14\n\t" \
    "vpaddd %%ymm14, %%ymm" #i ", %%ymm" #i "\n\t"
#define YMM_CLOBBERS                                                                           \
    "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"

static void fma_ymm(long n) {
    for (long k = 0; k < n; k++) __asm__ volatile(CHAINS12(FMA_Y)::: YMM_CLOBBERS);
}
static void int16_ymm(long n) {
    for (long k = 0; k < n; k++) __asm__ volatile(CHAINS12(MADD_Y)::: YMM_CLOBBERS);
}
static void int8_ymm(long n) {
    for (long k = 0; k < n; k++) __asm__ volatile(CHAINS12(UBS_Y)::: YMM_CLOBBERS);
}

#if defined(__AVX512F__)
#define FMA_Z(i) "vfmadd231ps %%zmm12, %%zmm13, %%zmm" #i "\n\t"
#define BF16_Z(i) "vdpbf16ps %%zmm12, %%zmm13, %%zmm" #i "\n\t"
#define VNNI_Z(i) "vpdpbusd %%zmm12, %%zmm13, %%zmm" #i "\n\t"
static void fma_zmm(long n) {
    for (long k = 0; k < n; k++) __asm__ volatile(CHAINS12(FMA_Z)::: YMM_CLOBBERS);
}
#if defined(__AVX512BF16__)
static void bf16_zmm(long n) {
    for (long k = 0; k < n; k++) __asm__ volatile(CHAINS12(BF16_Z)::: YMM_CLOBBERS);
}
#endif
#if defined(__AVX512VNNI__)
static void int8_zmm(long n) {
    for (long k = 0; k < n; k++) __asm__ volatile(CHAINS12(VNNI_Z)::: YMM_CLOBBERS);
}
#endif
#endif

typedef struct {
    const char *name;
    int products; /* per chain step */
    void (*run)(long);
} Mix;

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s ITERATIONS THREADS\n", argv[0]);
        return 2;
    }
    const long n = atol(argv[1]);
    const int threads = atoi(argv[2]);
    if (n < 1 || threads < 1) {
        fprintf(stderr, "ITERATIONS and THREADS must be at least 1\n");
        return 2;
    }
    const Mix mixes[] = {
        {"fma f32 ymm", 8, fma_ymm},
        {"int16 ymm", 16, int16_ymm},
        {"int8 ymm", 32, int8_ymm},
#if defined(__AVX512F__)
        {"fma f32 zmm", 16, fma_zmm},
#if defined(__AVX512BF16__)
        {"bf16 zmm", 32, bf16_zmm},
#endif
#if defined(__AVX512VNNI__)
        {"int8 zmm", 64, int8_zmm},
#endif
#endif
    };
    for (size_t m = 0; m < sizeof mixes / sizeof mixes[0]; m++) {
        double best = 1e30;
        for (int rep = 0; rep < 3; rep++) {
            const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
            mixes[m].run(n);
            const double t = omp_get_wtime() - t0;
            best = t < best ? t : best;
        }
        const double macs = (double)n * 12 * mixes[m].products * threads;
        printf("%s\t%d\t%.1f\n", mixes[m].name, mixes[m].products, macs / best / 1e9);
    }
    return 0;
}
