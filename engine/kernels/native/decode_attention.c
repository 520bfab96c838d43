/* Paged decode attention on the CPU: one query token per sequence over its paged KV cache.

   The C counterpart of decode_attention_ref (engine/kernels/decode_attention.py), built at run
   time by engine/kernels/native/__init__.py and called through ctypes: each K and V row read
   straight from its paged block, in the cache's dtype.

   Every query row (a decode token, or a token of a prefill chunk with its own causal length)
   is attended in chunks of CHUNK tokens at absolute positions (tokens [0, 256), [256, 512), ...
   of its sequence), each chunk's part (unnormalised output, max, sum of exponentials) merged
   into the row's state in chunk order by the online softmax's rule (merge_part). A chunk is
   two fixed-order GEMMs around a softmax (attention_tiles.h: the chunk's K and V packed once in
   panels for all the rows and query heads of a KV head, then gemm.h's tiles). Work items: with
   few rows, (run, chunk) or (run, chunk, KV head), a run being one sequence's rows, the parts
   merged afterwards (flash-decoding: a long context is split across the team); with many rows,
   blocks of rows that go over each chunk in turn (a prefill chunk).
   Both give the same bits: a row's result depends only on its query, its length and its
   cache, never on the rows beside it, the thread count, or whether it is a prefill or a decode
   row. The tile boundaries being absolute positions is what makes a chunked prefill and a
   decode of the same token agree (issue 41, deterministic by default). gemm.h's tiles compute
   one chain per output on every class, so the AVX-512, AVX2 and plain builds agree on the
   scores and weighted sums; the softmax is the AVX2 code on both vector classes (the plain
   build's differs in its sum's order).

   Numerics: scores, softmax and the weighted sum in float32 (exp by a degree-6 polynomial,
   relative error ~2e-7); the output rounded to the cache's dtype (bfloat16 round-to-nearest-even,
   as torch does). */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "decode_attention.h"
#include "dtypes.h"
#include "exp_poly.h"

/* The vector path compiled in here: "avx512", "avx2" (AVX2 with FMA and F16C) or "c" (plain
   loops). */
const char *engine_decode_attention_path(void) { return ATTN_PATH; }

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

/* A chunk's softmax numerators in place over its n scores s: s[i] = e^(s[i] - max), with the
   max in *m and the numerators' sum in *l. A row's bits depend only on its own n scores. */
static inline void softmax_chunk(float *s, int n, float *m, float *l) {
    float mx = -INFINITY, sum = 0.f;
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + i));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmx);
    for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
#endif
    for (; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
#if defined(__AVX512F__)
    /* 16 exponentials at a time, their sums in the 8-lane order below (the same bits) */
    const __m512 vm16 = _mm512_set1_ps(mx);
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm16));
        _mm512_storeu_ps(s + i, e);
        vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
        vsum = _mm256_add_ps(vsum, _mm512_extractf32x8_ps(e, 1));
    }
#endif
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
        _mm256_storeu_ps(s + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_storeu_ps(lanes, vsum);
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
    for (; i < n; i++) {
        s[i] = exp_nonpositive(s[i] - mx);
        sum += s[i];
    }
    *m = mx, *l = sum;
}

/* A thread's scratch of at least n floats, kept for its later calls (it grows to the largest
   call's; freed when the thread ends): a fresh malloc of this size is fresh pages, which the
   kernel clears as they are first written (3% of a native 8k prefill, every call of every
   layer). NULL without memory. Each OpenMP thread has its own, so the team needs no lock. */
typedef struct {
    float *buf;
    size_t cap;
} Scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p) {
    Scratch *s = p;
    free(s->buf);
    free(s);
}

static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

static float *thread_scratch(size_t n) {
    pthread_once(&scratch_once, scratch_init);
    Scratch *s = pthread_getspecific(scratch_key);
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s || pthread_setspecific(scratch_key, s)) {
            free(s);
            return NULL;
        }
    }
    if (n > s->cap) {
        float *grown = malloc(sizeof(float) * n);
        if (!grown) return NULL;
        free(s->buf);
        s->buf = grown, s->cap = n;
    }
    return s->buf;
}

/* The chunk as two fixed-order GEMMs around the softmax. */
#include "attention_tiles.h"


/* Attention of query rows rows[0..R) of one sequence (they share its block table row) for the
   query heads of KV heads [kh0, kh1) over the chunk at t0 (absolute positions), row r over its
   first ns[r] tokens (its causal length within the chunk): row r's part, its unnormalised
   output acc [heads, dim], max m [heads] and sum of exponentials l [heads], at parts + r * part
   (part = heads * (dim + 2)). scratch: tiles_scratch_floats(a, R). One compiled copy
   (noinline) serves every caller, and a row's bits never depend on who asks for it or on the
   rows beside it (attention_tiles.h). */
static __attribute__((noinline)) void attend_rows(const Args *a, const int *rows, const int *ns,
                                                  int R, int kh0, int kh1, int t0,
                                                  float *scratch, float *parts) {
    const size_t part = (size_t)a->heads * ((size_t)a->dim + 2);
    const int32_t *table = row_table(a, rows[0]);
    for (int kh = kh0; kh < kh1; kh++)
        tiles_chunk(a, table, rows, ns, R, kh, t0, scratch, parts, part);
}

/* Folds a chunk's part (acc, m, l of attend_rows) for heads [h0, h1) into a row's running
   state (o [heads, dim], mx, total), chunks in order from the first (first: the state is the
   part). The online softmax's merge, one compiled copy for every caller (noinline): decode's
   parts merged after the fact and a prefill row's merged as they come give the same bits. */
static __attribute__((noinline)) void merge_part(int h0, int h1, int D, const float *acc,
                                                 const float *m, const float *l, float *o,
                                                 float *mx, float *total, int first) {
    for (int h = h0; h < h1; h++) {
        const float *src = acc + (size_t)h * D;
        float *dst = o + (size_t)h * D;
        if (first) {
            mx[h] = m[h], total[h] = l[h];
            memcpy(dst, src, sizeof(float) * (size_t)D);
            continue;
        }
        const float top = m[h] > mx[h] ? m[h] : mx[h];
        const float keep = expf(mx[h] - top), take = expf(m[h] - top);
        mx[h] = top;
        total[h] = total[h] * keep + l[h] * take;
        for (int d = 0; d < D; d++) dst[d] = dst[d] * keep + src[d] * take;
    }
}

/* Row b's output from its merged state: o / total in the cache's dtype (zeros for an empty row). */
static void finish_row(const Args *a, int b, int h0, int h1, const float *o, const float *total) {
    for (int h = h0; h < h1; h++)
        store_row(a->dt, a->out, (int64_t)b * a->so_b + (int64_t)h * a->so_h,
                  o + (size_t)h * a->dim, total[h] > 0.f ? 1.f / total[h] : 0.f, a->dim);
}

/* 0 when every query row's block table row (row_tables[b], or b; < table_rows) covers its length
   with blocks in [0, num_blocks), else -3 (shared with decode_layer.c, which checks before it
   writes anything). */
int engine_check_tables(const int32_t *block_tables, const int32_t *seq_lens,
                        const int32_t *row_tables, int64_t table_rows, int batch, int block_size,
                        int64_t num_blocks, int64_t table_width, int64_t s_bt) {
    for (int b = 0; b < batch; b++) {
        const int64_t len = seq_lens[b] > 0 ? seq_lens[b] : 0;
        const int64_t need = (len + block_size - 1) / block_size;
        if (need > table_width) return -3;
        const int64_t r = row_tables ? row_tables[b] : b;
        if (r < 0 || r >= table_rows) return -3;
        const int32_t *row = block_tables + r * s_bt;
        for (int64_t j = 0; j < need; j++)
            if (row[j] < 0 || row[j] >= num_blocks) return -3;
    }
    return 0;
}

/* Rows in a row block of the row-major mode (below). */
#define ROW_BLOCK_ROWS 64
/* Query rows from which a call takes row blocks; fewer take items of (run, chunk). */
#define ROW_BLOCKS_FROM 64

/* Many rows (prefill chunks, big decode batches): a work item is a block of ROW_BLOCK_ROWS query
   rows (and, when blocks are few, one KV head's query heads), its chunks taken in order, every
   row of the block over a chunk while the chunk's K and V are in the core's cache, each row's
   part merged into its state as it comes. */
static int attention_row_blocks(const Args *a, int batch, int num_threads) {
    const int heads = a->heads, dim = a->dim;
    const int64_t blocks = (batch + ROW_BLOCK_ROWS - 1) / ROW_BLOCK_ROWS;
    const int split = blocks < 2 * num_threads ? a->kv_heads : 1;
    const int G = heads / a->kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const size_t state = (size_t)heads * ((size_t)dim + 2);
        const size_t attend = tiles_scratch_floats(a, ROW_BLOCK_ROWS);
        float *scratch = thread_scratch(attend + 2 * ROW_BLOCK_ROWS * state);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < blocks * split; j++) {
            if (!scratch) continue;
            const int b0 = (int)(j / split) * ROW_BLOCK_ROWS;
            const int b1 = b0 + ROW_BLOCK_ROWS < batch ? b0 + ROW_BLOCK_ROWS : batch;
            const int kh0 = split == 1 ? 0 : (int)(j % split);
            const int kh1 = split == 1 ? a->kv_heads : kh0 + 1;
            float *sc = scratch;
            float *part = sc + attend;
            float *st = part + state * ROW_BLOCK_ROWS; /* the rows' states */
            int group[ROW_BLOCK_ROWS], ns[ROW_BLOCK_ROWS];
            int chunks = 0;
            for (int b = b0; b < b1; b++) {
                const int len = a->lens[b] > 0 ? a->lens[b] : 0;
                const int c = (len + CHUNK - 1) / CHUNK;
                chunks = c > chunks ? c : chunks;
                float *s = st + state * (size_t)(b - b0);
                for (int h = kh0 * G; h < kh1 * G; h++) s[(size_t)heads * dim + heads + h] = 0.f;
                if (len == 0) memset(s, 0, sizeof(float) * (size_t)heads * dim);
            }
            for (int c = 0; c < chunks; c++) {
                const int t0 = c * CHUNK;
                /* the block's rows that reach this chunk, in runs that share a table row */
                for (int b = b0; b < b1;) {
                    const int32_t *table = row_table(a, b);
                    int R = 0, e = b;
                    for (; e < b1 && row_table(a, e) == table; e++) {
                        if (t0 >= a->lens[e]) continue;
                        group[R] = e;
                        ns[R++] = (a->lens[e] - t0 < CHUNK ? a->lens[e] - t0 : CHUNK);
                    }
                    if (R) attend_rows(a, group, ns, R, kh0, kh1, t0, sc, part);
                    for (int r = 0; r < R; r++) {
                        float *s = st + state * (size_t)(group[r] - b0);
                        const float *p = part + state * (size_t)r;
                        merge_part(kh0 * G, kh1 * G, dim, p, p + (size_t)heads * dim,
                                   p + (size_t)heads * dim + heads, s, s + (size_t)heads * dim,
                                   s + (size_t)heads * dim + heads, c == 0);
                    }
                    b = e;
                }
            }
            for (int b = b0; b < b1; b++) {
                const float *s = st + state * (size_t)(b - b0);
                finish_row(a, b, kh0 * G, kh1 * G, s, s + (size_t)heads * dim + heads);
            }
        }
    }
    return failed ? -2 : 0;
}

/* Few rows (a decode step of a few sequences, a step that verifies speculative drafts): work
   items are (run, chunk), or (run, chunk, KV head) when they are fewer than the threads, so that
   a long context is split across the team (flash-decoding). A run is the consecutive rows that
   share a block table row (one sequence's rows): they share each chunk's packed K and V. Each
   row's parts are then merged in chunk order (merge_part), the same bits as
   attention_row_blocks'. */
static int attention_split(const Args *a, int batch, int num_threads) {
    const int heads = a->heads, dim = a->dim, G = heads / a->kv_heads;
    const int32_t *seq_lens = a->lens;
    /* first[b]: row b's first part slot (one per chunk it reaches); runs [run[u], run[u + 1]) */
    int64_t *first = malloc(sizeof(int64_t) * ((size_t)batch + 1));
    int *run = malloc(sizeof(int) * ((size_t)batch + 1));
    int64_t *ifirst = malloc(sizeof(int64_t) * ((size_t)batch + 1)); /* run u's first item */
    if (!first || !run || !ifirst) {
        free(first), free(run), free(ifirst);
        return -2;
    }
    first[0] = 0, ifirst[0] = 0;
    int runs = 0, longest = 1;
    for (int b = 0; b < batch; b++) {
        const int len = seq_lens[b] > 0 ? seq_lens[b] : 0;
        first[b + 1] = first[b] + (len + CHUNK - 1) / CHUNK;
        if (b == 0 || row_table(a, b) != row_table(a, b - 1)) run[runs++] = b;
    }
    run[runs] = batch;
    for (int u = 0; u < runs; u++) {
        int chunks = 0;
        for (int b = run[u]; b < run[u + 1]; b++) {
            const int c = (int)(first[b + 1] - first[b]);
            chunks = c > chunks ? c : chunks;
        }
        ifirst[u + 1] = ifirst[u] + chunks;
        longest = run[u + 1] - run[u] > longest ? run[u + 1] - run[u] : longest;
    }
    const int64_t items = ifirst[runs], slots = first[batch];
    const size_t part = (size_t)heads * ((size_t)dim + 2); /* acc, m, l of one row and chunk */
    float *parts = malloc(sizeof(float) * part * (size_t)(slots > 0 ? slots : 1));
    int *owner = malloc(sizeof(int) * (size_t)(items > 0 ? items : 1));
    if (!parts || !owner) {
        free(first), free(run), free(ifirst), free(parts), free(owner);
        return -2;
    }
    for (int u = 0; u < runs; u++)
        for (int64_t i = ifirst[u]; i < ifirst[u + 1]; i++) owner[i] = u;
    const int split = items < num_threads ? a->kv_heads : 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const size_t attend = tiles_scratch_floats(a, longest);
        float *scratch = thread_scratch(attend + part * (size_t)longest + 2 * (size_t)longest);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < items * split; j++) {
            if (!scratch) continue;
            const int64_t i = j / split;
            const int u = owner[i], kh0 = split == 1 ? 0 : (int)(j % split);
            const int kh1 = split == 1 ? a->kv_heads : kh0 + 1;
            const int c = (int)(i - ifirst[u]), t0 = c * CHUNK;
            int *group = (int *)(scratch + attend + part * (size_t)longest), *ns = group + longest;
            int R = 0;
            for (int b = run[u]; b < run[u + 1]; b++)
                if (seq_lens[b] > t0) {
                    group[R] = b;
                    ns[R++] = seq_lens[b] - t0 < CHUNK ? seq_lens[b] - t0 : CHUNK;
                }
            if (R == 0) continue;
            float *got = scratch + attend;
            attend_rows(a, group, ns, R, kh0, kh1, t0, scratch, got);
            for (int r = 0; r < R; r++) { /* this item's heads of each row's slot for chunk c */
                const float *src = got + part * (size_t)r;
                float *dst = parts + part * (size_t)(first[group[r]] + c);
                const size_t h0 = (size_t)kh0 * G, h1 = (size_t)kh1 * G;
                memcpy(dst + h0 * dim, src + h0 * dim, sizeof(float) * (h1 - h0) * dim);
                for (int e = 0; e < 2; e++) {
                    const size_t at = (size_t)heads * dim + (size_t)e * heads;
                    memcpy(dst + at + h0, src + at + h0, sizeof(float) * (h1 - h0));
                }
            }
        }
#pragma omp for schedule(static)
        for (int b = 0; b < batch; b++) {
            if (!scratch) continue;
            float *s = scratch; /* the row's state */
            memset(s, 0, sizeof(float) * part);
            for (int64_t i = first[b]; i < first[b + 1]; i++) {
                const float *p = parts + part * (size_t)i;
                merge_part(0, heads, dim, p, p + (size_t)heads * dim,
                           p + (size_t)heads * dim + heads, s, s + (size_t)heads * dim,
                           s + (size_t)heads * dim + heads, i == first[b]);
            }
            finish_row(a, b, 0, heads, s, s + (size_t)heads * dim + heads);
        }
    }
    free(first), free(run), free(ifirst), free(parts), free(owner);
    return failed ? -2 : 0;
}

/* Returns 0; -1 for shapes beyond the limits; -2 when scratch memory could not be had; -3 when a
   row is longer than its block table row or names a block outside [0, num_blocks) (checked
   before anything is read). Strides are in elements. A row of length 0 gets zeros. Query row b
   reads block table row row_tables[b] (< table_rows), or b where row_tables is NULL: the rows of
   a prefill chunk share their sequence's. A row's result depends only on its own query, length
   and cache, never on the rows beside it, the thread count or the mode that computes it. */
int engine_decode_attention(int dt, int kdt, const void *q, const void *k_cache, const void *v_cache,
                            void *out, const int32_t *block_tables, const int32_t *seq_lens,
                            const int32_t *row_tables, int64_t table_rows, int batch, int heads,
                            int kv_heads, int dim, int block_size, int64_t num_blocks,
                            int64_t table_width, int64_t sq_b, int64_t sq_h, int64_t sk_b,
                            int64_t sk_s, int64_t sk_h, int64_t sv_b, int64_t sv_s, int64_t sv_h,
                            int64_t so_b, int64_t so_h, int64_t s_bt, float scale,
                            int num_threads) {
    if (heads > MAX_HEADS || dim > MAX_DIM || kv_heads < 1 || heads % kv_heads ||
        CHUNK % block_size)
        return -1;
    if (engine_check_tables(block_tables, seq_lens, row_tables,
                            row_tables ? table_rows : batch, batch, block_size, num_blocks,
                            table_width, s_bt))
        return -3;
    if (kdt < DT_F32 || kdt > DT_I8 || dt < DT_F32 || dt > DT_F16) return -1;
    const Args a = {dt, kdt, heads, kv_heads, dim, block_size, q, k_cache, v_cache, out,
                    block_tables, seq_lens, row_tables, sq_b, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s,
                    sv_h, so_b, so_h, s_bt, scale};
    /* row blocks for many rows (a prefill chunk), else items of (run, chunk): a decode batch
       of 16 as one block, split by KV heads, balanced badly */
    if (batch >= ROW_BLOCKS_FROM) return attention_row_blocks(&a, batch, num_threads);
    return attention_split(&a, batch, num_threads);
}
