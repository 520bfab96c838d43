/* Element types the C kernels read and write (codes as in native/__init__.py DTYPE_CODES), and
   their conversions to and from float32: bfloat16 rounds to nearest even, as torch does. */

#ifndef ENGINE_NATIVE_DTYPES_H
#define ENGINE_NATIVE_DTYPES_H

#include <stdint.h>

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

#endif
