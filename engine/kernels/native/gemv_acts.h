/* The row dots' constants and the vector paths this build compiles in (gemv.h, whose row dots
   use them), and the activations prepared once per matmul (acts_prepare) in the form that suits
   the weights:

   - int8 weights: each activation row in blocks of GEMV_BLOCK values, as int16 times a power of
     two per block (2^(e - 15) for a block whose largest magnitude is below 2^e). Every value
     within 2^7 of its block's largest is exact (a 16-bit float has at most 11 significant bits,
     bfloat16 8), smaller ones are off by at most 2^-16 of the block's largest. Products and
     their sums within a block are exact int32 (AVX512-VNNI vpdpwssd: 32 multiply-adds per
     instruction against 16 for float32 FMAs after widening, which capped int8 at ~17 GB/s
     against the ~24 GB/s this machine reads); blocks are summed in float32.
   - bfloat16 weights: the activations as bfloat16 (exact: the layers round them to the model's
     dtype already), multiplied in pairs into float32 sums (AVX512-BF16 vdpbf16ps).
   - float16 and float32 weights: float32 activations and FMAs after widening. */

#ifndef ENGINE_NATIVE_GEMV_ACTS_H
#define ENGINE_NATIVE_GEMV_ACTS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dtypes.h"

#define GEMV_MAX_ROWS 8
#define GEMV_BLOCK 256 /* activation values per int16 scale; 16 products per int32 lane */
#define W_I8 3         /* int8 weight rows (per-row scales applied by the caller) */
/* One activation row on AVX2 (int8 weights without VNNI, 16-bit and float32 weights without
   AVX-512): the weights GEMV_PF_BYTES ahead are prefetched as the dot goes (into the rows after
   it, which the same thread takes next; every caller's weight rows are contiguous). There the
   kernel's own work per byte (sign extension and vpmaddwd for int8, widening and FMAs for bf16)
   is near what the memory delivers and the hardware prefetcher alone lags. The default model's
   120 projections streamed from memory at one row, 2 threads, a Zen 3 EPYC, passes of each in
   turn, median (profiling/bench_int8.py --prefetch): int8 8.4-9.4 -> 6.3-7.1 ms (11-13 -> 15-17
   GB/s; a plain read of the same bytes: ~19), bf16 16.0 -> 14.0 ms. In variants of that harness
   2 KB to 8 KB ahead all helped int8, bf16 was best at 4 KB, float32 gained ~5-10%. Who takes
   these row dots at one row: the int8 projections and LM head, the float LM head
   (float_matmul.c); float projections of a decode layer take tiles there (GEMV_TILES_FOR).
   Several rows: decode_layer.c prefetches whole rows ahead (PF_ROWS). The same prefetch in the
   AVX-512 row dots (VNNI int8, AVX512-BF16, AVX-512 float) measured no gain on a Zen 4 EPYC
   (bench_int8.py --prefetch --reps 40, twice: int8 5.2 ms on against 4.5-5.3 off, bf16 6.7-7.2
   against 5.5-6.9), so it reaches only the AVX2 paths. */
#ifndef GEMV_PF_BYTES
#define GEMV_PF_BYTES 4096
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GEMV_VNNI 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GEMV_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GEMV_AVX2 1
#endif

/* The row dots compiled in, by weight code: "int8:<path> bf16:<path> float:<path>". */
#if defined(GEMV_VNNI)
#define GEMV_PATH_I8 "avx512vnni"
#elif defined(GEMV_AVX2)
#define GEMV_PATH_I8 "avx2"
#else
#define GEMV_PATH_I8 "c"
#endif
#if defined(__AVX512F__)
#define GEMV_PATH_FLOAT "avx512"
#elif defined(GEMV_AVX2)
#define GEMV_PATH_FLOAT "avx2"
#else
#define GEMV_PATH_FLOAT "c"
#endif
#if defined(GEMV_BF16)
#define GEMV_PATH_BF16 "avx512bf16"
#else
#define GEMV_PATH_BF16 GEMV_PATH_FLOAT
#endif
#define GEMV_PATHS "int8:" GEMV_PATH_I8 " bf16:" GEMV_PATH_BF16 " float:" GEMV_PATH_FLOAT

typedef struct {
    int rows;
    int64_t K, nb;  /* values per row, int16 blocks per row */
    const float *f; /* [rows, K] float32 (the caller's) */
    int16_t *q;     /* [rows, K] int8 weights: value / its block's scale */
    float *qs;      /* [rows, nb] the blocks' scales (powers of two; NaN for a non-finite block) */
    uint16_t *b;    /* [rows, K] bfloat16 weights: the values as bfloat16 */
} Acts;

static inline void acts_free(Acts *a) {
    free(a->q), free(a->qs), free(a->b);
    a->q = NULL, a->qs = NULL, a->b = NULL;
}

/* Prepares xf [rows, K] for row dots against weights of code wt. Returns 0, or -2 without
   memory. */
static inline int acts_prepare(Acts *a, int wt, const float *xf, int rows, int64_t K) {
    a->rows = rows, a->K = K, a->nb = (K + GEMV_BLOCK - 1) / GEMV_BLOCK, a->f = xf;
    a->q = NULL, a->qs = NULL, a->b = NULL;
    const size_t n = (size_t)rows * (size_t)(K > 0 ? K : 1);
    if (wt == W_I8) {
        a->q = malloc(sizeof(int16_t) * n);
        a->qs = malloc(sizeof(float) * (size_t)rows * (size_t)(a->nb > 0 ? a->nb : 1));
        if (!a->q || !a->qs) {
            acts_free(a);
            return -2;
        }
        for (int m = 0; m < rows; m++)
            for (int64_t blk = 0; blk < a->nb; blk++) {
                const int64_t k0 = blk * GEMV_BLOCK;
                const int64_t k1 = k0 + GEMV_BLOCK < K ? k0 + GEMV_BLOCK : K;
                const float *x = xf + (int64_t)m * K;
                int16_t *q = a->q + (int64_t)m * K;
                float mx = 0.f;
                int bad = 0;
                int64_t k = k0;
#if defined(__AVX512F__)
                __m512 vmx = _mm512_setzero_ps();
                __mmask16 vbad = 0;
                for (; k + 16 <= k1; k += 16) {
                    const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + k));
                    vbad |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(3.4e38f), _CMP_NLE_UQ);
                    vmx = _mm512_max_ps(vmx, v);
                }
                mx = _mm512_reduce_max_ps(vmx);
                bad = vbad != 0;
#endif
                for (; k < k1; k++) {
                    const float v = fabsf(x[k]);
                    bad |= !(v <= 3.4e38f); /* inf or NaN */
                    mx = v > mx ? v : mx;
                }
                if (bad) {
                    a->qs[(int64_t)m * a->nb + blk] = NAN;
                    for (int64_t k = k0; k < k1; k++) q[k] = 0;
                    continue;
                }
                int e = 0;
                if (mx > 0.f) frexpf(mx, &e); /* mx < 2^e */
                const float inv = ldexpf(1.f, 15 - e);
                a->qs[(int64_t)m * a->nb + blk] = ldexpf(1.f, e - 15);
                k = k0;
#if defined(__AVX512F__)
                /* rounded to nearest even as nearbyintf does; the pack saturates as the clamp */
                for (; k + 16 <= k1; k += 16) {
                    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k),
                                                                       _mm512_set1_ps(inv)));
                    _mm256_storeu_si256((__m256i *)(q + k), _mm512_cvtsepi32_epi16(r));
                }
#endif
                for (; k < k1; k++) {
                    float v = nearbyintf(x[k] * inv);
                    v = v > 32767.f ? 32767.f : (v < -32767.f ? -32767.f : v);
                    q[k] = (int16_t)v;
                }
            }
    } else if (wt == DT_BF16) {
#if defined(GEMV_BF16) /* elsewhere dots_bf16 reads the float32 rows (bfloat16 values already) */
        a->b = malloc(sizeof(uint16_t) * n);
        if (!a->b) return -2;
        for (size_t i = 0; i < (size_t)rows * (size_t)K; i++) a->b[i] = f32_to_bf16(xf[i]);
#endif
    }
    return 0;
}

#endif
