/* The SIMD vocabulary and helpers of the native CPU kernels (`cpu/native.py`): the one file that
 * names x86 intrinsics (tests/kernels/test_cpu_simd.py). */
#ifndef HYBRIDSPEC_CPU_SIMD_H
#define HYBRIDSPEC_CPU_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* -- the vocabulary -----------------------------------------------------------------------------
 * The kernels name vectors and their operations only through what follows, so another ISA is
 * this file alone (as ggml-cpu keeps its intrinsics behind simd-mappings.h). An operation is one
 * intrinsic (a fixed few for the halves of a v16, the reductions, exp and the bfloat16
 * interleave below), so the kernels' chains of roundings stay spelled out in their own code: no
 * operation here fuses, splits or reorders arithmetic, and a second ISA's version must round
 * lane for lane as these do for the kernels to keep their bits. */
#define SIMD_INLINE static inline __attribute__((always_inline))
/* a function compiled for AVX-512F, called only where the CPU has it (`hs_rows_isa`) */
#define TARGET512 __attribute__((target("avx512f")))
/* and for AVX512-BF16 (`hs_bf16_supported`) */
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

typedef __m256 v8;       /* 8 float32 lanes (AVX2) */
typedef __m512 v16;      /* 16 float32 lanes (AVX-512F) */
typedef __m256i v8i;     /* 8 32-bit integer lanes */
typedef __m512i v16i;    /* 16 32-bit integer lanes, or 32 16-bit ones */
typedef __m512bh v16bh;  /* 16 pairs of bfloat16: what dpbf16 takes */
typedef __mmask16 mask16; /* one bit per lane of a v16 */
typedef __mmask32 mask32; /* one bit per 16-bit lane of a v16i */

/* cache hints: fetch into L1 / into L2; order streamed stores before what follows */
SIMD_INLINE void prefetch_l1(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }
SIMD_INLINE void prefetch_l2(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }
SIMD_INLINE void stream_fence(void) { _mm_sfence(); }

/* 8 lanes: unaligned load and store, aligned store, streaming store (32-byte aligned) */
SIMD_INLINE v8 v8_load(const float *p) { return _mm256_loadu_ps(p); }
SIMD_INLINE void v8_store(float *p, v8 a) { _mm256_storeu_ps(p, a); }
SIMD_INLINE void v8_store_aligned(float *p, v8 a) { _mm256_store_ps(p, a); }
SIMD_INLINE void v8_stream(float *p, v8 a) { _mm256_stream_ps(p, a); }
SIMD_INLINE v8 v8_set1(float f) { return _mm256_set1_ps(f); }
/* a in the even lanes, b in the odd ones */
SIMD_INLINE v8 v8_set2(float a, float b) { return _mm256_setr_ps(a, b, a, b, a, b, a, b); }
SIMD_INLINE v8 v8_zero(void) { return _mm256_setzero_ps(); }
SIMD_INLINE float v8_first(v8 a) { return _mm256_cvtss_f32(a); }  /* lane 0 */
SIMD_INLINE v8 v8_add(v8 a, v8 b) { return _mm256_add_ps(a, b); }
SIMD_INLINE v8 v8_sub(v8 a, v8 b) { return _mm256_sub_ps(a, b); }
SIMD_INLINE v8 v8_mul(v8 a, v8 b) { return _mm256_mul_ps(a, b); }
SIMD_INLINE v8 v8_div(v8 a, v8 b) { return _mm256_div_ps(a, b); }
SIMD_INLINE v8 v8_max(v8 a, v8 b) { return _mm256_max_ps(a, b); }
SIMD_INLINE v8 v8_min(v8 a, v8 b) { return _mm256_min_ps(a, b); }
SIMD_INLINE v8 v8_fmadd(v8 a, v8 b, v8 c) { return _mm256_fmadd_ps(a, b, c); }   /* a·b + c, one rounding */
SIMD_INLINE v8 v8_fnmadd(v8 a, v8 b, v8 c) { return _mm256_fnmadd_ps(a, b, c); } /* c − a·b, one rounding */

/* 16 lanes (TARGET512 callers only) */
TARGET512 SIMD_INLINE v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
TARGET512 SIMD_INLINE void v16_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
TARGET512 SIMD_INLINE void v16_stream(float *p, v16 a) { _mm512_stream_ps(p, a); }  /* 64-byte aligned */
/* the lanes of m (the others: 0 when loaded, untouched when stored) */
TARGET512 SIMD_INLINE v16 v16_load_masked(mask16 m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
TARGET512 SIMD_INLINE void v16_store_masked(float *p, mask16 m, v16 a) { _mm512_mask_storeu_ps(p, m, a); }
TARGET512 SIMD_INLINE v16 v16_set1(float f) { return _mm512_set1_ps(f); }
TARGET512 SIMD_INLINE v16 v16_zero(void) { return _mm512_setzero_ps(); }
TARGET512 SIMD_INLINE v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
TARGET512 SIMD_INLINE v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
TARGET512 SIMD_INLINE v16 v16_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
TARGET512 SIMD_INLINE v16 v16_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }  /* a·b + c */
/* the halves of a v16 (lanes 0-7, 8-15), and v16s made of 8-float rows: [p | p], [a | b] */
TARGET512 SIMD_INLINE v8 v16_lo(v16 a) { return _mm512_castps512_ps256(a); }
TARGET512 SIMD_INLINE v8 v16_hi(v16 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }
TARGET512 SIMD_INLINE v16 v16_load_twice(const float *p) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}
TARGET512 SIMD_INLINE v16 v16_load_halves(const float *a, const float *b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                               _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

/* integer lanes: load, broadcast, and, shift left (each lane by n bits), the bits as float32 lanes */
SIMD_INLINE v8i v8i_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
SIMD_INLINE v8i v8i_set1(int a) { return _mm256_set1_epi32(a); }
SIMD_INLINE v8i v8i_and(v8i a, v8i b) { return _mm256_and_si256(a, b); }
SIMD_INLINE v8i v8i_shl(v8i a, int n) { return _mm256_slli_epi32(a, n); }
SIMD_INLINE v8 v8i_bits(v8i a) { return _mm256_castsi256_ps(a); }
TARGET512 SIMD_INLINE v16i v16i_load(const void *p) { return _mm512_loadu_si512(p); }
TARGET512 SIMD_INLINE v16i v16i_load_aligned(const void *p) { return _mm512_load_si512(p); }  /* 64-byte aligned */
TARGET512 SIMD_INLINE v16i v16i_set1(int a) { return _mm512_set1_epi32(a); }
TARGET512 SIMD_INLINE v16i v16i_and(v16i a, v16i b) { return _mm512_and_si512(a, b); }
TARGET512 SIMD_INLINE v16i v16i_shl(v16i a, unsigned n) { return _mm512_slli_epi32(a, n); }
TARGET512 SIMD_INLINE v16 v16i_bits(v16i a) { return _mm512_castsi512_ps(a); }

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

/* 16-bit weights widened exactly to float32: one value, or 8 / 16 consecutive ones */
static inline float bf16_value(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline float f16_value(uint16_t v) { return _cvtsh_ss(v); }
static inline v8 f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
TARGET512 static inline v16 f16x16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline v8 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
TARGET512 static inline v16 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
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
static inline v8 exp8(v8 v) {
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
TARGET512 static inline v16 exp16(v16 v) {
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
static inline float hsum8(v8 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}


/* the lane sums of eight vectors, [hsum8(a[0]), …, hsum8(a[7])]: the same
 * additions in the same order as hsum8 for each (lo + hi halves, then lanes
 * 0 + 2 and 1 + 3, then those two), so a sum's bits do not depend on which
 * seven others it is computed with */
static inline v8 hsum8x8(const v8 *a) {
    /* [lo + hi of a[k] | lo + hi of a[k + 4]] */
    const __m256 s04 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[4], 0x20), _mm256_permute2f128_ps(a[0], a[4], 0x31));
    const __m256 s15 = _mm256_add_ps(_mm256_permute2f128_ps(a[1], a[5], 0x20), _mm256_permute2f128_ps(a[1], a[5], 0x31));
    const __m256 s26 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[6], 0x20), _mm256_permute2f128_ps(a[2], a[6], 0x31));
    const __m256 s37 = _mm256_add_ps(_mm256_permute2f128_ps(a[3], a[7], 0x20), _mm256_permute2f128_ps(a[3], a[7], 0x31));
    /* lanes 0 + 2 and 1 + 3: [y0_0 y1_0 y0_1 y1_1 | y4_0 y5_0 y4_1 y5_1] and likewise for 2, 3, 6, 7 */
    const __m256 t01 = _mm256_add_ps(_mm256_unpacklo_ps(s04, s15), _mm256_unpackhi_ps(s04, s15));
    const __m256 t23 = _mm256_add_ps(_mm256_unpacklo_ps(s26, s37), _mm256_unpackhi_ps(s26, s37));
    /* y_k0 + y_k1, in key order */
    return _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* -- int8 dot products (the quantized products, cpu/quant.c) -----------------------------------
 * 32 int8 or uint8 values in a v8i. A dot product leaves lane i the exact integer sum over bytes
 * 4i … 4i + 3 whichever instructions compute it (AVX2's maddubs and madd, AVX512-VNNI's dpbusd
 * on the same 8 lanes), so the float work that follows sees the same integers on every path. */
#define TARGET_VNNI __attribute__((target("avx512f,avx512vl,avx512vnni")))

/* the low / high nibble of each of 32 bytes */
SIMD_INLINE v8i u8x32_low_nibbles(v8i b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0F)); }
SIMD_INLINE v8i u8x32_high_nibbles(v8i b) {
    return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F));
}
SIMD_INLINE v8i v8i_add(v8i a, v8i b) { return _mm256_add_epi32(a, b); }
SIMD_INLINE v8i v8i_zero(void) { return _mm256_setzero_si256(); }
SIMD_INLINE v8 v8i_to_float(v8i a) { return _mm256_cvtepi32_ps(a); }  /* exact below 2^24 */
/* Σ a·b per lane, a and b int8 in [-127, 127] (a's sign moved onto b: maddubs takes unsigned × signed) */
SIMD_INLINE v8i dot_s8_lanes(v8i a, v8i b) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
/* init + Σ u·s per lane, u uint8, s int8 (no saturation: dpbusd sums in 32 bits) */
TARGET_VNNI SIMD_INLINE v8i dot_u8_lanes_vnni(v8i init, v8i u, v8i s) { return _mm256_dpbusd_epi32(init, u, s); }
/* −Σ c·s per lane, c a uint8 constant, s int8 */
TARGET_VNNI SIMD_INLINE v8i neg_dot_lanes_vnni(uint8_t c, v8i s) {
    return _mm256_sub_epi32(_mm256_setzero_si256(),
                            _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)c), s));
}
/* 512 bits, two blocks of 32 int8 side by side (cpu/quant.c's wide tiles: the low 8 lanes one
 * block's, the high 8 the next block's, each lane the same integer as the 256-bit forms give) */
TARGET_VNNI SIMD_INLINE v16i v16i_from_halves(v8i lo, v8i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
TARGET_VNNI SIMD_INLINE v16i i8x64_offset(v16i a) { return _mm512_xor_si512(a, _mm512_set1_epi8((char)0x80)); }
TARGET_VNNI SIMD_INLINE v16i dot_u8_lanes_vnni16(v16i init, v16i u, v16i s) { return _mm512_dpbusd_epi32(init, u, s); }
TARGET_VNNI SIMD_INLINE v16i neg_dot_lanes_vnni16(uint8_t c, v16i s) {
    return _mm512_sub_epi32(_mm512_setzero_si512(),
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)c), s));
}
TARGET_VNNI SIMD_INLINE v16 v16i_to_float(v16i a) { return _mm512_cvtepi32_ps(a); }  /* exact below 2^24 */
/* lanes 0-7 of lo, then lanes 0-7 of hi */
TARGET_VNNI SIMD_INLINE v16 v16_from_halves(v8 lo, v8 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
/* Q4_K by columns (cpu/quant_q4k.h's k16 tiles), 16 weight rows in the lanes: lanes >> n, & mask, | */
TARGET_VNNI SIMD_INLINE v16i v16i_shr(v16i a, unsigned n) { return _mm512_srli_epi32(a, n); }
TARGET_VNNI SIMD_INLINE v16i v16i_and_bits(v16i a, int mask) { return _mm512_and_si512(a, _mm512_set1_epi32(mask)); }
TARGET_VNNI SIMD_INLINE v16i v16i_or(v16i a, v16i b) { return _mm512_or_si512(a, b); }
/* a · b per lane, the low 32 bits (exact where the product fits) */
TARGET_VNNI SIMD_INLINE v16i v16i_mul(v16i a, v16i b) { return _mm512_mullo_epi32(a, b); }
/* lanes >> n, the sign copied in (Q6_K's int8 scales sign-extended) */
TARGET_VNNI SIMD_INLINE v16i v16i_sra(v16i a, unsigned n) { return _mm512_srai_epi32(a, n); }
/* the low (half 0) or high (half 1) float16 of each lane, widened exactly */
TARGET_VNNI SIMD_INLINE v16 v16_f16_half(v16i a, int half) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(half ? _mm512_srli_epi32(a, 16) : a));
}
/* 16 float16 at p, widened (exact) */
TARGET_VNNI SIMD_INLINE v16 v16_of_f16x16(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* the 4 bytes at p in every lane of 16 */
TARGET_VNNI SIMD_INLINE v16i i8x4_broadcast16(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}
/* lanes 0-7: a[k], lanes 8-15: a[k + 1] */
TARGET_VNNI SIMD_INLINE v16 v16_pair_broadcast(v8 a, int k) {
    const int h = k + 1;
    return _mm512_permutexvar_ps(_mm512_set_epi32(h, h, h, h, h, h, h, h, k, k, k, k, k, k, k, k),
                                 _mm512_castps256_ps512(a));
}
/* int8 values as uint8 ones 128 higher (x ^ 0x80) */
SIMD_INLINE v8i i8x32_offset(v8i a) { return _mm256_xor_si256(a, _mm256_set1_epi8((char)0x80)); }
/* -- rounding activations to int8 (the quantized products' `quantize_rows`) ------------------- */
/* |a| (the sign bit cleared) */
SIMD_INLINE v8 v8_abs(v8 a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
/* the largest of the 8 lanes (max is exact: any order gives the same value) */
static inline float hmax8(v8 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* roundf lane by lane, halves away from zero: the truncation t, plus ±1 where |a − t| >= 0.5 (a − t
 * and t ± 1 exact for |a| < 2^23; larger floats are integers already) */
SIMD_INLINE v8 v8_round_half_away(v8 a) {
    const __m256 t = _mm256_round_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(v8_abs(_mm256_sub_ps(a, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(a, _mm256_set1_ps(-0.0f)));
    return _mm256_add_ps(t, _mm256_and_ps(up, one));
}
/* 32 integers in [-128, 127] held by 4 vectors of floats (a's first) -> 32 int8 in order */
SIMD_INLINE v8i i8x32_from_floats(v8 a, v8 b, v8 c, v8 d) {
    const __m256i ab = _mm256_packs_epi32(_mm256_cvttps_epi32(a), _mm256_cvttps_epi32(b));
    const __m256i cd = _mm256_packs_epi32(_mm256_cvttps_epi32(c), _mm256_cvttps_epi32(d));
    /* packs interleave 128-bit halves: [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7] as 4-byte groups */
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
SIMD_INLINE void v8i_store(void *p, v8i a) { _mm256_storeu_si256((__m256i *)p, a); }
/* scale times the sums of each 4 of 32 int8 (bytes 4i … 4i + 3 in lane i), exact */
SIMD_INLINE v8i i8x32_lane_sums(v8i a, int16_t scale) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), a), _mm256_set1_epi16(scale));
}
/* the sum of the 8 integer lanes */
static inline int32_t v8i_hsum(v8i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

/* the sums of a's 8 lanes (lane 0) and of b's (lane 1); the other lanes hold partial sums */
SIMD_INLINE v8i v8i_pair_totals(v8i a, v8i b) {
    v8i t = _mm256_hadd_epi32(a, b);
    t = _mm256_hadd_epi32(t, t);
    return _mm256_add_epi32(t, _mm256_permute2x128_si256(t, t, 0x01));
}

/* Q4_0 by columns (cpu/quant_q4_0.h's tile_q4): the 16 nibble bytes at p[0] … p[7] (8 weight rows'
 * blocks) as 4 vectors whose lane c holds bytes 4g … 4g + 3 of p[c] (out[g]): a 4 × 4 transpose of
 * 32-bit words in each half, rows c and c + 4 sharing a vector */
SIMD_INLINE void u32x8_transposed16(const uint8_t *const p[8], v8i out[4]) {
    __m256i v[4];
    for (int c = 0; c < 4; ++c)
        v[c] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p[c])),
                                       _mm_loadu_si128((const __m128i *)p[c + 4]), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}
/* the same for 16 weight rows in 512-bit vectors (the 16-column tiles of cpu/quant_q4k.h and
 * quant_q6k.h): lane c of out[g] dword g of the 16 bytes at p[c] */
TARGET_VNNI SIMD_INLINE void u32x16_transposed16(const uint8_t *const p[16], v16i out[4]) {
    v8i lo[4], hi[4];
    u32x8_transposed16(p, lo);
    u32x8_transposed16(p + 8, hi);
    for (int g = 0; g < 4; ++g) out[g] = v16i_from_halves(lo[g], hi[g]);
}
/* the 4 bytes at p in every lane */
SIMD_INLINE v8i i8x4_broadcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}
/* acc + Σ u·s per lane, u in 0..15, s int8 (AVX2: pairs in 16 bits, then madd by ones) */
SIMD_INLINE v8i dot_u4_lanes_acc(v8i acc, v8i u, v8i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* Q6_K (cpu/quant_q6k.h). The bytes of a 16-bit shift by `shift` (positive: left, negative: right;
 * bits cross into the neighbouring byte, so callers mask) */
SIMD_INLINE v8i u8x32_shifted16(v8i a, int shift) {
    return shift > 0 ? _mm256_slli_epi16(a, shift) : shift < 0 ? _mm256_srli_epi16(a, -shift) : a;
}
/* nibbles (0..15 in each byte) | (high & 0x30): a 6-bit value from its low nibble and its two high bits */
SIMD_INLINE v8i u8x32_six_bits_or(v8i nibbles, v8i high) {
    return _mm256_or_si256(nibbles, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
}
/* 8 int8 -> 8 32-bit lanes, each the int16 value in both halves (madd's scale pairs) */
SIMD_INLINE v8i i16_pairs_of_i8x8(const int8_t *p) {
    const __m256i x = _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                                       _mm256_set1_epi32(0xFFFF));
    return _mm256_or_si256(x, _mm256_slli_epi32(x, 16));
}
/* [a[k] × 4 | a[k + 1] × 4]: lanes k and k + 1 spread over the low and the high half */
SIMD_INLINE v8i v8i_pair_spread(v8i a, int k) {
    return _mm256_permutevar8x32_epi32(a, _mm256_setr_epi32(k, k, k, k, k + 1, k + 1, k + 1, k + 1));
}
/* 16 int8 at p times m, as 16 int16 (exact where |m| · 128 fits: Q6_K's −32 · its scales) */
SIMD_INLINE v8i i16x16_times_of_i8x16(const int8_t *p, int16_t m) {
    return _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), _mm256_set1_epi16(m));
}
/* 512 bits, two Q6_K chunks of 32 side by side (the low 8 lanes one chunk's, the high 8 the next's) */
/* [qh | qh >> 2] from 32 bytes of qh: in each byte, bits 0-1 and 4-5 those of chunks 4h, 4h + 2 in
 * the low half, of 4h + 1, 4h + 3 in the high half (32-bit shifts: callers mask bytes) */
TARGET_VNNI SIMD_INLINE v16i u8x64_qh_twice(const uint8_t *qh) {
    return _mm512_srlv_epi32(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh)),
                             _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0));
}
TARGET_VNNI SIMD_INLINE v16i v16i_shifted_left32(v16i a, int shift) { return _mm512_slli_epi32(a, shift); }
TARGET_VNNI SIMD_INLINE v16i u8x64_low_nibbles(v16i b) { return _mm512_and_si512(b, _mm512_set1_epi8(0x0F)); }
TARGET_VNNI SIMD_INLINE v16i u8x64_high_nibbles(v16i b) {
    return _mm512_and_si512(_mm512_srli_epi32(b, 4), _mm512_set1_epi8(0x0F));
}
/* nibbles | (high & 0x30), one ternary logic op (A | (B & C): table 0xF8) */
TARGET_VNNI SIMD_INLINE v16i u8x64_six_bits_or(v16i nibbles, v16i high) {
    return _mm512_ternarylogic_epi32(nibbles, high, _mm512_set1_epi8(0x30), 0xF8);
}
/* 16 int8 -> 16 32-bit lanes, the int16 value in the low half over a zero high half: dpwssd then
 * multiplies the other operand's high half by 0 */
TARGET_VNNI SIMD_INLINE v16i i16_lanes_of_i8x16(const int8_t *p) {
    return _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)), _mm512_set1_epi32(0xFFFF));
}
/* [a[k] × 4 | a[k + 1] × 4 | a[k + 2] × 4 | a[k + 3] × 4] */
TARGET_VNNI SIMD_INLINE v16i v16i_quad_spread(v16i a, int k) {
    return _mm512_permutexvar_epi32(_mm512_set_epi32(k + 3, k + 3, k + 3, k + 3, k + 2, k + 2, k + 2, k + 2,
                                                     k + 1, k + 1, k + 1, k + 1, k, k, k, k), a);
}
/* acc + Σ a·b over each lane's two 16-bit halves (dpwssd) */
TARGET_VNNI SIMD_INLINE v16i dot_i16_lanes_vnni16(v16i acc, v16i a, v16i b) { return _mm512_dpwssd_epi32(acc, a, b); }
TARGET_VNNI SIMD_INLINE v16i v16i_add(v16i a, v16i b) { return _mm512_add_epi32(a, b); }
TARGET_VNNI SIMD_INLINE v16i v16i_zero(void) { return _mm512_setzero_si512(); }
/* the low 8 lanes plus the high 8, lane by lane */
TARGET_VNNI SIMD_INLINE v8i v16i_fold(v16i a) {
    return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
}

/* Q4_K (cpu/quant_q4k.h's tile_k): a super-block's 6-bit scales and mins decoded in vectors, two
 * super-blocks at a time (one per 128-bit half), and each sub-block's scale (or, AVX512-VNNI, each
 * two sub-blocks' scales) in every lane by one shuffle. */
/* 16 bytes at lo and 16 at hi: the low and high 128 bits */
SIMD_INLINE v8i u8x32_load_halves(const uint8_t *lo, const uint8_t *hi) {
    return _mm256_loadu2_m128i((const __m128i *)hi, (const __m128i *)lo);
}
/* 16 bytes into both halves */
SIMD_INLINE v8i u8x32_load_twice(const void *p) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
}
/* each half's first 12 bytes, Q4_K's packed scales and mins q (ggml's get_scale_min_k4) -> the 8
 * scales in bytes 0-7, the 8 mins in 8-15: sc_i = q_i & 63, mn_i = q_{i+4} & 63, sc_{i+4} =
 * (q_{i+8} & 15) | (q_i >> 6) << 4, mn_{i+4} = (q_{i+8} >> 4) | (q_{i+4} >> 6) << 4 (i < 4; 16-bit
 * shifts, then byte masks: no bit crosses a byte) */
SIMD_INLINE v8i u8x32_k_scales_mins(v8i q) {
    const v8i a = _mm256_shuffle_epi8(q, _mm256_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11,
                                                          0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const v8i b = _mm256_shuffle_epi8(q, _mm256_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7,
                                                          -1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const v8i low = _mm256_and_si256(a, _mm256_setr_epi64x(0x0F0F0F0F3F3F3F3FLL, 0x3F3F3F3FLL,
                                                           0x0F0F0F0F3F3F3F3FLL, 0x3F3F3F3FLL));
    const v8i nib = _mm256_and_si256(_mm256_srli_epi16(a, 4), _mm256_setr_epi64x(0, 0x0F0F0F0F00000000LL,
                                                                               0, 0x0F0F0F0F00000000LL));
    const v8i top = _mm256_and_si256(_mm256_srli_epi16(b, 2), _mm256_set1_epi64x(0x3030303000000000LL));
    return _mm256_or_si256(_mm256_or_si256(low, nib), top);
}
/* half `half` (0 or 1) of a into both halves */
SIMD_INLINE v8i u8x32_half_twice(v8i a, int half) {
    return half ? _mm256_permute4x64_epi64(a, 0xEE) : _mm256_permute4x64_epi64(a, 0x44);
}
/* byte k of each half (a scale, 0 <= k < 8) as a 16-bit value in all 16 lanes (what madd multiplies
 * the sub-block's pairs by) */
SIMD_INLINE v8i u8x32_k_scale16(v8i sm, int k) {
    const char z = -1;
    return _mm256_shuffle_epi8(sm, _mm256_setr_epi8(k, z, k, z, k, z, k, z, k, z, k, z, k, z, k, z,
                                                    k, z, k, z, k, z, k, z, k, z, k, z, k, z, k, z));
}
/* each half's scales (bytes 0-7) as 16-bit values: dword p of the half (s_2p | s_2p+1 << 16), p < 4 */
SIMD_INLINE v8i u8x32_k_scale_duos(v8i sm) { return _mm256_unpacklo_epi8(sm, _mm256_setzero_si256()); }
/* each half's mins (bytes 8-15) as 8 16-bit values */
SIMD_INLINE v8i u8x32_k_mins16(v8i sm) { return _mm256_unpackhi_epi8(sm, _mm256_setzero_si256()); }
/* Σ a·b over each half's 8 16-bit lanes (exact: each product and the sum fit 32 bits), in every
 * 32-bit lane of the half */
SIMD_INLINE v8i i16x16_half_dots(v8i a, v8i b) {
    const __m256i p = _mm256_madd_epi16(a, b), q = _mm256_add_epi32(p, _mm256_shuffle_epi32(p, 0x4E));
    return _mm256_add_epi32(q, _mm256_shuffle_epi32(q, 0xB1));
}
/* 8 float16 values at p (as uint16) with a second pair: [p0, p1, q0, q1, 0, 0, 0, 0] widened exactly */
SIMD_INLINE v8 f16x4_pairs(const uint8_t *p, const uint8_t *q) {
    int32_t a, b;
    memcpy(&a, p, sizeof a);
    memcpy(&b, q, sizeof b);
    return _mm256_cvtph_ps(_mm_setr_epi32(a, b, 0, 0));
}
/* lanes 0 and 1: a[i0], a[i1] (and so on repeated) */
SIMD_INLINE v8 v8_pick2(v8 a, int i0, int i1) {
    return _mm256_permutevar8x32_ps(a, _mm256_setr_epi32(i0, i1, i0, i1, i0, i1, i0, i1));
}
/* lanes 0-3: a[lo], lanes 4-7: a[hi] */
SIMD_INLINE v8 v8_halves_of(v8 a, int lo, int hi) {
    return _mm256_permutevar8x32_ps(a, _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi));
}
/* Q4_K by columns on AVX2 (cpu/quant_q4k.h's k8 tiles), 8 weight rows in the lanes: lanes >> n, & mask, | */
SIMD_INLINE v8i v8i_shr(v8i a, int n) { return _mm256_srli_epi32(a, n); }
SIMD_INLINE v8i v8i_and_bits(v8i a, int mask) { return _mm256_and_si256(a, _mm256_set1_epi32(mask)); }
SIMD_INLINE v8i v8i_or(v8i a, v8i b) { return _mm256_or_si256(a, b); }
/* the low (half 0) or high (half 1) float16 of each lane, widened exactly */
SIMD_INLINE v8 v8_f16_half(v8i a, int half) {
    const __m256i h = half ? _mm256_srli_epi32(a, 16) : _mm256_and_si256(a, _mm256_set1_epi32(0xFFFF));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08); /* lanes 0-3, 4-7 low */
    return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}
/* per 16-bit lane u·s summed over its 2 bytes (u in 0..15, s int8 within ±127: within ±3810, no
 * saturation), and those added lane by lane in 16 bits (the callers keep sums within ±2^15) */
SIMD_INLINE v8i u4_i8_pair_sums(v8i u, v8i s) { return _mm256_maddubs_epi16(u, s); }
SIMD_INLINE v8i v8i_add16(v8i a, v8i b) { return _mm256_add_epi16(a, b); }
/* per 32-bit lane a.lo · b.lo + a.hi · b.hi of the 16-bit halves (exact) */
SIMD_INLINE v8i i16_pair_dots(v8i a, v8i b) { return _mm256_madd_epi16(a, b); }
/* scale · Σ u·s per lane, u in 0..63 (pair sums within ±16002: no saturation), s int8, the scale (an
 * int8 value) in every 16-bit lane of scale16 */
SIMD_INLINE v8i dot_u4_vscaled_lanes(v8i u, v8i s, v8i scale16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale16);
}
/* 512 bits (AVX512-VNNI's Q4_K tiles): 64 bytes of two chunks of nibbles, the low nibbles, and the
 * high ones times 16 (the byte with its low nibble cleared) */
TARGET_VNNI SIMD_INLINE v16i u8x64_high_nibbles16(v16i b) {
    return _mm512_and_si512(b, _mm512_set1_epi32((int)0xF0F0F0F0u));
}
/* acc + Σ over each lane's 4 bytes of sa·ua·xa + sb·ub·xb (ua in 0..15, ub16 = 16 · ub with ub in 0..15,
 * xa, xb int8, each lane of duo sa | sb << 16, 0 <= sa, sb < 64), with three dot-product instructions
 * for the two sub-blocks (each half of the vectors its own pair a, b): the lane sums 16 · Db of
 * ub16·xb (dpbusd does not saturate) and Da of ua·xa (|D| <= 4 · 15 · 128 < 8192) packed as the
 * 16-bit halves of one lane, (Db << 16) + 8192 + Da (the low half 8192 + Da >= 0: no borrow from the
 * high one), and dpwssd multiplies the halves by sa and sb: the exact integer plus 8192 · sa, which
 * the caller takes out once (acc starting from −8192 · Σ sa) */
TARGET_VNNI SIMD_INLINE v16i dot_u4x2_scaled_lanes_vnni16(v16i acc, v16i ua, v16i ub16, v16i xa, v16i xb, v16i duo) {
    const v16i db16 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ub16, xb);
    const v16i packed = _mm512_or_si512(_mm512_slli_epi32(db16, 12), _mm512_set1_epi32(8192)); /* (Db << 16) + 8192 */
    const v16i both = _mm512_dpbusd_epi32(packed, ua, xa);
    return _mm512_dpwssd_epi32(acc, both, duo);
}
/* −8192 · the low 16-bit halves of the lanes of duo0 and of duo1, summed per lane: where sums of
 * `dot_u4x2_scaled_lanes_vnni16` with those pairs start (their halves added at the end) */
TARGET_VNNI SIMD_INLINE v16i k_bias_start_vnni16(v16i duo0, v16i duo1) {
    const v16i bias = _mm512_set1_epi32(-8192 & 0xFFFF); /* (−8192, 0) */
    return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), bias, duo0), bias, duo1);
}
/* lanes k0 (the low 8) and k1 (the high 8) of a */
TARGET_VNNI SIMD_INLINE v16i v16i_lanes_of(v8i a, int k0, int k1) {
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(k0, k0, k0, k0, k0, k0, k0, k0, k1, k1, k1, k1, k1, k1, k1, k1),
                                    _mm512_castsi256_si512(a));
}
/* the low and high 8 integer lanes */
TARGET_VNNI SIMD_INLINE v8i v16i_lo(v16i a) { return _mm512_castsi512_si256(a); }
TARGET_VNNI SIMD_INLINE v8i v16i_hi(v16i a) { return _mm512_extracti64x4_epi64(a, 1); }

/* -- bfloat16 dot products (AVX512-BF16, TARGET_BF16 callers only) -------------------------- */

/* one 32-bit pair of bfloat16 values (bf16_pair) in every lane */
TARGET_BF16 SIMD_INLINE v16bh v16bh_set1(int pair) { return (v16bh)_mm512_set1_epi32(pair); }
/* acc + a[2i]·b[2i] + a[2i + 1]·b[2i + 1] in lane i (b: 32 bfloat16 values as a v16i) */
TARGET_BF16 SIMD_INLINE v16 v16_dot_bf16(v16 acc, v16bh a, v16i b) { return _mm512_dpbf16_ps(acc, a, (v16bh)b); }

/* 64 columns (the first `cols` of them; the rest zero) of bfloat16 weight rows r0 and r1 (r1 NULL:
 * zeros) interleaved into 4 vectors of 16 pairs, columns in order: what v16_dot_bf16 takes as b */
TARGET_BF16 static inline void bf16_interleave64(const uint16_t *r0, const uint16_t *r1, int64_t cols, v16i out[4]) {
    const mask32 lo = cols >= 32 ? ~(mask32)0 : (mask32)((1ull << cols) - 1);
    const mask32 hi = cols >= 64 ? ~(mask32)0 : cols <= 32 ? 0 : (mask32)((1ull << (cols - 32)) - 1);
    const v16i zero = _mm512_setzero_si512();
    const v16i a0 = _mm512_maskz_loadu_epi16(lo, r0), a1 = _mm512_maskz_loadu_epi16(hi, r0 + 32);
    const v16i b0 = r1 ? _mm512_maskz_loadu_epi16(lo, r1) : zero;
    const v16i b1 = r1 ? _mm512_maskz_loadu_epi16(hi, r1 + 32) : zero;
    /* word 2i of the result: a's word base + i; word 2i + 1: b's (index 32 + base + i) */
    const v16i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const v16i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    out[0] = _mm512_permutex2var_epi16(a0, first, b0);
    out[1] = _mm512_permutex2var_epi16(a0, second, b0);
    out[2] = _mm512_permutex2var_epi16(a1, first, b1);
    out[3] = _mm512_permutex2var_epi16(a1, second, b1);
}

#endif
