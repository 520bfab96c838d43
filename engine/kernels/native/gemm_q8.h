/* y = x W^T with 8-bit weights and 7-bit activations (--quantization w8a8): integer products,
   one order for every output whatever the rows, the same bits on every CPU class.

   Blocks of Q8_BLOCK values along K carry a float32 scale each, on both sides, as llama.cpp's
   Q8_0 does: W is quantized once, at load (engine/kernels/gemm_q8.py pack_q8), to integers in
   [-127, 127] with a scale per output row and block; each activation row is quantized per block
   as the GEMM runs, to integers in [-Q8_AMAX, Q8_AMAX] = [-63, 63] with scale amax / 63
   (q8_quant_row: q = rint(x * (63 / amax)), so a row's integers depend on that row alone) and
   held as q + 64, in [1, 127], unsigned. Every output is

       acc = fma((float) isum_b, sa[m][b] * sw[n][b], acc)   for b = 0, 1, ..., KB - 1

   from zero, isum_b the exact integer dot of block b (|isum_b| <= 32 x 63 x 127 < 2^24, exact in
   float32 too), the scales' product rounded to float32 first. Integer sums are exact in any
   order, so every path gives the same bits: AVX2's vpmaddubsw (the unsigned q + 64 times the
   signed weights, pairs summed to int16: at most 2 x 127 x 127 = 32258, below int16's
   saturation, which is why activations get 7 bits: 8-bit ones would need vpsignb per product
   pair, measured 1.3x slower here), AVX512-VNNI's vpdpbusd (64 products an instruction: a
   panel's quad of 16 rows is one zmm register; the float32 chains stay in registers) and plain
   C loops; the offsets come off by adding -64 x each block's weight sum. Where the float32 FMA
   GEMM (gemm.h) does 8 products an instruction on AVX2, vpmaddubsw does 32 (with a vpmaddwd and
   a vpaddd).

   W's layout (pack_q8): panels of GEMM_NR output rows, each KB blocks of Q8_BLOCK_BYTES: the
   block's 8 quads of k, each 16 rows x 4 bytes ([quad][row][4]), then the 16 rows' scales
   (float32), then -64 x each row's sum of the block's weights (int32). */

#ifndef ENGINE_NATIVE_GEMM_Q8_H
#define ENGINE_NATIVE_GEMM_Q8_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "gemm.h"
#include "steal.h"

#define W_Q8 4 /* weight code (beside gemv_acts.h's W_I8): the panels of this header */
#define Q8_BLOCK 32
#define Q8_QUADS (Q8_BLOCK / 4)
#define Q8_WMAX 127
#define Q8_AMAX 63    /* activations in [-63, 63], held as q + 64 in [1, 127] (unsigned) */
#define Q8_OFFSET 64
#define Q8_QBYTES (Q8_BLOCK * GEMM_NR)                  /* a block's weights in one panel */
#define Q8_BLOCK_BYTES (Q8_QBYTES + GEMM_NR * 4 + GEMM_NR * 4) /* + scales + sums */
#define Q8_MR 4 /* rows per tile: 8 int32 sums + 2 weights + a broadcast, ones and a temporary */

#if defined(GEMM_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_PATH "avx512vnni"
#define Q8_VNNI 1
#elif defined(GEMV_AVX2)
#define Q8_PATH "avx2"
#define Q8_AVX2 1
#else
#define Q8_PATH "c"
#endif

static inline int64_t q8_blocks(int64_t K) { return (K + Q8_BLOCK - 1) / Q8_BLOCK; }

/* One row of K values (x's dtype dt) to KB blocks: xq[b * 32 + i] = q + 64 (q = 0 past K), xs[b]
   the block's scale amax / 63 (0 for a block of zeros, whose q are all 0). Finite inputs. */
static void q8_quant_row(int dt, const void *x, int64_t off, int64_t K, uint8_t *xq, float *xs) {
    const int64_t KB = q8_blocks(K);
    for (int64_t b = 0; b < KB; b++) {
        float v[Q8_BLOCK];
        const int64_t k0 = b * Q8_BLOCK;
        const int n = K - k0 < Q8_BLOCK ? (int)(K - k0) : Q8_BLOCK;
        float amax = 0.f;
        for (int i = 0; i < Q8_BLOCK; i++) {
            v[i] = i < n ? load_f32(dt, x, off + k0 + i) : 0.f;
            const float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0.f ? (float)Q8_AMAX / amax : 0.f;
        xs[b] = amax / (float)Q8_AMAX;
        uint8_t *q = xq + b * Q8_BLOCK;
#if defined(Q8_VNNI) || defined(Q8_AVX2)
        const __m256 vi = _mm256_set1_ps(inv);
        const __m256i off = _mm256_set1_epi32(Q8_OFFSET);
        for (int i = 0; i < Q8_BLOCK; i += 8) { /* cvtps rounds to nearest even, as rintf */
            const __m256i r = _mm256_add_epi32(
                _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), vi)), off);
            const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r),
                                               _mm256_extracti128_si256(r, 1));
            _mm_storel_epi64((__m128i *)(q + i), _mm_packus_epi16(w, w));
        }
#else
        for (int i = 0; i < Q8_BLOCK; i++) q[i] = (uint8_t)((int)rintf(v[i] * inv) + Q8_OFFSET);
#endif
    }
}

/* The tile: R (<= Q8_MR) quantized rows (xq ldq bytes apart, their scales xs lds apart) against
   one panel of KB blocks; y's columns [0, cols). R a constant once inlined. */
static inline __attribute__((always_inline)) void q8_tile(const uint8_t *xq, int64_t ldq,
                                                          const float *xs, int64_t lds, int R,
                                                          const char *panel, int64_t KB,
                                                          float *y, int64_t ldy, int cols) {
    float acc[Q8_MR][GEMM_NR];
    memset(acc, 0, sizeof acc);
#if defined(Q8_VNNI) || defined(Q8_AVX2)
#if defined(Q8_AVX2)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int64_t b = 0; b < KB; b++) {
        const char *pb = panel + b * Q8_BLOCK_BYTES;
        __m256i sum[Q8_MR][2];
        for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
        for (int q = 0; q < Q8_QUADS; q++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(pb + q * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(pb + q * 64 + 32));
            for (int r = 0; r < R; r++) {
                int32_t quad;
                memcpy(&quad, xq + r * ldq + b * Q8_BLOCK + q * 4, sizeof quad);
                const __m256i a = _mm256_set1_epi32(quad);
#if defined(Q8_VNNI)
                sum[r][0] = _mm256_dpbusd_epi32(sum[r][0], a, w0);
                sum[r][1] = _mm256_dpbusd_epi32(sum[r][1], a, w1);
#else /* pairs of at most 2 x 127 x 127, below int16's saturation */
                sum[r][0] = _mm256_add_epi32(
                    sum[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a, w0), ones));
                sum[r][1] = _mm256_add_epi32(
                    sum[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a, w1), ones));
#endif
            }
        }
        const __m256 sw0 = _mm256_loadu_ps((const float *)(pb + Q8_QBYTES));
        const __m256 sw1 = _mm256_loadu_ps((const float *)(pb + Q8_QBYTES) + 8);
        /* the offsets added to q come off: -Q8_OFFSET x the block's weight sum, added */
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)(pb + Q8_QBYTES + 64));
        const __m256i c1 = _mm256_loadu_si256((const __m256i *)(pb + Q8_QBYTES + 96));
        for (int r = 0; r < R; r++) {
            const __m256 sa = _mm256_set1_ps(xs[r * lds + b]);
            const __m256 f0 = _mm256_cvtepi32_ps(_mm256_add_epi32(sum[r][0], c0));
            const __m256 f1 = _mm256_cvtepi32_ps(_mm256_add_epi32(sum[r][1], c1));
            _mm256_storeu_ps(acc[r], _mm256_fmadd_ps(f0, _mm256_mul_ps(sa, sw0),
                                                     _mm256_loadu_ps(acc[r])));
            _mm256_storeu_ps(acc[r] + 8, _mm256_fmadd_ps(f1, _mm256_mul_ps(sa, sw1),
                                                         _mm256_loadu_ps(acc[r] + 8)));
        }
    }
#else
    for (int64_t b = 0; b < KB; b++) {
        const char *pb = panel + b * Q8_BLOCK_BYTES;
        const float *sw = (const float *)(pb + Q8_QBYTES);
        const int32_t *cw = (const int32_t *)(pb + Q8_QBYTES + 64);
        for (int r = 0; r < R; r++)
            for (int j = 0; j < GEMM_NR; j++) {
                int32_t s = 0;
                for (int i = 0; i < Q8_BLOCK; i++)
                    s += (int32_t)xq[r * ldq + b * Q8_BLOCK + i] *
                         (int32_t)((const int8_t *)pb)[(i / 4) * 64 + j * 4 + i % 4];
                const float scale = xs[r * lds + b] * sw[j];
                acc[r][j] = fmaf((float)(s + cw[j]), scale, acc[r][j]);
            }
    }
#endif
    for (int r = 0; r < R; r++) { /* a whole panel as a constant size: inlined, not libc's */
        if (cols == GEMM_NR)
            memcpy(y + r * ldy, acc[r], sizeof(float) * GEMM_NR);
        else
            memcpy(y + r * ldy, acc[r], sizeof(float) * (size_t)cols);
    }
}

#if defined(Q8_VNNI)
#define Q8_MR512 4 /* rows per AVX-512 tile: 4 x 2 int32 sums and 4 x 2 float32 chains */

/* The AVX512-VNNI tile: R rows (<= Q8_MR512) against NP (1 or 2) panels, the second pstride
   bytes after the first; a panel's quad of 16 rows is one 64-byte register, so one vpdpbusd
   takes 64 products. The float32 chains stay in registers. R and NP constants once inlined. */
static inline __attribute__((always_inline)) void q8_tile512(const uint8_t *xq, int64_t ldq,
                                                             const float *xs, int64_t lds, int R,
                                                             int NP, const char *panel,
                                                             int64_t pstride, int64_t KB,
                                                             float *y, int64_t ldy, int cols) {
    __m512 acc[Q8_MR512][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < KB; b++) {
        const char *pb = panel + b * Q8_BLOCK_BYTES;
        __m512i sum[Q8_MR512][2]; /* from -64 x the block's weight sums: the offsets come off */
        for (int c = 0; c < NP; c++) {
            const __m512i cw = _mm512_loadu_si512((const void *)(pb + c * pstride + Q8_QBYTES + 64));
            for (int r = 0; r < R; r++) sum[r][c] = cw;
        }
        for (int q = 0; q < Q8_QUADS; q++) {
            __m512i w[2];
            for (int c = 0; c < NP; c++)
                w[c] = _mm512_loadu_si512((const void *)(pb + c * pstride + q * 64));
            for (int r = 0; r < R; r++) {
                int32_t quad;
                memcpy(&quad, xq + r * ldq + b * Q8_BLOCK + q * 4, sizeof quad);
                const __m512i a = _mm512_set1_epi32(quad);
                for (int c = 0; c < NP; c++) sum[r][c] = _mm512_dpbusd_epi32(sum[r][c], a, w[c]);
            }
        }
        for (int c = 0; c < NP; c++) {
            const char *pc = pb + c * pstride + Q8_QBYTES;
            const __m512 sw = _mm512_loadu_ps((const float *)pc);
            for (int r = 0; r < R; r++) {
                const __m512 f = _mm512_cvtepi32_ps(sum[r][c]);
                const __m512 s = _mm512_mul_ps(_mm512_set1_ps(xs[r * lds + b]), sw);
                acc[r][c] = _mm512_fmadd_ps(f, s, acc[r][c]);
            }
        }
    }
    for (int c = 0; c < NP; c++) {
        const int left = cols - c * GEMM_NR;
        const __mmask16 m = left >= GEMM_NR ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy + c * GEMM_NR, m, acc[r][c]);
    }
}

/* Rows [0, M) in tiles of Q8_MR512 (the last smaller) against NP panels. */
static inline __attribute__((always_inline)) void q8_rows512(const uint8_t *xq, int64_t ldq,
                                                             const float *xs, int64_t lds,
                                                             int64_t M, int NP, const char *panel,
                                                             int64_t pstride, int64_t KB,
                                                             float *y, int64_t ldy, int cols) {
    int64_t m = 0;
#define Q8_TILE(R)                                                                             \
    q8_tile512(xq + m * ldq, ldq, xs + m * lds, lds, R, NP, panel, pstride, KB, y + m * ldy,  \
               ldy, cols)
    for (; m + Q8_MR512 <= M; m += Q8_MR512) Q8_TILE(Q8_MR512);
    switch (M - m) {
    case 1: Q8_TILE(1); break;
    case 2: Q8_TILE(2); break;
    case 3: Q8_TILE(3); break;
    default: break;
    }
#undef Q8_TILE
}
#endif

/* Rows [0, M) in tiles of Q8_MR (the last smaller) against one panel. */
static void q8_rows(const uint8_t *xq, int64_t ldq, const float *xs, int64_t lds, int64_t M,
                    const char *panel, int64_t KB, float *y, int64_t ldy, int cols) {
    int64_t m = 0;
    for (; m + Q8_MR <= M; m += Q8_MR)
        q8_tile(xq + m * ldq, ldq, xs + m * lds, lds, Q8_MR, panel, KB, y + m * ldy, ldy, cols);
    switch (M - m) {
    case 1: q8_tile(xq + m * ldq, ldq, xs + m * lds, lds, 1, panel, KB, y + m * ldy, ldy, cols);
        break;
    case 2: q8_tile(xq + m * ldq, ldq, xs + m * lds, lds, 2, panel, KB, y + m * ldy, ldy, cols);
        break;
    case 3: q8_tile(xq + m * ldq, ldq, xs + m * lds, lds, 3, panel, KB, y + m * ldy, ldy, cols);
        break;
    default: break;
    }
}

/* y[m * ldy + n] = the chain above for m < M, n < N: x [M, K] (dtype dt, ldx apart), wp W's
   W8A8 panels. Work items as gemm_packed_rows': GEMM_MC rows against a pair of panels (at a few
   rows, all rows: the weights stream once). Returns 0, or -2 without memory. */
static int gemm_q8(int dt, const void *x, int64_t ldx, int64_t M, int64_t K, const void *wp,
                   int64_t N, float *y, int64_t ldy, int threads) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t KB = q8_blocks(K), ldq = KB * Q8_BLOCK;
    uint8_t *xq = malloc((size_t)(M * ldq) + sizeof(float) * (size_t)(M * KB));
    if (!xq) return -2;
    float *xs = (float *)(xq + M * ldq); /* ldq is a multiple of 32: aligned for floats */
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= 4)
    for (int64_t m = 0; m < M; m++) q8_quant_row(dt, x, m * ldx, K, xq + m * ldq, xs + m * KB);
    const int64_t panels = (N + GEMM_NR - 1) / GEMM_NR, pstride = KB * Q8_BLOCK_BYTES;
    const int64_t pgroups = (panels + GEMM_PANELS_PER_ITEM - 1) / GEMM_PANELS_PER_ITEM;
    const int few = M <= GEMM_FEW_ROWS;
    const int64_t mblocks = few ? 1 : (M + GEMM_MC - 1) / GEMM_MC, mc = few ? M : GEMM_MC;
    STEAL_FOR(item, threads, pgroups * mblocks) {
        const GemmItem it = gemm_item(item, mblocks, mc, M, panels, N);
#if defined(Q8_VNNI)
        const char *p0 = (const char *)wp + it.p0 * pstride;
        float *y0 = y + it.m0 * ldy + it.n0;
        if (it.np == 2)
            q8_rows512(xq + it.m0 * ldq, ldq, xs + it.m0 * KB, KB, it.m1 - it.m0, 2, p0, pstride,
                       KB, y0, ldy, it.cols);
        else
            q8_rows512(xq + it.m0 * ldq, ldq, xs + it.m0 * KB, KB, it.m1 - it.m0, 1, p0, pstride,
                       KB, y0, ldy, it.cols);
#else
        for (int c = 0; c < it.np; c++) {
            const int left = it.cols - c * GEMM_NR, cols = left < GEMM_NR ? left : GEMM_NR;
            q8_rows(xq + it.m0 * ldq, ldq, xs + it.m0 * KB, KB, it.m1 - it.m0,
                    (const char *)wp + (it.p0 + c) * pstride, KB, y + it.m0 * ldy + it.n0 + c * GEMM_NR,
                    ldy, cols);
        }
#endif
    }
    free(xq);
    return 0;
}

#endif
