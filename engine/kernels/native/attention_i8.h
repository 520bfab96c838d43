/* One chunk of paged attention over an int8 cache in exact integer arithmetic: attention_tiles.h's
   tiles_chunk for kdt == DT_I8 and a dim that is a multiple of 16.

   The cache's rows are small integers (|k| <= 127, a float16 scale per row, dtypes.h); the other
   operand of each product is quantised to int16 with a scale of its own row, so that every dot
   product is an exact int32 sum:

     scores  S[m][j] = (float)(sum_d qi[m][d] k[j][d]) * (cq[m] * ks[j])
             qi = round(q / sq) with sq = max|q| / 32767 over query row m, cq = sq * scale,
             ks key j's scale;
     values  O[m][e] = (float)(sum_j wi[m][j] v[j][e]) * sw[m]
             w = p * vs (the softmax numerators, <= 1, times the value rows' scales; zero past
             the row's causal count n), wi = round(w / sw) with sw = max(vs[0..n)) / 32767.

   |sum| <= 256 * 32767 * 127 < 2^31 for dims and chunks of up to 256: nothing overflows or
   rounds. Integer sums are the same in any order, so the bits are the same on every class and
   for any tiling: vpdpwssd on AVX512-VNNI, vpmaddwd + vpaddd on AVX-512 and AVX2, plain loops in
   C; the quantisation is one scalar code for all. A row's bits depend only on its own query,
   causal length and cache: its scales come from its own values, and a zero weight adds exactly
   nothing. Each instruction does two products per 32-bit lane (the float path one FMA), and the
   panels are int16 pairs (half the float panels' bytes), so an int8 cache costs the attention
   less than a float one, in prefill and decode alike.

   Error against the float path over the same int8 cache: a query element moves by at most
   2^-16 of its row's largest, a weight by 2^-16 of the row's largest value scale (tests: within
   1e-4). */

#ifndef ENGINE_NATIVE_ATTENTION_I8_H
#define ENGINE_NATIVE_ATTENTION_I8_H

#define I8A_QMAX 32767.f

static inline int i8a_applies(const Args *a) { return a->kdt == DT_I8 && a->dim % 16 == 0; }

/* x[0..n) as int16: q[i] = round-half-even(x[i] * (32767 / max|x|)); returns max|x| / 32767 (0
   and zeros for a row of zeros). The vector and scalar loops give the same bits (the max is
   exact in any order; one product, one rounding to nearest even, a clamp). */
static inline float i8a_quant16(const float *x, int n, int16_t *q) {
    float amax = 0.f;
    int i = 0;
#if defined(GEMV_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 vmax = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
#endif
    for (; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    if (amax == 0.f) {
        memset(q, 0, sizeof(int16_t) * (size_t)n);
        return 0.f;
    }
    const float inv = I8A_QMAX / amax;
    i = 0;
#if defined(GEMV_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(I8A_QMAX);
    const __m256 lo = _mm256_set1_ps(-I8A_QMAX);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_max_ps(_mm256_min_ps(v, hi), lo);
        const __m256i w = _mm256_cvtps_epi32(v);
        _mm_storeu_si128((__m128i *)(q + i), _mm_packs_epi32(_mm256_castsi256_si128(w),
                                                             _mm256_extracti128_si256(w, 1)));
    }
#endif
    for (; i < n; i++) {
        float v = nearbyintf(x[i] * inv);
        v = v > I8A_QMAX ? I8A_QMAX : (v < -I8A_QMAX ? -I8A_QMAX : v);
        q[i] = (int16_t)v;
    }
    return amax / I8A_QMAX;
}

/* A row's weights as int16: q[j] = round-half-even((p[j] * vs[j]) * (32767 / top)) for j < n,
   zeros to n2x2, with top = max(vs[0..n)) >= every p[j] * vs[j] (p <= 1: the chunk's softmax
   numerators); returns top / 32767 (0 and zeros where top is 0). No pass for the row's max:
   top is the chunk's prefix max of the value scales at the row's causal count, the row's own.
   Vector and scalar loops give the same bits. */
static inline float i8a_weights16(const float *p, const float *vs, int n, int n2x2, float top,
                                  int16_t *q) {
    if (!(top > 0.f)) {
        memset(q, 0, sizeof(int16_t) * (size_t)n2x2);
        return 0.f;
    }
    const float inv = I8A_QMAX / top;
    int j = 0;
#if defined(GEMV_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(I8A_QMAX);
    for (; j + 8 <= n; j += 8) {
        const __m256 w = _mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_loadu_ps(vs + j));
        __m256 v = _mm256_round_ps(_mm256_mul_ps(w, vinv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_min_ps(v, hi); /* w >= 0 */
        const __m256i i32 = _mm256_cvtps_epi32(v);
        _mm_storeu_si128((__m128i *)(q + j), _mm_packs_epi32(_mm256_castsi256_si128(i32),
                                                             _mm256_extracti128_si256(i32, 1)));
    }
#endif
    for (; j < n; j++) {
        const float v = nearbyintf((p[j] * vs[j]) * inv);
        q[j] = (int16_t)(v > I8A_QMAX ? I8A_QMAX : v);
    }
    for (; j < n2x2; j++) q[j] = 0;
    return top / I8A_QMAX;
}

/* y[m][0..cols) = sum_i (x[m][2i], x[m][2i+1]) . (p[c][i][j] as two int16), for M rows of x
   (int16, ldx apart, K2 pairs) against `panels` panels of K2 x 16 pair words, pstride words
   apart: exact int32 sums. */
#if defined(GEMM_AVX512)
#if defined(__AVX512VNNI__)
/* vpdpwssd in place: GCC's intrinsic copies the accumulators through the stack here */
static inline __attribute__((always_inline)) __m512i i8a_dpwssd(__m512i acc, __m512i a,
                                                                __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}
#define I8A_DOT(acc, a, b) i8a_dpwssd(acc, a, b)
#else
#define I8A_DOT(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
static inline __attribute__((always_inline)) void i8a_tile(const int16_t *x, int64_t ldx, int R,
                                                           int NP, const int32_t *p,
                                                           int64_t pstride, int K2, int32_t *y,
                                                           int64_t ldy, int cols) {
    __m512i acc[GEMM_MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int i = 0; i < K2; i++) {
        __m512i b[2];
#pragma GCC unroll 2
        for (int c = 0; c < NP; c++)
            b[c] = _mm512_loadu_si512((const void *)(p + c * pstride + (int64_t)i * TILE_KEYS));
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * i, sizeof pair);
            const __m512i a = _mm512_set1_epi32(pair);
#pragma GCC unroll 2
            for (int c = 0; c < NP; c++) acc[r][c] = I8A_DOT(acc[r][c], a, b[c]);
        }
    }
    for (int c = 0; c < NP; c++) {
        const int left = cols - c * TILE_KEYS;
        if (left <= 0) break;
        const __mmask16 m = left >= TILE_KEYS ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_epi32(y + r * ldy + c * TILE_KEYS, m, acc[r][c]);
    }
}
#define I8A_TILE_PANELS 2
#define I8A_MR GEMM_MR
#elif defined(GEMM_AVX2)
#define I8A_MR 4 /* 8 accumulators: six rows' 12 (GEMM_MR) spilled, vpmaddwd needing a temporary */
static inline __attribute__((always_inline)) void i8a_tile(const int16_t *x, int64_t ldx, int R,
                                                           int NP, const int32_t *p,
                                                           int64_t pstride, int K2, int32_t *y,
                                                           int64_t ldy, int cols) {
    (void)NP, (void)pstride; /* one panel: two 8-lane halves */
    __m256i acc[I8A_MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int i = 0; i < K2; i++) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(p + (int64_t)i * TILE_KEYS));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(p + (int64_t)i * TILE_KEYS + 8));
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * i, sizeof pair);
            const __m256i a = _mm256_set1_epi32(pair);
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(a, b0));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(a, b1));
        }
    }
    for (int r = 0; r < R; r++) {
        if (cols >= TILE_KEYS) { /* a whole panel: stored in place, not through libc's memcpy */
            _mm256_storeu_si256((__m256i *)(y + r * ldy), acc[r][0]);
            _mm256_storeu_si256((__m256i *)(y + r * ldy + 8), acc[r][1]);
        } else {
            int32_t out[TILE_KEYS];
            _mm256_storeu_si256((__m256i *)out, acc[r][0]);
            _mm256_storeu_si256((__m256i *)(out + 8), acc[r][1]);
            memcpy(y + r * ldy, out, sizeof(int32_t) * (size_t)cols);
        }
    }
}
#define I8A_TILE_PANELS 1
#endif

#if defined(GEMM_AVX512) || defined(GEMM_AVX2)
/* Rows [0, M) in tiles of GEMM_MR (the last smaller) against NP panels: R and NP constants in
   each call, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void i8a_rows(const int16_t *x, int64_t ldx, int M,
                                                           int NP, const int32_t *p,
                                                           int64_t pstride, int K2, int32_t *y,
                                                           int64_t ldy, int cols) {
    int m = 0;
    for (; m + I8A_MR <= M; m += I8A_MR)
        i8a_tile(x + m * ldx, ldx, I8A_MR, NP, p, pstride, K2, y + m * ldy, ldy, cols);
#define GEMM_REST(R) i8a_tile(x + m * ldx, ldx, R, NP, p, pstride, K2, y + m * ldy, ldy, cols)
#if defined(GEMM_AVX512)
    switch (M - m) { GEMM_REST_CASES_11 default: break; }
#else
    switch (M - m) {
    case 1: GEMM_REST(1); break;
    case 2: GEMM_REST(2); break;
    case 3: GEMM_REST(3); break;
    default: break;
    }
#endif
#undef GEMM_REST
}
#endif

static inline void i8a_gemm(const int16_t *x, int64_t ldx, int M, const int32_t *p,
                            int64_t pstride, int panels, int K2, int32_t *y, int64_t ldy,
                            int cols) {
#if defined(GEMM_AVX512) || defined(GEMM_AVX2)
    for (int c = 0; c < panels; c += I8A_TILE_PANELS) {
        const int left = cols - c * TILE_KEYS;
        const int32_t *pc = p + (int64_t)c * pstride;
        if (I8A_TILE_PANELS == 2 && panels - c >= 2)
            i8a_rows(x, ldx, M, 2, pc, pstride, K2, y + c * TILE_KEYS, ldy, left);
        else
            i8a_rows(x, ldx, M, 1, pc, pstride, K2, y + c * TILE_KEYS, ldy, left);
    }
#else
    for (int m = 0; m < M; m++)
        for (int j = 0; j < cols; j++) {
            const int32_t *pj = p + (int64_t)(j / TILE_KEYS) * pstride + j % TILE_KEYS;
            int32_t acc = 0;
            for (int i = 0; i < K2; i++) {
                int16_t w[2];
                memcpy(w, pj + (int64_t)i * TILE_KEYS, sizeof w);
                acc += (int32_t)x[m * ldx + 2 * i] * w[0] + (int32_t)x[m * ldx + 2 * i + 1] * w[1];
            }
            y[m * ldy + j] = acc;
        }
#endif
}

/* K pair panels: kq[p][w][j] = dims (2w, 2w+1) of key 16p + j as int16, zero past n; ks[j] the
   keys' scales. */
static inline void i8a_pack_keys(const void *cache, const int64_t *offs, int n, int D,
                                 int32_t *kq, float *ks) {
    const int W = D / 2, n16 = tiles_round16(n);
#if defined(GEMV_AVX2)
    for (int j0 = 0; j0 < n16; j0 += 8) {
        int32_t *dst = kq + (size_t)(j0 / TILE_KEYS) * W * TILE_KEYS + j0 % TILE_KEYS;
        for (int w0 = 0; w0 < W; w0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = j0 + i < n ? _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_loadu_si128(
                                        (const __m128i *)((const int8_t *)cache + offs[j0 + i] +
                                                          2 * w0))))
                                  : _mm256_setzero_ps();
            tiles_transpose8(r); /* 32-bit words moved as they are: exact */
            for (int i = 0; i < 8; i++)
                _mm256_storeu_ps((float *)(dst + (size_t)(w0 + i) * TILE_KEYS), r[i]);
        }
    }
#else
    for (int j = 0; j < n16; j++)
        for (int w = 0; w < W; w++) {
            int16_t pr[2] = {0, 0};
            if (j < n) {
                const int8_t *k = (const int8_t *)cache + offs[j] + 2 * w;
                pr[0] = k[0], pr[1] = k[1];
            }
            memcpy(kq + ((size_t)(j / TILE_KEYS) * W + w) * TILE_KEYS + j % TILE_KEYS, pr,
                   sizeof pr);
        }
#endif
    for (int j = 0; j < n; j++) ks[j] = i8_row_scale(cache, offs[j], D);
}

/* V pair panels: vq[c][i][e] = (V[2i][16c + e], V[2i + 1][16c + e]) as int16, a zero key past
   an odd n; vs[j] the value rows' scales. */
static inline void i8a_pack_values(const void *cache, const int64_t *offs, int n, int D,
                                   int32_t *vq, float *vs) {
    const int n2 = (n + 1) / 2;
    for (int i = 0; i < n2; i++) {
        const int8_t *r0 = (const int8_t *)cache + offs[2 * i];
        const int8_t *r1 = 2 * i + 1 < n ? (const int8_t *)cache + offs[2 * i + 1] : NULL;
        for (int c = 0; c < D / TILE_KEYS; c++) {
            int32_t *dst = vq + ((size_t)c * n2 + i) * TILE_KEYS;
#if defined(GEMV_AVX2)
            const __m256i a =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(r0 + c * TILE_KEYS)));
            const __m256i b = r1 ? _mm256_cvtepi8_epi16(
                                       _mm_loadu_si128((const __m128i *)(r1 + c * TILE_KEYS)))
                                 : _mm256_setzero_si256();
            const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
            _mm256_storeu_si256((__m256i *)dst, _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_storeu_si256((__m256i *)(dst + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
#else
            for (int e = 0; e < TILE_KEYS; e++) {
                const int16_t pr[2] = {r0[c * TILE_KEYS + e], r1 ? r1[c * TILE_KEYS + e] : 0};
                memcpy(dst + e, pr, sizeof pr);
            }
#endif
        }
    }
    for (int j = 0; j < n; j++) vs[j] = i8_row_scale(cache, offs[j], D);
}

/* tiles_chunk over an int8 cache (i8a_applies): the same parts, from the integer products. */
static inline void tiles_chunk_i8(const Args *a, const int32_t *table, const int *rows,
                                  const int *ns, int R, int kh, int t0, int n, float *scratch,
                                  float *parts, size_t part) {
    const int H = a->heads, D = a->dim, G = H / a->kv_heads, M = R * G, W = D / 2;
    const int n2 = (n + 1) / 2;
    float *qf = scratch, *s = qf + (size_t)M * D, *kp = s + (size_t)M * CHUNK;
    float *vp = kp + (size_t)CHUNK * D, *o = vp + (size_t)CHUNK * tiles_round16(D);
    float *cqs = o + (size_t)M * D, *sws = cqs + M; /* tiles_scratch_floats' int8 part */
    int32_t *si = (int32_t *)(sws + M), *oi = si + (size_t)M * CHUNK;
    int16_t *qi = (int16_t *)(oi + (size_t)M * D), *wi = qi; /* wi after the scores are done */
    int32_t *kq = (int32_t *)kp, *vq = (int32_t *)vp;
    int64_t offs[CHUNK];
    float ks[CHUNK], vs[CHUNK];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const int m = r * G + g;
            const int64_t off = (int64_t)rows[r] * a->sq_b + (int64_t)(kh * G + g) * a->sq_h;
            float *qh = qf + (size_t)m * D;
            for (int d = 0; d < D; d++) qh[d] = load_f32(a->dt, a->q, off + d);
            cqs[m] = i8a_quant16(qh, D, qi + (size_t)m * D) * a->scale;
        }
    tiles_offsets(table, a->block_size, a->sk_b, a->sk_s, a->sk_h, kh, t0, n, offs);
    i8a_pack_keys(a->k, offs, n, D, kq, ks);
    const int panels = tiles_round16(n) / TILE_KEYS;
    i8a_gemm(qi, D, M, kq, (int64_t)W * TILE_KEYS, panels, W, si, CHUNK, n);
    tiles_offsets(table, a->block_size, a->sv_b, a->sv_s, a->sv_h, kh, t0, n, offs);
    i8a_pack_values(a->v, offs, n, D, vq, vs);
    float top[CHUNK]; /* top[j]: max(vs[0..j]) */
    for (int j = 0; j < n; j++) top[j] = j && top[j - 1] > vs[j] ? top[j - 1] : vs[j];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const int m = r * G + g, h = kh * G + g;
            float *sr = s + (size_t)m * CHUNK, *pr = parts + part * (size_t)r;
            const int32_t *ir = si + (size_t)m * CHUNK;
            for (int j = 0; j < ns[r]; j++) sr[j] = (float)ir[j] * (cqs[m] * ks[j]);
            softmax_chunk(sr, ns[r], pr + (size_t)H * D + h, pr + (size_t)H * D + H + h);
            sws[m] = i8a_weights16(sr, vs, ns[r], 2 * n2, top[ns[r] - 1], wi + (size_t)m * 2 * n2);
        }
    i8a_gemm(wi, 2 * n2, M, vq, (int64_t)n2 * TILE_KEYS, D / TILE_KEYS, n2, oi, D, D);
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const int m = r * G + g;
            float *dst = parts + part * (size_t)r + (size_t)(kh * G + g) * D;
            for (int e = 0; e < D; e++) dst[e] = (float)oi[(size_t)m * D + e] * sws[m];
        }
}

#endif
