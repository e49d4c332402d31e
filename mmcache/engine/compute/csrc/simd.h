/* Vector helpers shared by the engine's compiled kernels (decode_attention.c, linear.c, rms_norm.c, rotary.c):
 * a vector `vf` of VL float32 lanes, the CPU's widest (16 with AVX-512 F/VL/DQ/BW, else 8 with AVX2 and FMA), its
 * arithmetic, loads from float32 or bfloat16 (widened exactly) and stores back rounding to nearest even as
 * torch converts; the same for single elements.
 *
 * Every operation is the same float32 operation on each lane on either width, so a kernel written on `vf`
 * computes the same bits on both wherever its order of operations does not depend on VL; where it does (sums
 * across lanes, blocks of VL), each width keeps its own fixed order. */
#ifndef MMC_SIMD_H
#define MMC_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };

#define MMC_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
#define VL 16
typedef __m512 vf;

MMC_INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
MMC_INLINE vf vf_set1(float x) { return _mm512_set1_ps(x); }
MMC_INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
MMC_INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
MMC_INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
MMC_INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); } /* a * b + c, rounded once */
MMC_INLINE vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b, rounded once */
MMC_INLINE vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
MMC_INLINE vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
MMC_INLINE vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
MMC_INLINE vf vf_rint(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); } /* to nearest even */
MMC_INLINE vf vf_scale2(vf x, vf n) { return _mm512_scalef_ps(x, n); } /* x * 2^n, n a whole number */
MMC_INLINE vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
MMC_INLINE void vf_storeu(float *p, vf x) { _mm512_storeu_ps(p, x); }
MMC_INLINE float vf_sum(vf x) { return _mm512_reduce_add_ps(x); }

/* Elements i .. i+VL-1 of p (float32 or bfloat16) as float32. */
MMC_INLINE vf vf_load(const void *p, int64_t i, const int dtype) {
    if (dtype == BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}

/* 2 VL bfloat16 laid out in pairs (element 2c holds column c, element 2c + 1 column c + VL) as float32 columns
 * 0 .. VL-1 (lo) and VL .. 2 VL-1 (hi), exactly: one load, a shift and a mask. */
MMC_INLINE void vf_load_pairs(const void *p, vf *lo, vf *hi) {
    __m512i a = _mm512_loadu_si512(p);
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
    *hi = _mm512_castsi512_ps(_mm512_and_si512(a, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* x rounded to the element type (bfloat16: to nearest even, as torch converts), kept as float32 lanes. */
MMC_INLINE vf vf_round(vf x, const int dtype) {
    if (dtype != BF16) return x;
    __m512i b = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000u)));
}

MMC_INLINE void vf_store(void *p, int64_t i, vf x, const int dtype) {
    if (dtype == BF16) {
        __m512i b = _mm512_castps_si512(vf_round(x, BF16));
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
        return;
    }
    _mm512_storeu_ps((float *)p + i, x);
}

#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;

MMC_INLINE vf vf_zero(void) { return _mm256_setzero_ps(); }
MMC_INLINE vf vf_set1(float x) { return _mm256_set1_ps(x); }
MMC_INLINE vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
MMC_INLINE vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
MMC_INLINE vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
MMC_INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
MMC_INLINE vf vf_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
MMC_INLINE vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
MMC_INLINE vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
MMC_INLINE vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
MMC_INLINE vf vf_rint(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* x * 2^n for whole n in -150 .. 127 and x in [0.5, 2]: in two steps of 2^h and 2^(n-h), h = floor(n / 2), each a
 * normal float32, so that products under 2^-126 come out subnormal as with AVX-512's scalef. */
MMC_INLINE vf vf_scale2(vf x, vf n) {
    __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
    __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(x, a), b);
}
MMC_INLINE vf vf_loadu(const float *p) { return _mm256_loadu_ps(p); }
MMC_INLINE void vf_storeu(float *p, vf x) { _mm256_storeu_ps(p, x); }
MMC_INLINE float vf_sum(vf x) { /* halves, then pairs, then the last two */
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

MMC_INLINE vf vf_load(const void *p, int64_t i, const int dtype) {
    if (dtype == BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

MMC_INLINE void vf_load_pairs(const void *p, vf *lo, vf *hi) { /* as the AVX-512 one */
    __m256i a = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(a, _mm256_set1_epi32((int)0xFFFF0000u)));
}

MMC_INLINE vf vf_round(vf x, const int dtype) {
    if (dtype != BF16) return x;
    __m256i b = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u)));
}

MMC_INLINE void vf_store(void *p, int64_t i, vf x, const int dtype) {
    if (dtype == BF16) {
        __m256i b = _mm256_srli_epi32(_mm256_castps_si256(vf_round(x, BF16)), 16); /* each lane < 2^16 */
        b = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), _MM_SHUFFLE(3, 1, 2, 0)); /* 8 halves in order */
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_castsi256_si128(b));
        return;
    }
    _mm256_storeu_ps((float *)p + i, x);
}

#else
#error "mmcache's compiled kernels need AVX-512 (F, VL, DQ, BW) or AVX2 with FMA"
#endif

/* The same for single elements. */
static inline float scalar_load(const void *p, int64_t i, int dtype) {
    if (dtype == BF16) {
        uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)p)[i];
}

static inline float round_to(float x, int dtype) { /* x rounded to the element type, returned widened */
    if (dtype != BF16) return x;
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline void scalar_store(void *p, int64_t i, float x, int dtype) {
    if (dtype == BF16) {
        uint32_t bits;
        x = round_to(x, dtype);
        memcpy(&bits, &x, sizeof bits);
        ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
        return;
    }
    ((float *)p)[i] = x;
}

/* e^x on VL lanes (decode_attention.c for x <= 0, activation.c for any x): 2^n * e^r with |r| <= ln2 / 2, e^r by
 * its Taylor series to degree `degree`, 7 (relative error ~1e-8) or 5 (~3e-6: enough for probabilities that are
 * rounded to bfloat16, whose own error is ~4e-3); below -104 it is 0, and where 2^n overflows, infinity. */
MMC_INLINE vf vf_exp(vf x, const int degree) {
    x = vf_max(x, vf_set1(-104.0f)); /* e^-104 is 0 in float32 after scaling */
    vf n = vf_rint(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693145751953125f), x);
    r = vf_fnmadd(n, vf_set1(1.428606765330187045e-06f), r);
    vf p = vf_set1(degree >= 7 ? 1.0f / 5040 : 1.0f / 120);
    if (degree >= 7) {
        p = vf_fmadd(p, r, vf_set1(1.0f / 720));
        p = vf_fmadd(p, r, vf_set1(1.0f / 120));
    }
    p = vf_fmadd(p, r, vf_set1(1.0f / 24));
    p = vf_fmadd(p, r, vf_set1(1.0f / 6));
    p = vf_fmadd(p, r, vf_set1(0.5f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    return vf_scale2(p, n);
}

#endif
