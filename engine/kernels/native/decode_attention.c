/* Paged decode attention on the CPU: one query token per sequence over its paged KV cache.

   The C counterpart of decode_attention_ref (engine/kernels/decode_attention.py), built at run
   time by engine/kernels/native.py and called through ctypes. The torch reference gathers every
   sequence's blocks into a copy, converts it to float32 and runs batched matmuls: the KV crosses
   memory three or four times, through a dozen ops per layer. Here each K and V row is read once,
   straight from its paged block, converted in registers and consumed.

   Work items are (sequence, chunk of CHUNK tokens): every query head of the sequence over that
   chunk's keys (the chunk's block rows are contiguous across KV heads, so a block is read whole,
   once). A sequence's chunks are merged by log-sum-exp in a fixed order. A sequence's result
   therefore depends only on its own length, never on the batch it runs in or the thread count.

   Numerics: scores, softmax and the weighted sum in float32 (exp by a degree-6 polynomial,
   relative error ~2e-7); the output rounded to the cache's dtype (bfloat16 round-to-nearest-even,
   as torch does). */

#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define CHUNK 256 /* tokens per work item; a multiple of every block size the engine allows */
#define MAX_HEADS 256
#define MAX_DIM 256

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* a . b over n floats. gcc reduces an `omp simd` sum lane by lane through memory, which made
   the per-token dots the kernel's bottleneck; with AVX-512 the lanes are summed as a tree. */
static inline float dot(const float *a, const float *b, int n) {
    int i = 0;
    float s = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One row of n elements of dtype dt to float32. */
static inline void load_row(int dt, const void *src, int64_t off, float *dst, int n) {
    if (dt == DT_BF16) {
        const uint16_t *p = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(p[i]);
    } else if (dt == DT_F16) {
        const _Float16 *p = (const _Float16 *)src + off;
        for (int i = 0; i < n; i++) dst[i] = (float)p[i];
    } else {
        memcpy(dst, (const float *)src + off, sizeof(float) * (size_t)n);
    }
}

static inline void store_row(int dt, void *dst, int64_t off, const float *src, float mul, int n) {
    if (dt == DT_BF16) {
        uint16_t *p = (uint16_t *)dst + off;
        for (int i = 0; i < n; i++) p[i] = f32_to_bf16(src[i] * mul);
    } else if (dt == DT_F16) {
        _Float16 *p = (_Float16 *)dst + off;
        for (int i = 0; i < n; i++) p[i] = (_Float16)(src[i] * mul);
    } else {
        float *p = (float *)dst + off;
        for (int i = 0; i < n; i++) p[i] = src[i] * mul;
    }
}

/* e^x for x <= 0 (scores after the max is subtracted): 2^i * p(f) with p a degree-6 fit of 2^f on
   [0, 1). Branch-free, so the loop around it vectorises. */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float t = x * 1.4426950408889634f;
    const float fi = floorf(t);
    const float f = t - fi;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)((int32_t)fi + 127) << 23;
    return p * v.f;
}

typedef struct {
    int dt, heads, kv_heads, dim, block_size;
    const void *q, *k, *v;
    void *out;
    const int32_t *tables, *lens;
    int64_t sq_b, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_h, s_bt;
    float scale;
} Args;

/* Attention of sequence b's query over tokens [t0, t1): the unnormalised output acc [heads, dim],
   the max m [heads] and the sum of exponentials l [heads]. scores: heads * CHUNK floats. */
static void attend_chunk(const Args *a, int b, int t0, int t1, float *scores, float *acc,
                         float *m, float *l) {
    const int H = a->heads, HK = a->kv_heads, D = a->dim, G = H / HK, bs = a->block_size;
    const int n = t1 - t0;
    const int32_t *table = a->tables + (int64_t)b * a->s_bt;
    float *q = scores + (size_t)H * CHUNK; /* [H, D] scaled query, after the scores */
    float row[MAX_DIM];
    for (int h = 0; h < H; h++) {
        load_row(a->dt, a->q, (int64_t)b * a->sq_b + (int64_t)h * a->sq_h, q + (size_t)h * D, D);
        for (int d = 0; d < D; d++) q[(size_t)h * D + d] *= a->scale;
    }
    for (int t = t0; t < t1; t++) {
        const int64_t blk = table[t / bs];
        const int64_t base = blk * a->sk_b + (int64_t)(t % bs) * a->sk_s;
        if (t % bs == 0 && t + bs < t1) { /* the next block's rows are on their way meanwhile */
            const int64_t nb = (int64_t)table[t / bs + 1] * a->sk_b;
            const char *p = (const char *)a->k;
            const int esz = a->dt == DT_F32 ? 4 : 2;
            for (int r = 0; r < bs; r++)
                for (int h = 0; h < HK; h++)
                    for (int d = 0; d < D * esz; d += 64)
                        __builtin_prefetch(p + (nb + r * a->sk_s + h * a->sk_h) * esz + d);
        }
        for (int kh = 0; kh < HK; kh++) {
            load_row(a->dt, a->k, base + (int64_t)kh * a->sk_h, row, D);
            for (int g = 0; g < G; g++) {
                const int h = kh * G + g;
                scores[(size_t)h * CHUNK + (t - t0)] = dot(q + (size_t)h * D, row, D);
            }
        }
    }
    for (int h = 0; h < H; h++) {
        float *sh = scores + (size_t)h * CHUNK;
        float mx = -INFINITY;
        for (int i = 0; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < n; i++) {
            sh[i] = exp_nonpositive(sh[i] - mx);
            sum += sh[i];
        }
        m[h] = mx;
        l[h] = sum;
        memset(acc + (size_t)h * D, 0, sizeof(float) * (size_t)D);
    }
    for (int t = t0; t < t1; t++) {
        const int64_t blk = table[t / bs];
        const int64_t base = blk * a->sv_b + (int64_t)(t % bs) * a->sv_s;
        if (t % bs == 0 && t + bs < t1) {
            const int64_t nb = (int64_t)table[t / bs + 1] * a->sv_b;
            const char *p = (const char *)a->v;
            const int esz = a->dt == DT_F32 ? 4 : 2;
            for (int r = 0; r < bs; r++)
                for (int h = 0; h < HK; h++)
                    for (int d = 0; d < D * esz; d += 64)
                        __builtin_prefetch(p + (nb + r * a->sv_s + h * a->sv_h) * esz + d);
        }
        for (int kh = 0; kh < HK; kh++) {
            load_row(a->dt, a->v, base + (int64_t)kh * a->sv_h, row, D);
            for (int g = 0; g < G; g++) {
                const int h = kh * G + g;
                const float p = scores[(size_t)h * CHUNK + (t - t0)];
                float *o = acc + (size_t)h * D;
#pragma omp simd
                for (int d = 0; d < D; d++) o[d] += p * row[d];
            }
        }
    }
}

/* Returns 0; -1 for shapes beyond the limits; -2 when scratch memory could not be had; -3 when a
   sequence is longer than its block table row or names a block outside [0, num_blocks) (checked
   before anything is read). Strides are in elements. A sequence of length 0 gets zeros. */
int engine_decode_attention(int dt, const void *q, const void *k_cache, const void *v_cache,
                            void *out, const int32_t *block_tables, const int32_t *seq_lens,
                            int batch, int heads, int kv_heads, int dim, int block_size,
                            int64_t num_blocks, int64_t table_width,
                            int64_t sq_b, int64_t sq_h, int64_t sk_b, int64_t sk_s, int64_t sk_h,
                            int64_t sv_b, int64_t sv_s, int64_t sv_h, int64_t so_b, int64_t so_h,
                            int64_t s_bt, float scale, int num_threads) {
    if (heads > MAX_HEADS || dim > MAX_DIM || kv_heads < 1 || heads % kv_heads ||
        CHUNK % block_size)
        return -1;
    for (int b = 0; b < batch; b++) {
        const int64_t need = seq_lens[b] > 0 ? ((int64_t)seq_lens[b] + block_size - 1) / block_size : 0;
        if (need > table_width) return -3;
        const int32_t *row = block_tables + (int64_t)b * s_bt;
        for (int64_t j = 0; j < need; j++)
            if (row[j] < 0 || row[j] >= num_blocks) return -3;
    }
    const Args a = {dt, heads, kv_heads, dim, block_size, q, k_cache, v_cache, out,
                    block_tables, seq_lens, sq_b, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                    so_b, so_h, s_bt, scale};
    /* Items: every (sequence, chunk). first[b] is sequence b's first item. */
    int64_t *first = malloc(sizeof(int64_t) * ((size_t)batch + 1));
    if (!first) return -2;
    first[0] = 0;
    for (int b = 0; b < batch; b++) {
        const int len = seq_lens[b] > 0 ? seq_lens[b] : 0;
        first[b + 1] = first[b] + (len + CHUNK - 1) / CHUNK;
    }
    const int64_t items = first[batch];
    const size_t part = (size_t)heads * ((size_t)dim + 2); /* acc, m, l of one item */
    float *parts = malloc(sizeof(float) * part * (size_t)(items > 0 ? items : 1));
    int *owner = malloc(sizeof(int) * (size_t)(items > 0 ? items : 1));
    if (!parts || !owner) {
        free(first), free(parts), free(owner);
        return -2;
    }
    for (int b = 0; b < batch; b++)
        for (int64_t i = first[b]; i < first[b + 1]; i++) owner[i] = b;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * (size_t)heads * (CHUNK + (size_t)dim));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!scratch) continue;
            const int b = owner[i];
            const int t0 = (int)(i - first[b]) * CHUNK;
            const int t1 = t0 + CHUNK < seq_lens[b] ? t0 + CHUNK : seq_lens[b];
            float *p = parts + part * (size_t)i;
            attend_chunk(&a, b, t0, t1, scratch, p, p + (size_t)heads * dim,
                         p + (size_t)heads * dim + heads);
        }
        free(scratch);
#pragma omp for schedule(static)
        for (int b = 0; b < batch; b++) {
            const int64_t n = first[b + 1] - first[b];
            for (int h = 0; h < heads; h++) {
                float o[MAX_DIM];
                memset(o, 0, sizeof(float) * (size_t)dim);
                float mx = -INFINITY, total = 0.f;
                for (int64_t i = first[b]; i < first[b + 1]; i++) {
                    const float m = parts[part * (size_t)i + (size_t)heads * dim + h];
                    mx = m > mx ? m : mx;
                }
                for (int64_t i = first[b]; i < first[b + 1]; i++) {
                    const float *p = parts + part * (size_t)i;
                    const float w = n == 1 ? 1.f : expf(p[(size_t)heads * dim + h] - mx);
                    total += w * p[(size_t)heads * dim + heads + h];
                    const float *acc = p + (size_t)h * dim;
#pragma omp simd
                    for (int d = 0; d < dim; d++) o[d] += w * acc[d];
                }
                store_row(dt, out, (int64_t)b * so_b + (int64_t)h * so_h, o,
                          total > 0.f ? 1.f / total : 0.f, dim);
            }
        }
    }
    free(first), free(parts), free(owner);
    return failed ? -2 : 0;
}
