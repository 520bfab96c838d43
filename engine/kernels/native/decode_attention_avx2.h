/* decode_attention.c's AVX2 path (AVX2 with FMA and F16C, ATTN_AVX2): scores_nv* and values_nv*
   for head_dim 64 (nv 8) and 128 (nv 16), 8 keys' dots summed at a time (sum8); the query heads
   that share a KV head taken together (grouped). */

#ifndef ENGINE_NATIVE_DECODE_ATTENTION_AVX2_H
#define ENGINE_NATIVE_DECODE_ATTENTION_AVX2_H

#include "decode_attention.h"
#include "dtypes.h"

#if defined(ATTN_AVX2)
/* The same loops in 8-lane registers (AVX2 with FMA; bf16 widened by a 16-bit shift, fp16 by
   F16C). 8 elements of dtype dt at element offset i of p, as float32. */
static inline __m256 load8(int dt, const void *p, int64_t i) {
    if (dt == DT_I8) /* the row's values; its scale is applied to the dot (or the probability) */
        return _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i))));
    if (dt == DT_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dt == DT_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

/* The 8 horizontal sums of v[0..7] as one vector (r[j] = sum of v[j]'s lanes). */
static inline __m256 sum8(const __m256 *v) {
    __m256 u[4], x[2];
    for (int i = 0; i < 4; i++) /* per 128-bit lane: [a02, b02, a13, b13] */
        u[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) /* per 128-bit lane: the lane sums of 4 consecutive inputs */
        x[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20),
                         _mm256_permute2f128_ps(x[0], x[1], 0x31));
}

/* The element offsets of tokens [t0, t1) of KV head kh (strides s_b, s_s, s_h), counted along
   the block table without a division per token, padded to a multiple of 8 with the last. */
static inline int chunk_offsets(const int32_t *table, int bs, int64_t s_b, int64_t s_s,
                                int64_t s_h, int kh, int t0, int t1, int64_t *offs) {
    int blk = t0 / bs, r = t0 % bs, n = t1 - t0;
    for (int i = 0; i < n; i++) {
        offs[i] = (int64_t)table[blk] * s_b + (int64_t)r * s_s + (int64_t)kh * s_h;
        if (++r == bs) r = 0, blk++;
    }
    for (int i = n; i % 8; i++) offs[i] = offs[n - 1];
    return n;
}

/* For an int8 cache (kdt DT_I8): the scales of the rows at offs[0 .. n rounded up to 8) into
   sc, and 1; else 0 (nothing to scale). */
static inline int chunk_scales(const Args *a, const void *cache, const int64_t *offs, int n,
                               float *sc) {
    if (a->kdt != DT_I8) return 0;
    for (int i = 0; i < (n + 7) / 8 * 8; i++) sc[i] = i8_row_scale(cache, offs[i], a->dim);
    return 1;
}

/* head_dim = 8 * nv. The kernels below work on keys [i0, i1) of a chunk whose rows' offsets
   (offs, counted once per KV head for all the rows that read the chunk) and int8 scales (sc,
   when q8) are at hand. Scores of one head: 8 keys at a time, their 8 dots in registers, the
   query's 8-column pieces loaded once for the 8 keys (a padded group repeats the last key; its
   scores land past the row's length, where nothing reads them). Values of one head: up to 64
   columns of its accumulator in registers per pass over the keys; the accumulator starts at
   zero (first) or from acc, so a row's value sums run in token order whatever the key ranges
   they are cut into: the same bits. */
static inline __attribute__((always_inline)) void scores_one(
    const Args *a, const int64_t *offs, const float *sc, int q8, const float *qh, float *sh,
    int i0, int i1, const int nv) {
    for (int i = i0; i < i1; i += 8) {
        __m256 dots[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) dots[j] = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int c = 0; c < nv; c++) {
            const __m256 qc = _mm256_loadu_ps(qh + 8 * c);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                dots[j] = _mm256_fmadd_ps(qc, load8(a->kdt, a->k, offs[i + j] + 8 * c), dots[j]);
        }
        __m256 r = sum8(dots);
        if (q8) r = _mm256_mul_ps(r, _mm256_loadu_ps(sc + i));
        _mm256_storeu_ps(sh + i, r);
    }
}

static inline __attribute__((always_inline)) void values_one(
    const Args *a, const int64_t *offs, const float *sc, int q8, const float *ph, float *oh,
    int i0, int i1, int first, const int nv) {
    for (int c0 = 0; c0 < nv; c0 += 8) {
        const int m = nv - c0 < 8 ? nv - c0 : 8;
        __m256 o[8];
#pragma GCC unroll 8
        for (int c = 0; c < m; c++)
            o[c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(oh + 8 * (c0 + c));
        for (int i = i0; i < i1; i++) {
            const __m256 p = _mm256_set1_ps(q8 ? ph[i] * sc[i] : ph[i]);
#pragma GCC unroll 8
            for (int c = 0; c < m; c++)
                o[c] = _mm256_fmadd_ps(p, load8(a->kdt, a->v, offs[i] + 8 * (c0 + c)), o[c]);
        }
#pragma GCC unroll 8
        for (int c = 0; c < m; c++) _mm256_storeu_ps(oh + 8 * (c0 + c), o[c]);
    }
}

/* Query heads that share a KV head (grouped-query attention: 3 per KV head in the default
   model), up to 3 at a time (HS, from h0), so that each K and V row is loaded once for all of
   them instead of once per head. Scores: 4 keys x HS heads in 4 * HS accumulators, the HS query
   pieces and one key piece in registers; values: 4 columns x HS heads. Every sum is formed in
   the same order as in scores_one and values_one (one accumulator over the head's columns per
   key, reduced by sum8's tree, which is the same for each of its inputs; the value sums in token
   order), so the bits are theirs. q, scores and acc: the row's (heads x dim, x CHUNK, x dim). */
static inline __attribute__((always_inline)) void scores_grouped(
    const Args *a, const int64_t *offs, const float *sc, int q8, const float *q, float *scores,
    int i0, int i1, const int nv, const int HS, int h0) {
    const int D = a->dim;
    for (int i = i0; i < i1; i += 4) {
        __m256 dots[12];
        for (int j = 0; j < 12; j++) dots[j] = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int c = 0; c < nv; c++) {
            __m256 qc[3];
            for (int g = 0; g < HS; g++) qc[g] = _mm256_loadu_ps(q + (size_t)(h0 + g) * D + 8 * c);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m256 kv = load8(a->kdt, a->k, offs[i + j] + 8 * c);
                for (int g = 0; g < HS; g++)
                    dots[4 * g + j] = _mm256_fmadd_ps(qc[g], kv, dots[4 * g + j]);
            }
        }
        float r[16];
        _mm256_storeu_ps(r, sum8(dots));
        if (HS == 3) {
            __m256 rest[8];
            for (int j = 0; j < 4; j++) rest[j] = dots[8 + j], rest[4 + j] = _mm256_setzero_ps();
            _mm256_storeu_ps(r + 8, sum8(rest));
        }
        for (int g = 0; g < HS; g++)
            for (int j = 0; j < 4; j++)
                scores[(size_t)(h0 + g) * CHUNK + i + j] =
                    q8 ? r[4 * g + j] * sc[i + j] : r[4 * g + j];
    }
}

static inline __attribute__((always_inline)) void values_grouped(
    const Args *a, const int64_t *offs, const float *sc, int q8, const float *probs, float *acc,
    int i0, int i1, int first, const int nv, const int HS, int h0) {
    const int D = a->dim;
    for (int c0 = 0; c0 < nv; c0 += 4) {
        const int m = nv - c0 < 4 ? nv - c0 : 4;
        __m256 o[3][4];
        for (int g = 0; g < HS; g++)
            for (int c = 0; c < m; c++)
                o[g][c] = first ? _mm256_setzero_ps()
                                : _mm256_loadu_ps(acc + (size_t)(h0 + g) * D + 8 * (c0 + c));
        for (int i = i0; i < i1; i++) {
            __m256 p[3];
            for (int g = 0; g < HS; g++) {
                const float pr = probs[(size_t)(h0 + g) * CHUNK + i];
                p[g] = _mm256_set1_ps(q8 ? pr * sc[i] : pr);
            }
#pragma GCC unroll 4
            for (int c = 0; c < m; c++) {
                const __m256 v = load8(a->kdt, a->v, offs[i] + 8 * (c0 + c));
                for (int g = 0; g < HS; g++) o[g][c] = _mm256_fmadd_ps(p[g], v, o[g][c]);
            }
        }
        for (int g = 0; g < HS; g++)
            for (int c = 0; c < m; c++)
                _mm256_storeu_ps(acc + (size_t)(h0 + g) * D + 8 * (c0 + c), o[g][c]);
    }
}

/* FN(..., HS, h) over the query heads of KV head kh in sets of 3, then a set of 2 or 1 (HS a
   constant in each call, so each set's loops unroll). */
#define FOR_HEAD_SETS(FN, ...)                                                                   \
    for (int h = kh * G; h < (kh + 1) * G;) {                                                    \
        const int hs = (kh + 1) * G - h;                                                         \
        if (hs >= 3)                                                                             \
            FN(__VA_ARGS__, 3, h), h += 3;                                                       \
        else if (hs == 2)                                                                        \
            FN(__VA_ARGS__, 2, h), h += 2;                                                       \
        else                                                                                     \
            FN(__VA_ARGS__, 1, h), h += 1;                                                       \
    }

/* Keys per tile of rows_avx2: a tile's K (or V) rows, about 16 KB of the cache's dtype, stay in
   the core's L1 while every row of the group goes over them (64 keys in float32 at head_dim 64,
   128 in bf16; measured: 32 to 128 keys within 10% of each other). A multiple of 8 from 32 to a
   chunk; it changes no bit. */
static inline int key_tile(const Args *a) {
    const int elem = a->kdt == DT_F32 ? 4 : (a->kdt == DT_I8 ? 1 : 2);
    const int kt = (16 * 1024) / (a->dim * elem);
    return (kt < 32 ? 32 : (kt > CHUNK ? CHUNK : kt)) & ~7;
}

/* KV head kh of R query rows of one sequence (its block table row `table`) over the chunk at
   t0: row r reads ns[r] keys, its scaled query at q + r * rs (heads x dim), its scores at
   scores + r * ss (heads x CHUNK), its part at parts + r * ps (acc heads x dim, then m and l,
   heads each). The chunk's offsets and scales are counted once for all the rows, and the keys
   are taken a tile at a time for every row, so each K and V row comes from L1 for all the rows
   and heads that read it. A row's bits are those it gets alone (R = 1): every sum is formed by
   the kernels above in the same order, whatever the tiles and the rows beside it. */
static inline __attribute__((always_inline)) void rows_avx2(
    const Args *a, const int32_t *table, int kh, int t0, const int *ns, int R, const float *q,
    size_t rs, float *scores, size_t ss, float *parts, size_t ps, const int nv) {
    const int G = a->heads / a->kv_heads, H = a->heads, D = a->dim;
    int n = 0;
    for (int r = 0; r < R; r++) n = ns[r] > n ? ns[r] : n;
    int64_t koffs[CHUNK], voffs[CHUNK];
    float ksc[CHUNK], vsc[CHUNK];
    chunk_offsets(table, a->block_size, a->sk_b, a->sk_s, a->sk_h, kh, t0, t0 + n, koffs);
    chunk_offsets(table, a->block_size, a->sv_b, a->sv_s, a->sv_h, kh, t0, t0 + n, voffs);
    const int q8 = chunk_scales(a, a->k, koffs, n, ksc);
    chunk_scales(a, a->v, voffs, n, vsc);
    const int kt = key_tile(a);
    for (int i0 = 0; i0 < n; i0 += kt)
        for (int r = 0; r < R; r++) {
            if (i0 >= ns[r]) continue;
            const int i1 = i0 + kt < ns[r] ? i0 + kt : ns[r];
            const float *qr = q + rs * (size_t)r;
            float *sr = scores + ss * (size_t)r;
            if (G == 1) {
                for (int h = kh; h < kh + 1; h++)
                    scores_one(a, koffs, ksc, q8, qr + (size_t)h * D, sr + (size_t)h * CHUNK, i0,
                               i1, nv);
            } else {
                FOR_HEAD_SETS(scores_grouped, a, koffs, ksc, q8, qr, sr, i0, i1, nv)
            }
        }
    for (int r = 0; r < R; r++) {
        float *sr = scores + ss * (size_t)r, *pr = parts + ps * (size_t)r;
        for (int h = kh * G; h < (kh + 1) * G; h++)
            softmax_chunk(sr + (size_t)h * CHUNK, ns[r], pr + (size_t)H * D + h,
                          pr + (size_t)H * D + H + h);
    }
    for (int i0 = 0; i0 < n; i0 += kt)
        for (int r = 0; r < R; r++) {
            if (i0 >= ns[r]) continue;
            const int i1 = i0 + kt < ns[r] ? i0 + kt : ns[r];
            const float *sr = scores + ss * (size_t)r;
            float *acc = parts + ps * (size_t)r;
            if (G == 1) {
                for (int h = kh; h < kh + 1; h++)
                    values_one(a, voffs, vsc, q8, sr + (size_t)h * CHUNK, acc + (size_t)h * D, i0,
                               i1, i0 == 0, nv);
            } else {
                FOR_HEAD_SETS(values_grouped, a, voffs, vsc, q8, sr, acc, i0, i1, i0 == 0, nv)
            }
        }
}

#define SPECIALISE(NV)                                                                           \
    static void rows_nv##NV(const Args *a, const int32_t *table, int kh, int t0, const int *ns, \
                            int R, const float *q, size_t rs, float *scores, size_t ss,         \
                            float *parts, size_t ps) {                                          \
        rows_avx2(a, table, kh, t0, ns, R, q, rs, scores, ss, parts, ps, NV);                    \
    }
SPECIALISE(8)  /* head_dim 64 */
SPECIALISE(16) /* head_dim 128 */
#endif
#undef SPECIALISE

#endif
