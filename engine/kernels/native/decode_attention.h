/* What decode_attention.c and attention_tiles.h share: the work item's limits, the vector path
   this build compiles in (ATTN_PATH), and the arguments of a call (Args). */

#ifndef ENGINE_NATIVE_DECODE_ATTENTION_H
#define ENGINE_NATIVE_DECODE_ATTENTION_H

#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define CHUNK 256 /* tokens per work item; a multiple of every block size the engine allows */
#define MAX_HEADS 256
#define MAX_DIM 256

#if defined(__AVX512F__)
#define ATTN_PATH "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ATTN_PATH "avx2"
#else
#define ATTN_PATH "c"
#endif

typedef struct {
    int dt;  /* q's and out's dtype */
    int kdt; /* the cache's (DT_I8: rows of dim int8 values and their fp16 scale, dtypes.h) */
    int heads, kv_heads, dim, block_size;
    const void *q, *k, *v;
    void *out;
    const int32_t *tables, *lens;
    const int32_t *row_tables; /* [batch]: the block table row of each query row, or NULL (own) */
    int64_t sq_b, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_h, s_bt;
    float scale;
} Args;

/* Query row b's block table row. */
static inline const int32_t *row_table(const Args *a, int b) {
    return a->tables + (int64_t)(a->row_tables ? a->row_tables[b] : b) * a->s_bt;
}

#endif
