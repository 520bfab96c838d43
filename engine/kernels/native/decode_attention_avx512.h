/* decode_attention.c's AVX-512 path: scores_nv* and values_nv* for head_dim 64 (nv 4) and 128
   (nv 8), 16 keys' dots summed at a time (sum16). */

#ifndef ENGINE_NATIVE_DECODE_ATTENTION_AVX512_H
#define ENGINE_NATIVE_DECODE_ATTENTION_AVX512_H

#include "decode_attention.h"
#include "dtypes.h"

#if defined(__AVX512F__)
/* 16 elements of dtype dt at element offset i of p, as float32. */
static inline __m512 load16(int dt, const void *p, int64_t i) {
    if (dt == DT_I8) /* the row's values; its scale is applied to the dot (or the probability) */
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
    if (dt == DT_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dt == DT_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_loadu_ps((const float *)p + i);
}

/* The 16 horizontal sums of v[0..15] as one vector (r[j] = sum of v[j]'s lanes), in 45 shuffles
   and adds instead of 16 separate reductions. */
static inline __m512 sum16(const __m512 *v) {
    __m512 u[8], x[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a02, b02, a13, b13] */
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: the lane sums of 4 consecutive inputs */
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* head_dim = 16 * nv. Inlined with nv a constant, the query (scores) or the accumulator (values)
   of one head lives in nv registers while the head's keys or values stream past. */
static inline __attribute__((always_inline)) void scores_avx512(
    const Args *a, const int32_t *table, int kh, int t0, int t1, const float *q, float *scores,
    const int nv) {
    const int D = a->dim, G = a->heads / a->kv_heads;
    for (int h = kh * G; h < (kh + 1) * G; h++) {
        __m512 qv[16];
        for (int c = 0; c < nv; c++) qv[c] = _mm512_loadu_ps(q + (size_t)h * D + 16 * c);
        for (int t = t0; t < t1; t += 16) {
            const int n = t1 - t < 16 ? t1 - t : 16;
            __m512 dots[16];
            float sc[16];
            for (int j = 0; j < 16; j++) {
                dots[j] = _mm512_setzero_ps();
                sc[j] = 1.f;
                if (j >= n) continue;
                const int64_t off = row_offset(table, t + j, a->block_size, a->sk_b, a->sk_s,
                                               a->sk_h, kh);
                if (a->kdt == DT_I8) sc[j] = i8_row_scale(a->k, off, D);
                for (int c = 0; c < nv; c++)
                    dots[j] = _mm512_fmadd_ps(qv[c], load16(a->kdt, a->k, off + 16 * c), dots[j]);
            }
            __m512 r = sum16(dots);
            if (a->kdt == DT_I8) r = _mm512_mul_ps(r, _mm512_loadu_ps(sc));
            _mm512_mask_storeu_ps(scores + (size_t)h * CHUNK + (t - t0),
                                  (__mmask16)((1u << n) - 1u), r);
        }
    }
}

static inline __attribute__((always_inline)) void values_avx512(
    const Args *a, const int32_t *table, int kh, int t0, int t1, const float *probs, float *acc,
    const int nv) {
    const int D = a->dim, G = a->heads / a->kv_heads;
    for (int h = kh * G; h < (kh + 1) * G; h++) {
        __m512 o[16];
        for (int c = 0; c < nv; c++) o[c] = _mm512_setzero_ps();
        const float *ph = probs + (size_t)h * CHUNK;
        for (int t = t0; t < t1; t++) {
            const int64_t off = row_offset(table, t, a->block_size, a->sv_b, a->sv_s,
                                           a->sv_h, kh);
            const float pr = ph[t - t0];
            const __m512 p = _mm512_set1_ps(a->kdt == DT_I8 ? pr * i8_row_scale(a->v, off, D) : pr);
            for (int c = 0; c < nv; c++)
                o[c] = _mm512_fmadd_ps(p, load16(a->kdt, a->v, off + 16 * c), o[c]);
        }
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(acc + (size_t)h * D + 16 * c, o[c]);
    }
}

#define SPECIALISE(NV)                                                                           \
    static void scores_nv##NV(const Args *a, const int32_t *table, int kh, int t0, int t1,      \
                              const float *q, float *scores) {                                  \
        scores_avx512(a, table, kh, t0, t1, q, scores, NV);                                     \
    }                                                                                            \
    static void values_nv##NV(const Args *a, const int32_t *table, int kh, int t0, int t1,      \
                              const float *probs, float *acc) {                                 \
        values_avx512(a, table, kh, t0, t1, probs, acc, NV);                                    \
    }
SPECIALISE(4)  /* head_dim 64 */
SPECIALISE(8)  /* head_dim 128 */
#endif
#undef SPECIALISE

#endif
