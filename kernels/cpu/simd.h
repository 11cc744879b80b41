/* Small SIMD helpers shared by the native CPU kernels (`cpu/native.py`). */
#ifndef HYBRIDSPEC_CPU_SIMD_H
#define HYBRIDSPEC_CPU_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* float32 -> bfloat16, to nearest, ties to even; a NaN stays a (quiet) NaN */
static inline uint32_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* x[2j] and x[2j + 1] (0 past K) as one 32-bit lane of bfloat16 pairs, the low half first: what dpbf16 takes */
static inline uint32_t bf16_pair(const float *x, int64_t j, int64_t K) {
    return bf16_bits(x[2 * j]) | (2 * j + 1 < K ? bf16_bits(x[2 * j + 1]) << 16 : 0);
}

/* a function compiled for AVX-512F, called only where the CPU has it (`hs_rows_isa`) */
#define TARGET512 __attribute__((target("avx512f")))

/* 16-bit weights widened exactly to float32: one value, or 8 / 16 consecutive ones */
static inline float bf16_value(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline float f16_value(uint16_t v) { return _cvtsh_ss(v); }
static inline __m256 f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
TARGET512 static inline __m512 f16x16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* exp: Cody–Waite reduction by ln 2 and a degree-5 minimax polynomial, about
 * 1 ulp; arguments clamped to the float range. The constants, once for exp8
 * and exp16, which run the same steps lane for lane (the same bits). */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504019f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f   /* ln 2 in two parts: v - n ln2 exactly enough */
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P5 1.9875691500e-4f
#define EXP_P4 1.3981999507e-3f
#define EXP_P3 8.3334519073e-3f
#define EXP_P2 4.1665795894e-2f
#define EXP_P1 1.6666665459e-1f
#define EXP_P0 5.0000001201e-1f

/* exp of 8 floats */
static inline __m256 exp8(__m256 v) {
    v = _mm256_max_ps(_mm256_min_ps(v, _mm256_set1_ps(EXP_HI)), _mm256_set1_ps(EXP_LO));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), v);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P5);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P0));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));  /* · 2^n */
}

/* exp of 16 floats: exp8's steps */
TARGET512 static inline __m512 exp16(__m512 v) {
    v = _mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(EXP_HI)), _mm512_set1_ps(EXP_LO));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), v);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P5);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P0));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* the sum of the 8 lanes */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
