/* One chunk of paged attention as two fixed-order GEMMs (decode_attention.c's attend_rows): the
   flash-style tile of issue 40, for prefill rows and decode rows alike.

   For one KV head and one 256-token chunk at an absolute position, the M = R x G query rows
   (R query tokens of one sequence, G query heads that share the KV head) go through

     scores  S = Q K^T   the chunk's keys packed in panels of 16 keys ([d][16], float32, widened
                         exactly from the cache), then gemm.h's tiles: each score one chain of
                         FMAs over d = 0 .. D-1 from zero;
     softmax             per row over its own causal count of keys (softmax_chunk), the
                         probabilities of keys past it set to zero;
     values  O = P V     V packed in panels of 16 dims ([key][16]), then gemm.h's tiles: each
                         output one chain over the chunk's keys in token order from zero.

   A row's bits therefore depend only on its query, its causal length and the cache: the chain
   of a score never sees the other rows, and the zero probabilities that a longer row of the same
   call adds to the value chain leave every sum as it was (0 x v + acc = acc exactly: acc is
   never -0, since it starts at +0 and round-to-nearest gives +0 for an exact cancellation).
   gemm.h's AVX-512, AVX2 and plain-C tiles compute the same chains, so the scores and values
   have the same bits on every CPU class.

   int8 caches: the panels hold the int8 values (exact); a key's scale multiplies its scores, a
   value row's scale the probabilities that weight it.

   A bf16 step over a bf16 cache on AVX512-BF16 takes gemm.h's vdpbf16ps chain instead, for
   both products: the scores over pairs of dims (tiles_scores_bf16), P V over pairs of keys with
   the probabilities rounded to bf16 (tiles_values_bf16). The same argument holds for its rows.

   Packing costs one pass over the chunk's K and V per call, shared by all its rows: with many
   rows (a prefill chunk's block) it is a few percent of the arithmetic; a decode row pays it
   alone, as it paid for reading the keys before. */

#ifndef ENGINE_NATIVE_ATTENTION_TILES_H
#define ENGINE_NATIVE_ATTENTION_TILES_H

#include "decode_attention.h"
#include "dtypes.h"
#include "gemm.h"

#define TILE_KEYS GEMM_NR /* keys per K panel, dims per V panel */

static inline int tiles_round16(int n) { return (n + TILE_KEYS - 1) / TILE_KEYS * TILE_KEYS; }

/* Floats of scratch that tiles_chunk needs for R query rows (an int8 cache: also the query
   rows' and weights' scales, the int32 scores and sums and the int16 rows of attention_i8.h). */
static inline size_t tiles_scratch_floats(const Args *a, int R) {
    const size_t M = (size_t)R * (size_t)(a->heads / a->kv_heads), D = (size_t)a->dim;
    const size_t i8 = a->kdt == DT_I8 ? 2 * M + M * CHUNK + M * D + M * CHUNK / 2 : 0;
    return 2 * M * D + M * CHUNK + (size_t)CHUNK * D + (size_t)CHUNK * tiles_round16(a->dim) + i8;
}

/* offs[i]: element offset of token t0 + i's row for KV head kh (i < n). */
static inline void tiles_offsets(const int32_t *table, int bs, int64_t s_b, int64_t s_s,
                                 int64_t s_h, int kh, int t0, int n, int64_t *offs) {
    int blk = t0 / bs, r = t0 % bs;
    for (int i = 0; i < n; i++) {
        offs[i] = (int64_t)table[blk] * s_b + (int64_t)r * s_s + (int64_t)kh * s_h;
        if (++r == bs) r = 0, blk++;
    }
}

/* Row i of the chunk (at offs[i]) as D floats: widened exactly; int8 rows as their values, their
   scale in *sc. */
static inline void tiles_row(int kdt, const void *cache, int64_t off, int D, float *dst,
                             float *sc) {
    if (kdt == DT_I8) {
        const int8_t *p = (const int8_t *)cache + off;
        for (int d = 0; d < D; d++) dst[d] = (float)p[d];
        *sc = i8_row_scale(cache, off, D);
    } else if (kdt == DT_BF16) {
        const uint16_t *p = (const uint16_t *)cache + off;
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(p[d]);
    } else if (kdt == DT_F16) {
        const _Float16 *p = (const _Float16 *)cache + off;
        for (int d = 0; d < D; d++) dst[d] = (float)p[d];
    } else {
        memcpy(dst, (const float *)cache + off, sizeof(float) * (size_t)D);
    }
}

#if defined(GEMV_AVX2)
/* 8 elements of a cache row (its dtype) at element offset off, as float32 (int8: the values). */
static inline __attribute__((always_inline)) __m256 tiles_load8(int kdt, const void *cache,
                                                                int64_t off) {
    if (kdt == DT_I8)
        return _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)cache + off))));
    return widen8_w(kdt, cache, off);
}

/* r[i][j] <- r[j][i]: an 8 x 8 transpose in registers (exact). */
static inline __attribute__((always_inline)) void tiles_transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* tiles_pack_keys for D a multiple of 8: 8 keys x 8 dims at a time, transposed in registers. */
static inline __attribute__((always_inline)) void tiles_pack_keys8(int kdt, const void *cache,
                                                                   const int64_t *offs, int n,
                                                                   int D, float *kp, float *sc) {
    const int n16 = tiles_round16(n);
    for (int j0 = 0; j0 < n16; j0 += 8) {
        float *dst = kp + (size_t)(j0 / TILE_KEYS) * D * TILE_KEYS + j0 % TILE_KEYS;
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = j0 + i < n ? tiles_load8(kdt, cache, offs[j0 + i] + d0) : _mm256_setzero_ps();
            tiles_transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + (size_t)(d0 + i) * TILE_KEYS, r[i]);
        }
        if (kdt == DT_I8)
            for (int j = j0; j < j0 + 8 && j < n; j++) sc[j] = i8_row_scale(cache, offs[j], D);
    }
}

/* tiles_pack_values for D a multiple of 8. */
static inline __attribute__((always_inline)) void tiles_pack_values8(int kdt, const void *cache,
                                                                     const int64_t *offs, int n,
                                                                     int D, float *vp,
                                                                     float *sc) {
    for (int j = 0; j < n; j++) {
        for (int d0 = 0; d0 < D; d0 += 8)
            _mm256_storeu_ps(vp + ((size_t)(d0 / TILE_KEYS) * n + j) * TILE_KEYS + d0 % TILE_KEYS,
                             tiles_load8(kdt, cache, offs[j] + d0));
        if (D % TILE_KEYS)
            _mm256_storeu_ps(vp + ((size_t)(D / TILE_KEYS) * n + j) * TILE_KEYS + 8,
                             _mm256_setzero_ps());
        if (kdt == DT_I8) sc[j] = i8_row_scale(cache, offs[j], D);
    }
}
#endif

/* fn(kdt, ...) with kdt a constant in each case (inlined: one specialised loop per dtype). */
#define TILES_BY_KDT(fn, ...)                                                                   \
    do {                                                                                        \
        switch (kdt) {                                                                          \
        case DT_BF16: fn(DT_BF16, __VA_ARGS__); break;                                          \
        case DT_F16: fn(DT_F16, __VA_ARGS__); break;                                            \
        case DT_I8: fn(DT_I8, __VA_ARGS__); break;                                              \
        default: fn(DT_F32, __VA_ARGS__); break;                                                \
        }                                                                                       \
    } while (0)

/* K panels: kp[p][d][j] = K[16p + j][d] for the n keys, zero past n to the panel's end. */
static inline void tiles_pack_keys(int kdt, const void *cache, const int64_t *offs, int n, int D,
                                   float *kp, float *sc) {
#if defined(GEMV_AVX2)
    if (D % 8 == 0) {
        TILES_BY_KDT(tiles_pack_keys8, cache, offs, n, D, kp, sc);
        return;
    }
#endif
    float row[MAX_DIM];
    const int n16 = tiles_round16(n);
    for (int j = 0; j < n16; j++) {
        float *dst = kp + (size_t)(j / TILE_KEYS) * D * TILE_KEYS + j % TILE_KEYS;
        if (j >= n) {
            for (int d = 0; d < D; d++) dst[(size_t)d * TILE_KEYS] = 0.f;
            continue;
        }
        tiles_row(kdt, cache, offs[j], D, row, sc + j);
        for (int d = 0; d < D; d++) dst[(size_t)d * TILE_KEYS] = row[d];
    }
}

/* V panels: vp[c][j][e] = V[j][16c + e] for the n keys, zero past D to the panel's end. */
static inline void tiles_pack_values(int kdt, const void *cache, const int64_t *offs, int n,
                                     int D, float *vp, float *sc) {
#if defined(GEMV_AVX2)
    if (D % 8 == 0) {
        TILES_BY_KDT(tiles_pack_values8, cache, offs, n, D, vp, sc);
        return;
    }
#endif
    float row[MAX_DIM + TILE_KEYS];
    const int D16 = tiles_round16(D);
    for (int j = 0; j < n; j++) {
        tiles_row(kdt, cache, offs[j], D, row, sc + j);
        for (int d = D; d < D16; d++) row[d] = 0.f;
        for (int c = 0; c < D16 / TILE_KEYS; c++)
            memcpy(vp + ((size_t)c * n + j) * TILE_KEYS, row + c * TILE_KEYS,
                   sizeof(float) * TILE_KEYS);
    }
}

/* y [M, cols] (row stride ldy) = x [M, K] (row stride ldx) against `panels` panels of K x 16
   floats, pstride floats apart: gemm.h's tiles, two panels at a time, on this thread. */
static inline void tiles_gemm(const float *x, int64_t ldx, int M, const float *p, int64_t pstride,
                              int panels, int64_t K, float *y, int64_t ldy, int cols) {
    for (int c = 0; c < panels; c += 2) {
        const int np = panels - c < 2 ? panels - c : 2;
        const int left = cols - c * TILE_KEYS;
        gemm_rows_wt(DT_F32, x, ldx, M, (const char *)(p + (size_t)c * pstride),
                     pstride * (int64_t)sizeof(float), np, K, y + c * TILE_KEYS, ldy,
                     left < np * TILE_KEYS ? left : np * TILE_KEYS, 0);
    }
}

#if defined(GEMM_BF16DOT)
/* A step in bf16 over a bf16 cache on AVX512-BF16: the scores as gemm.h's vdpbf16ps chain
   (pairs of dims), the query unscaled (its bf16 values) and each score times the scale after:
   one order for every row, prefill or decode. K panels of pairs: kq[p][i][j] = dims (2i, 2i+1)
   of key 16p + j as they lie in the cache (32-bit words, transposed 8 x 8 in registers). */
static inline int tiles_bf16_scores(const Args *a) {
    return a->dt == DT_BF16 && a->kdt == DT_BF16 && a->dim % 16 == 0;
}

static inline void tiles_scores_bf16(const Args *a, const int *rows, int R, int kh,
                                     const int64_t *offs, int n, uint16_t *qb, uint32_t *kq,
                                     float *s) {
    const int D = a->dim, G = a->heads / a->kv_heads, M = R * G, W = D / 2;
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const int64_t off = (int64_t)rows[r] * a->sq_b + (int64_t)(kh * G + g) * a->sq_h;
            memcpy(qb + (size_t)(r * G + g) * D, (const uint16_t *)a->q + off,
                   sizeof(uint16_t) * (size_t)D);
        }
    const int n16 = tiles_round16(n);
    for (int j0 = 0; j0 < n16; j0 += 8) {
        uint32_t *dst = kq + (size_t)(j0 / TILE_KEYS) * W * TILE_KEYS + j0 % TILE_KEYS;
        for (int w0 = 0; w0 < W; w0 += 8) {
            __m256 r8[8];
            for (int i = 0; i < 8; i++)
                r8[i] = j0 + i < n ? _mm256_loadu_ps((const float *)((const uint16_t *)a->k +
                                                                     offs[j0 + i] + 2 * w0))
                                   : _mm256_setzero_ps();
            tiles_transpose8(r8); /* 32-bit words moved as they are: exact */
            for (int i = 0; i < 8; i++)
                _mm256_storeu_ps((float *)(dst + (size_t)(w0 + i) * TILE_KEYS), r8[i]);
        }
    }
    const int64_t pstride = (int64_t)W * TILE_KEYS * 4; /* bytes per pair panel */
    const int panels = n16 / TILE_KEYS;
    for (int c = 0; c < panels; c += 2) {
        const int np = panels - c < 2 ? panels - c : 2, left = n - c * TILE_KEYS;
        const int cols = left < np * TILE_KEYS ? left : np * TILE_KEYS;
        const char *pp = (const char *)kq + (size_t)c * pstride;
        if (np == 2)
            gemm_rows_bf16(qb, D, M, 2, pp, pstride, W, s + c * TILE_KEYS, CHUNK, cols, 0);
        else
            gemm_rows_bf16(qb, D, M, 1, pp, pstride, W, s + c * TILE_KEYS, CHUNK, cols, 0);
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < n; j++) s[(size_t)m * CHUNK + j] *= a->scale;
}

/* The same step's P V as the vdpbf16ps chain over pairs of keys (2i, 2i+1) from the chunk's
   start: each probability rounded to bf16 (round to nearest even; in place, row m's bf16 values
   in the first half of its score row), V in pair panels vq[c][i][e] = (V[2i][16c + e],
   V[2i + 1][16c + e]) as they lie in the cache (exact), a zero key past an odd n. A probability
   of 0 (a key past the row's causal count) adds exactly nothing, so a row's bits stay its own.
   The rounding moves each weight by at most 2^-9 of itself, as llama.cpp's flash attention
   rounds its to float16; the normaliser l stays the float32 sum. */
static inline void tiles_values_bf16(const Args *a, int M, const int64_t *offs, int n, float *s,
                                     uint32_t *vq, float *o) {
    const int D = a->dim, n2 = (n + 1) / 2, panels = D / TILE_KEYS;
    const uint16_t *v = (const uint16_t *)a->v;
    for (int i = 0; i < n2; i++) {
        const uint16_t *r0 = v + offs[2 * i], *r1 = 2 * i + 1 < n ? v + offs[2 * i + 1] : NULL;
        for (int c = 0; c < panels; c++) {
            const __m512i lo = _mm512_cvtepu16_epi32(
                _mm256_loadu_si256((const __m256i *)(r0 + c * TILE_KEYS)));
            const __m512i hi = r1 ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                          (const __m256i *)(r1 + c * TILE_KEYS))),
                                                      16)
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(vq + ((size_t)c * n2 + i) * TILE_KEYS),
                                _mm512_or_si512(lo, hi));
        }
    }
    for (int m = 0; m < M; m++) { /* forwards: each store lands where the loads have been */
        float *sr = s + (size_t)m * CHUNK;
        uint16_t *pb = (uint16_t *)sr;
        if (n & 1) sr[n] = 0.f;
        for (int j = 0; j < 2 * n2; j += TILE_KEYS) {
            const int left = 2 * n2 - j;
            const __mmask16 k = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, sr + j));
            _mm256_mask_storeu_epi16((void *)(pb + j), k, (__m256i)h);
        }
    }
    const int64_t pstride = (int64_t)n2 * TILE_KEYS * 4; /* bytes per pair panel */
    for (int c = 0; c < panels; c += 2) {
        const int np = panels - c < 2 ? panels - c : 2;
        const char *pp = (const char *)vq + (size_t)c * pstride;
        if (np == 2)
            gemm_rows_bf16((const uint16_t *)s, 2 * CHUNK, M, 2, pp, pstride, n2,
                           o + c * TILE_KEYS, D, 2 * TILE_KEYS, 0);
        else
            gemm_rows_bf16((const uint16_t *)s, 2 * CHUNK, M, 1, pp, pstride, n2,
                           o + c * TILE_KEYS, D, TILE_KEYS, 0);
    }
}
#endif

/* An int8 cache's chunk in exact integer arithmetic (uses the helpers above). */
#include "attention_i8.h"

/* Query rows rows[0..R) of one sequence (block table row `table`), the G query heads of KV head
   kh, over the chunk at t0: row r over its first ns[r] keys. Row r's part (acc [heads, dim],
   m [heads], l [heads]) for those heads at parts + r * part. scratch: tiles_scratch_floats. */
static inline void tiles_chunk(const Args *a, const int32_t *table, const int *rows,
                               const int *ns, int R, int kh, int t0, float *scratch,
                               float *parts, size_t part) {
    const int H = a->heads, D = a->dim, G = H / a->kv_heads, M = R * G;
    const int D16 = tiles_round16(D);
    int n = 0;
    for (int r = 0; r < R; r++) n = ns[r] > n ? ns[r] : n;
    if (n == 0) return;
    if (i8a_applies(a)) {
        tiles_chunk_i8(a, table, rows, ns, R, kh, t0, n, scratch, parts, part);
        return;
    }
    float *q = scratch, *s = q + (size_t)M * D, *kp = s + (size_t)M * CHUNK;
    float *vp = kp + (size_t)CHUNK * D, *o = vp + (size_t)CHUNK * D16;
    int64_t offs[CHUNK];
    float ksc[CHUNK], vsc[CHUNK];
    const int q8 = a->kdt == DT_I8;
    tiles_offsets(table, a->block_size, a->sk_b, a->sk_s, a->sk_h, kh, t0, n, offs);
#if defined(GEMM_BF16DOT)
    const int bf16 = tiles_bf16_scores(a);
    if (bf16) /* q's bf16 values in q's place, the pair panels in kp's (each half the size) */
        tiles_scores_bf16(a, rows, R, kh, offs, n, (uint16_t *)q, (uint32_t *)kp, s);
#else
    const int bf16 = 0;
#endif
    if (!bf16) {
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) {
                float *qh = q + (size_t)(r * G + g) * D;
                const int64_t off = (int64_t)rows[r] * a->sq_b + (int64_t)(kh * G + g) * a->sq_h;
                for (int d = 0; d < D; d++) qh[d] = load_f32(a->dt, a->q, off + d) * a->scale;
            }
        tiles_pack_keys(a->kdt, a->k, offs, n, D, kp, ksc);
        tiles_gemm(q, D, M, kp, (int64_t)D * TILE_KEYS, tiles_round16(n) / TILE_KEYS, D, s, CHUNK,
                   n);
    }
    tiles_offsets(table, a->block_size, a->sv_b, a->sv_s, a->sv_h, kh, t0, n, offs);
    if (!bf16) tiles_pack_values(a->kdt, a->v, offs, n, D, vp, vsc);
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            float *sr = s + (size_t)(r * G + g) * CHUNK, *pr = parts + part * (size_t)r;
            const int h = kh * G + g;
            if (q8)
                for (int j = 0; j < ns[r]; j++) sr[j] *= ksc[j];
            softmax_chunk(sr, ns[r], pr + (size_t)H * D + h, pr + (size_t)H * D + H + h);
            if (q8)
                for (int j = 0; j < ns[r]; j++) sr[j] *= vsc[j];
            for (int j = ns[r]; j < n; j++) sr[j] = 0.f;
        }
#if defined(GEMM_BF16DOT)
    if (bf16)
        tiles_values_bf16(a, M, offs, n, s, (uint32_t *)vp, o);
    else
#endif
        tiles_gemm(s, CHUNK, M, vp, (int64_t)n * TILE_KEYS, D16 / TILE_KEYS, n, o, D, D);
    for (int r = 0; r < R; r++)
        memcpy(parts + part * (size_t)r + (size_t)kh * G * D, o + (size_t)r * G * D,
               sizeof(float) * (size_t)G * D);
}

#endif
