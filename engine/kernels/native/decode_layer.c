/* One Llama-family decoder layer for a decode step of a few sequences, in one call.

   At batch 1 the torch forward of a layer is two dozen small ops (RMSNorm, projections, rotary,
   KV store, attention, residuals, SwiGLU), each a Python call and a pass over a few KB: a step of
   the default model spent 5-7 ms of its 18 (int8) in that overhead, more than it spent reading
   its weights. Here the layer runs in C from the hidden states to the hidden states: the weights
   stream through gemv.h's row dots (int8 with per-row scales, or 16-bit/float32 as stored),
   attention is decode_attention.c's, and the small elementwise parts run in place.

   The C counterpart of DecoderLayer.forward (engine/model/llama.py) for decode-only steps of up
   to GEMV_ROWS_LIMIT sequences, driven by engine/layers/native_decode.py. Numerics follow the torch
   layer: every value the torch layer stores in the model's dtype is rounded to it here at the same
   point (RMSNorm statistics, rotary, softmax and all sums in float32). */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "exp_poly.h"
#include "gemm.h"
#include "gemm_q8.h"
#include "gemv.h"
#include "steal.h"

#define ROW_BLOCK 16 /* output rows per work item */
#define TILE_BLOCK 18 /* the same for float tiles (gemv_avx2.h GEMV_FLOAT_TILES): 6 tiles */
#define MAX_DIM 256
/* With several rows a weight row takes long enough that the hardware prefetcher falls behind:
   the row PF_ROWS ahead is prefetched by hand (4 x 512: 14 -> 12 ms int8 here). */
#define PF_ROWS 4
/* The per-row parts between the projections (RMSNorm, rotary and the KV store, the residuals,
   SwiGLU; the row_* functions below) split their rows across the team from this many rows: at
   16 rows the other thread waited through them, ~5% of a decode step. Below, they run on this
   thread without entering OpenMP (a team of one per region cost batch 1 ~0.5%). */
#define ROWS_PARALLEL_MIN 4
/* call (an expression of m) for every row m < R on th threads (engine_decode_layer's names) */
#define ROWS(call)                                                                                \
    do {                                                                                          \
        if (R >= ROWS_PARALLEL_MIN) {                                                             \
            _Pragma("omp parallel for num_threads(th) schedule(static)")                          \
            for (int m = 0; m < R; m++) call;                                                     \
        } else {                                                                                  \
            for (int m = 0; m < R; m++) call;                                                     \
        }                                                                                         \
    } while (0)

int engine_check_tables(const int32_t *block_tables, const int32_t *seq_lens,
                        const int32_t *row_tables, int64_t table_rows, int batch, int block_size,
                        int64_t num_blocks, int64_t table_width, int64_t s_bt);
int engine_decode_attention(int dt, int kdt, const void *q, const void *k_cache, const void *v_cache,
                            void *out, const int32_t *block_tables, const int32_t *seq_lens,
                            const int32_t *row_tables, int64_t table_rows, int batch, int heads,
                            int kv_heads, int dim, int block_size,
                            int64_t num_blocks, int64_t table_width, int64_t sq_b, int64_t sq_h,
                            int64_t sk_b, int64_t sk_s, int64_t sk_h, int64_t sv_b, int64_t sv_s,
                            int64_t sv_h, int64_t so_b, int64_t so_h, int64_t s_bt, float scale,
                            int num_threads);

/* The structs Python passes (layer, step), each declared by one field list, X(type, name) per
   field: the typedef and the layout engine_struct_layout reports come from the same list, and
   engine/kernels/native/__init__.py compares that layout at load with the ctypes mirrors of
   engine/kernels/native/structs.py (names, types, sizes, offsets), so a field added, moved or
   retyped on one side only stops the load instead of shifting the other side's fields. */
#define DECLARE_FIELD(T, f) T f;

/* A projection y = x W^T (* scales) (+ bias). */
#define PROJ_FIELDS(X)                                                                            \
    X(int, wt)              /* weight code (gemv.h): the model dtype's, W_I8 or W_Q8 */           \
    X(const void *, w)      /* [n, k] contiguous */                                               \
    X(const void *, scales) /* [n] in the model dtype (int8 only) */                              \
    X(const void *, bias)   /* [n] in the model dtype, or NULL */                                 \
    X(const void *, panels) /* w packed for gemm.h (pack_panels) or gemm_q8.h (W_Q8), or NULL */  \
    X(int64_t, n)                                                                                 \
    X(int64_t, k)
typedef struct {
    PROJ_FIELDS(DECLARE_FIELD)
} Proj;

#define LAYER_FIELDS(X)                                                                           \
    X(int, dt) /* the model dtype: activations, norms, biases and scales */                      \
    X(int, hidden)                                                                                \
    X(int, heads)                                                                                 \
    X(int, kv_heads)                                                                              \
    X(int, dim)                                                                                   \
    X(int, inter)                                                                                 \
    X(int, qk_norm)                                                                               \
    X(int, block_size)                                                                            \
    X(int, kdt) /* the KV cache's dtype (DT_I8: int8 rows with their scale, dtypes.h) */          \
    X(float, eps)                                                                                 \
    X(float, scale)                                                                               \
    X(const void *, ln1)    /* [hidden] */                                                        \
    X(const void *, ln2)    /* [hidden] */                                                        \
    X(const void *, q_norm) /* [dim] (or NULL) */                                                 \
    X(const void *, k_norm) /* [dim] (or NULL) */                                                 \
    X(Proj, qkv)                                                                                  \
    X(Proj, o)                                                                                    \
    X(Proj, gate_up)                                                                              \
    X(Proj, down)                                                                                 \
    X(void *, k_cache) /* [num_blocks, block_size, kv_heads, row], row dim (+2 for int8) */       \
    X(void *, v_cache) /* as k_cache */                                                           \
    X(int64_t, num_blocks)                                                                        \
    X(int64_t, sk_b)                                                                              \
    X(int64_t, sk_s)                                                                              \
    X(int64_t, sk_h)                                                                              \
    X(int64_t, sv_b)                                                                              \
    X(int64_t, sv_s)                                                                              \
    X(int64_t, sv_h)
typedef struct {
    LAYER_FIELDS(DECLARE_FIELD)
} Layer;

#define STEP_FIELDS(X)                                                                            \
    X(int, rows)                                                                                  \
    X(int, threads)                                                                               \
    X(const int64_t *, positions)    /* [rows] */                                                 \
    X(const int64_t *, slots)        /* [rows]; slot -1: not written */                           \
    X(const int32_t *, block_tables) /* [rows, table_width], row stride s_bt */                   \
    X(const int32_t *, seq_lens)     /* [rows], including this token */                           \
    X(const int32_t *, row_tables)   /* [rows]: the block table row of each row, or NULL (own) */ \
    X(int64_t, table_rows)           /* block_tables' rows (with row_tables) */                   \
    X(int64_t, table_width)                                                                       \
    X(int64_t, s_bt)                                                                              \
    X(const float *, cos)        /* [max_pos, dim] (RotaryEmbedding's tables) */                  \
    X(const float *, sin_signed) /* [max_pos, dim] */                                             \
    X(int64_t, max_pos)
typedef struct {
    STEP_FIELDS(DECLARE_FIELD)
} Step;

typedef struct {
    const char *name, *type;
    int64_t offset, size;
} FieldLayout;
#define LAYOUT_ROW(T, f) \
    {#f, #T, (int64_t)offsetof(LAYOUT_OF, f), (int64_t)sizeof(((LAYOUT_OF *)0)->f)},
#define LAYOUT_OF Proj
static const FieldLayout proj_layout[] = {PROJ_FIELDS(LAYOUT_ROW)};
#undef LAYOUT_OF
#define LAYOUT_OF Layer
static const FieldLayout layer_layout[] = {LAYER_FIELDS(LAYOUT_ROW)};
#undef LAYOUT_OF
#define LAYOUT_OF Step
static const FieldLayout step_layout[] = {STEP_FIELDS(LAYOUT_ROW)};
#undef LAYOUT_OF

#define LAYOUT_STRUCT(S, rows) \
    {#S, (int64_t)sizeof(S), rows, (int)(sizeof(rows) / sizeof(rows[0]))}
static const struct {
    const char *name;
    int64_t size;
    const FieldLayout *fields;
    int count;
} layouts[] = {
    LAYOUT_STRUCT(Proj, proj_layout),
    LAYOUT_STRUCT(Layer, layer_layout),
    LAYOUT_STRUCT(Step, step_layout),
};

/* The layout of mirrored struct `which` (0, 1, ...): with field -1 its name and sizeof (type NULL,
   offset 0), else its field-th field's name, C type (as written in the list), offset and size.
   Returns the struct's field count; -1 past the last struct or field. */
int engine_struct_layout(int which, int field, const char **name, const char **type,
                         int64_t *offset, int64_t *size) {
    if (which < 0 || which >= (int)(sizeof(layouts) / sizeof(layouts[0]))) return -1;
    if (field < -1 || field >= layouts[which].count) return -1;
    if (field == -1) {
        *name = layouts[which].name, *type = NULL, *offset = 0, *size = layouts[which].size;
    } else {
        const FieldLayout *f = &layouts[which].fields[field];
        *name = f->name, *type = f->type, *offset = f->offset, *size = f->size;
    }
    return layouts[which].count;
}

/* f rounded to dtype dt, as float32: where the torch layer stores a tensor in the model dtype. */
static inline float rnd(int dt, float f) {
    if (dt == DT_BF16) return bf16_to_f32(f32_to_bf16(f));
    if (dt == DT_F16) return (float)(_Float16)f;
    return f;
}

/* y[i] = rnd(DT_BF16, y[i]) for i < n: f32_to_bf16's rounding (to nearest, ties to even; a NaN
   to the quiet NaN) without branches, so that it vectorises: the same bits. */
static void round_bf16(float *y, int64_t n) {
    uint32_t *u = (uint32_t *)y;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t v = u[i];
        const uint32_t r = (v + 0x7fffu + ((v >> 16) & 1u)) & 0xffff0000u;
        u[i] = (v & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : r;
    }
}

/* y[m * n + j] = rnd(x[m] . w[j] * scale[j]) (+ bias, rounded again) for m < rows. Returns 0 or
   -2 without memory. */
static int project_rows(int dt, const Proj *p, const float *x, int rows, float *y, int threads);

/* y = rnd(x W^T) (+ bias, rounded again) for any number of rows: float weights packed in panels
   take the fixed-order GEMM (gemm.h: one order per output whatever the rows), others the row
   dots in sets of GEMV_ROWS_LIMIT rows (also one order per output). Returns 0 or -2. */
static int project(int dt, const Proj *p, const float *x, int rows, float *y, int threads) {
    const int64_t N = p->n, K = p->k;
    if (p->panels && p->wt != W_I8) {
        if (p->wt == W_Q8) { /* W8A8 panels (gemm_q8.h): x's rows quantized as it runs */
            if (gemm_q8(DT_F32, x, K, rows, K, p->panels, N, y, N, threads)) return -2;
        } else {
            gemm_packed(p->wt, x, K, rows, K, p->panels, N, y, N, threads, dt == DT_BF16);
        }
        if (dt == DT_F32 && !p->bias) return 0;
        if (dt == DT_BF16 && !p->bias) { /* rnd, branch-free (it vectorises), rows in parallel */
            const int R = rows, th = threads;
            ROWS(round_bf16(y + (int64_t)m * N, N));
            return 0;
        }
        for (int64_t i = 0; i < (int64_t)rows * N; i++) {
            float v = rnd(dt, y[i]);
            if (p->bias) v = rnd(dt, v + load_f32(dt, p->bias, i % N));
            y[i] = v;
        }
        return 0;
    }
    for (int m0 = 0; m0 < rows; m0 += GEMV_ROWS_LIMIT) {
        const int n = rows - m0 < GEMV_ROWS_LIMIT ? rows - m0 : GEMV_ROWS_LIMIT;
        if (project_rows(dt, p, x + (int64_t)m0 * K, n, y + (int64_t)m0 * N, threads)) return -2;
    }
    return 0;
}

/* project for 1 to GEMV_ROWS_LIMIT rows by the row dots or gemv_avx2.h's tiles. */
static int project_rows(int dt, const Proj *p, const float *x, int rows, float *y, int threads) {
    const int64_t N = p->n, K = p->k, blocks = (N + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t wsize = p->wt == W_I8 ? 1 : (p->wt == DT_F32 ? 4 : 2);
#if defined(GEMV_FLOAT_TILES)
    if (p->wt != W_I8 && GEMV_TILES_FOR(rows)) {
        STEAL_FOR(blk, threads, (N + TILE_BLOCK - 1) / TILE_BLOCK) {
            const int64_t n1 = (blk + 1) * TILE_BLOCK < N ? (blk + 1) * TILE_BLOCK : N;
            for (int64_t j = blk * TILE_BLOCK; j < n1; j += GEMV_TILE_COLS) {
                const int C = n1 - j < GEMV_TILE_COLS ? (int)(n1 - j) : GEMV_TILE_COLS;
                float dots[GEMV_TILE_COLS][GEMV_ROWS_LIMIT];
                float_tiles(p->wt, x, rows, K, (const char *)p->w + j * K * wsize, K * wsize, C,
                            &dots[0][0], GEMV_ROWS_LIMIT);
                for (int c = 0; c < C; c++)
                    for (int m = 0; m < rows; m++) {
                        float v = rnd(dt, dots[c][m]);
                        if (p->bias) v = rnd(dt, v + load_f32(dt, p->bias, j + c));
                        y[(int64_t)m * N + j + c] = v;
                    }
            }
        }
        return 0;
    }
#endif
    RowGroups acts;
    if (groups_prepare(&acts, p->wt, x, rows, K)) return -2;
    STEAL_FOR(blk, threads, blocks) {
        const int64_t n1 = (blk + 1) * ROW_BLOCK < N ? (blk + 1) * ROW_BLOCK : N;
        for (int64_t j = blk * ROW_BLOCK; j < n1; j++) {
            float dots[GEMV_ROWS_LIMIT];
            if (rows > 1 && j + PF_ROWS < N) {
                const char *nx = (const char *)p->w + (j + PF_ROWS) * K * wsize;
                for (int64_t o = 0; o < K * wsize; o += 64) __builtin_prefetch(nx + o, 0, 0);
            }
            row_dots_groups(p->wt, &acts, (const char *)p->w + j * K * wsize, dots);
            const float s = p->wt == W_I8 ? load_f32(dt, p->scales, j) : 1.f;
            for (int m = 0; m < rows; m++) {
                float v = rnd(dt, dots[m] * s);
                if (p->bias) v = rnd(dt, v + load_f32(dt, p->bias, j));
                y[(int64_t)m * N + j] = v;
            }
        }
    }
    groups_free(&acts);
    return 0;
}

/* out = rnd(w * rnd(h / rms(h))) over n values (RMSNorm as engine/layers/rmsnorm.py). */
static void rms_norm(int dt, const float *h, const void *w, int n, float eps, float *out) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) ss += h[i] * h[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = rnd(dt, load_f32(dt, w, i) * rnd(dt, h[i] * r));
}

/* x (dim values) rotated in place at one position's cos/sin rows, rounded (rotate-half form). */
static void rotate(int dt, float *x, const float *cos, const float *sin_signed, int dim) {
    float t[MAX_DIM];
    const int half = dim / 2;
    for (int d = 0; d < dim; d++) t[d] = x[d] * cos[d] + x[(d + half) % dim] * sin_signed[d];
    for (int d = 0; d < dim; d++) x[d] = rnd(dt, t[d]);
}

/* Row m of the step's per-row parts; hf [R, H] the hidden states in float32, x and y the
   activation and projection buffers (engine_decode_layer). */

/* hf = hidden; x = RMSNorm(hf) (the attention's input norm). */
static void row_norm_in(const Layer *L, const void *hidden, float *hf, float *x, int m) {
    const int64_t H = L->hidden;
    for (int64_t i = m * H; i < (m + 1) * H; i++) hf[i] = load_f32(L->dt, hidden, i);
    rms_norm(L->dt, hf + m * H, L->ln1, (int)H, L->eps, x + m * H);
}

/* The qkv row y: (q/k norm), rotary, q into qd, K and V into the cache at the row's slot. */
static void row_rope_store(const Layer *L, const Step *S, float *y, void *qd, int m) {
    const int dt = L->dt, HQ = L->heads, HK = L->kv_heads, D = L->dim;
    const int64_t QS = (int64_t)HQ * D, KS = (int64_t)HK * D;
    float *row = y + m * (QS + 2 * KS);
    const float *c = S->cos + S->positions[m] * D, *s = S->sin_signed + S->positions[m] * D;
    for (int h = 0; h < HQ + HK; h++) {
        float *v = row + (int64_t)h * D;
        if (L->qk_norm) rms_norm(dt, v, h < HQ ? L->q_norm : L->k_norm, D, L->eps, v);
        rotate(dt, v, c, s, D);
    }
    for (int64_t i = 0; i < QS; i++) store_f32(dt, qd, m * QS + i, row[i]);
    const int64_t slot = S->slots[m];
    if (slot < 0) return; /* a row without a slot writes no KV */
    const int64_t blk = slot / L->block_size, off = slot % L->block_size;
    for (int h = 0; h < HK; h++) {
        store_row_f32(L->kdt, L->k_cache, blk * L->sk_b + off * L->sk_s + h * L->sk_h,
                      row + QS + (int64_t)h * D, D);
        store_row_f32(L->kdt, L->v_cache, blk * L->sv_b + off * L->sv_s + h * L->sv_h,
                      row + QS + KS + (int64_t)h * D, D);
    }
}

/* hf += y (o_proj's output); x = RMSNorm(hf) (the MLP's input norm). */
static void row_residual_norm(const Layer *L, float *hf, const float *y, float *x, int m) {
    const int64_t H = L->hidden;
    for (int64_t i = m * H; i < (m + 1) * H; i++) hf[i] = rnd(L->dt, hf[i] + y[i]);
    rms_norm(L->dt, hf + m * H, L->ln2, (int)H, L->eps, x + m * H);
}

/* x[i] = rnd(dt, x[i]) for i < n. */
static void round_row(int dt, float *x, int64_t n) {
    if (dt == DT_BF16)
        round_bf16(x, n);
    else if (dt == DT_F16)
        for (int64_t i = 0; i < n; i++) x[i] = rnd(dt, x[i]);
}

/* x = SiLU(gate) * up from the gate_up row y, each product rounded to the step's dtype. SiLU(g)
   = g / (1 + e^-g) = g e^g / (1 + e^g): with e = e^-|g| (exp_poly.h, never overflowing) it is
   (g >= 0 ? g : g e) / (1 + e), 8 lanes at a time where AVX2 is (the same steps). */
static void row_swiglu(const Layer *L, const float *y, float *x, int m) {
    const int dt = L->dt;
    const int64_t I = L->inter;
    const float *gate = y + m * 2 * I, *up = gate + I;
    float *xs = x + m * I;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 neg = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
    for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8_nonpositive(_mm256_or_ps(g, neg));
        const __m256 pos = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
        const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(g, e), g, pos);
        _mm256_storeu_ps(xs + i, _mm256_div_ps(num, _mm256_add_ps(one, e)));
    }
#endif
    for (; i < I; i++) {
        const float g = gate[i], e = exp_nonpositive(-fabsf(g));
        xs[i] = (g >= 0.f ? g : g * e) / (1.f + e);
    }
    round_row(dt, xs, I);
    for (int64_t i = 0; i < I; i++) xs[i] *= up[i];
    round_row(dt, xs, I);
}

/* hidden = hf + y (down_proj's output). */
static void row_residual_out(const Layer *L, const float *hf, const float *y, void *hidden,
                             int m) {
    const int64_t H = L->hidden;
    for (int64_t i = m * H; i < (m + 1) * H; i++)
        store_f32(L->dt, hidden, i, rnd(L->dt, hf[i] + y[i]));
}

/* Runs layer L on hidden [rows, hidden] (model dtype, contiguous; updated in place), writing the
   step's K and V into the cache. Returns 0; -1 for shapes beyond the limits or projections that
   do not fit the layer; -2 without memory; -3 for a position beyond the rotary tables, a slot
   outside the cache, or a block table that does not cover its sequence (checked before anything
   is written). */
int engine_decode_layer(const Layer *L, const Step *S, void *hidden) {
    const int dt = L->dt, R = S->rows, H = L->hidden, HQ = L->heads, HK = L->kv_heads;
    const int D = L->dim, I = L->inter;
    const int64_t QS = (int64_t)HQ * D, KS = (int64_t)HK * D, NQKV = QS + 2 * KS;
    if (R < 1 || D > MAX_DIM || D % 2 || HK < 1 || HQ % HK ||
        L->qkv.n != NQKV || L->qkv.k != H || L->o.n != H || L->o.k != QS ||
        L->gate_up.n != 2 * (int64_t)I || L->gate_up.k != H || L->down.n != H || L->down.k != I)
        return -1;
    const int64_t slots = L->num_blocks * L->block_size;
    for (int m = 0; m < R; m++)
        if (S->positions[m] < 0 || S->positions[m] >= S->max_pos || S->slots[m] < -1 ||
            S->slots[m] >= slots)
            return -3;
    if (engine_check_tables(S->block_tables, S->seq_lens, S->row_tables,
                            S->row_tables ? S->table_rows : R, R, L->block_size, L->num_blocks,
                            S->table_width, S->s_bt))
        return -3;
    /* Float buffers: the hidden states, an activation row set, a projection output; q and the
       attention output in the model dtype. */
    const int64_t widest = NQKV > 2 * (int64_t)I ? NQKV : 2 * (int64_t)I;
    const size_t nf = (size_t)R * ((size_t)H + (size_t)(I > QS ? I : QS) + (size_t)widest);
    float *hf = malloc(sizeof(float) * nf);
    void *qd = malloc(sizeof(float) * 2 * (size_t)R * (size_t)QS);
    if (!hf || !qd) {
        free(hf), free(qd);
        return -2;
    }
    float *x = hf + (size_t)R * H, *y = x + (size_t)R * (I > QS ? I : QS);
    void *od = (char *)qd + sizeof(float) * (size_t)R * (size_t)QS;
    const int th = S->threads;

    /* Attention: RMSNorm, qkv, (q/k norm), rotary, KV store, paged attention, o_proj. */
    ROWS(row_norm_in(L, hidden, hf, x, m));
    if (project(dt, &L->qkv, x, R, y, th)) goto oom;
    ROWS(row_rope_store(L, S, y, qd, m));
    int rc = engine_decode_attention(dt, L->kdt, qd, L->k_cache, L->v_cache, od, S->block_tables,
                                     S->seq_lens, S->row_tables, S->table_rows, R, HQ, HK, D,
                                     L->block_size, L->num_blocks,
                                     S->table_width, QS, D, L->sk_b, L->sk_s, L->sk_h, L->sv_b,
                                     L->sv_s, L->sv_h, QS, D, S->s_bt, L->scale, th);
    if (rc) {
        free(hf), free(qd);
        return rc;
    }
    for (int64_t i = 0; i < (int64_t)R * QS; i++) x[i] = load_f32(dt, od, i);
    if (project(dt, &L->o, x, R, y, th)) goto oom;

    /* MLP: RMSNorm, gate_up, SiLU(gate) * up, down. */
    ROWS(row_residual_norm(L, hf, y, x, m));
    if (project(dt, &L->gate_up, x, R, y, th)) goto oom;
    ROWS(row_swiglu(L, y, x, m));
    if (project(dt, &L->down, x, R, y, th)) goto oom;
    ROWS(row_residual_out(L, hf, y, hidden, m));
    free(hf), free(qd);
    return 0;
oom:
    free(hf), free(qd);
    return -2;
}

/* out [rows, n] = RMSNorm(x [rows, n]) with weight w (all in dtype dt, contiguous), row by row in
   rms_norm's one order: the model's final norm for the C forward, so that a row's normed state,
   like everything before it, does not depend on the rows beside it. Returns 0, -2 without
   memory. */
int engine_rms_norm(int dt, const void *x, const void *w, void *out, int64_t rows, int n,
                    float eps, int threads) {
    float *buf = malloc(sizeof(float) * 2 * (size_t)(rows > 0 ? rows : 1) * (size_t)n);
    if (!buf) return -2;
    const int64_t R = rows;
    const int th = threads;
#pragma omp parallel for num_threads(th) schedule(static) if (R >= ROWS_PARALLEL_MIN)
    for (int64_t m = 0; m < R; m++) {
        float *h = buf + 2 * m * n, *o = h + n;
        for (int i = 0; i < n; i++) h[i] = load_f32(dt, x, m * n + i);
        rms_norm(dt, h, w, n, eps, o);
        for (int i = 0; i < n; i++) store_f32(dt, out, m * n + i, o[i]);
    }
    free(buf);
    return 0;
}
