/* Element types the C kernels read and write (codes as in native/__init__.py DTYPE_CODES), and
   their conversions to and from float32: bfloat16 rounds to nearest even, as torch does. */

#ifndef ENGINE_NATIVE_DTYPES_H
#define ENGINE_NATIVE_DTYPES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_I8 = 3 };

/* DT_I8 is a KV cache format only (engine/kvcache/kv_dtype.py): a row of D int8 values followed
   by its float16 scale (2 bytes), x_i ~= q_i * scale. Strides of such a cache count bytes. */
#define I8_SCALE_BYTES 2

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

/* Element i of p (dtype dt) as float32. */
static inline float load_f32(int dt, const void *p, int64_t i) {
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == DT_F16) return (float)((const _Float16 *)p)[i];
    return ((const float *)p)[i];
}

/* f stored as element i of p (dtype dt). */
static inline void store_f32(int dt, void *p, int64_t i, float f) {
    if (dt == DT_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(f);
    else if (dt == DT_F16)
        ((_Float16 *)p)[i] = (_Float16)f;
    else
        ((float *)p)[i] = f;
}

/* The float16 scale of the int8 row at byte offset off (D values). */
static inline float i8_row_scale(const void *p, int64_t off, int D) {
    _Float16 s;
    memcpy(&s, (const int8_t *)p + off + D, sizeof s);
    return (float)s;
}

/* x[0..D) stored as an int8 row at byte offset off: scale = fp16(max|x| / 127), q_i =
   round-half-even(x_i / scale) clamped to [-127, 127] (zeros for a zero row): the bits of
   kv_dtype.quantize_int8. */
static inline void store_i8_row(void *p, int64_t off, const float *x, int D) {
    float amax = 0.f;
    for (int i = 0; i < D; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const _Float16 s16 = (_Float16)(amax / 127.f);
    const float s = (float)s16;
    int8_t *q = (int8_t *)p + off;
    for (int i = 0; i < D; i++) {
        float v = s > 0.f ? nearbyintf(x[i] / s) : 0.f;
        v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
        q[i] = (int8_t)v;
    }
    memcpy(q + D, &s16, sizeof s16);
}

/* A row of D elements of a cache of dtype dt at element offset off, written from float32 x. */
static inline void store_row_f32(int dt, void *p, int64_t off, const float *x, int D) {
    if (dt == DT_I8) {
        store_i8_row(p, off, x, D);
        return;
    }
    for (int i = 0; i < D; i++) store_f32(dt, p, off + i, x[i]);
}

#endif
