/* Vector helpers shared by the engine's compiled kernels (decode_attention.c, rms_norm.c): 16 lanes of float32
 * loaded from float32 or bfloat16, and stored back rounding to nearest even as torch converts; the same for
 * single elements. */
#ifndef MMC_SIMD_H
#define MMC_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX512F__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__) || !defined(__AVX512BW__)
#error "mmcache's compiled kernels need AVX-512 (F, VL, DQ, BW)"
#endif

enum { F32 = 0, BF16 = 1 };

static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, const int dtype) {
    if (dtype == BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}

/* x rounded to the element type (bfloat16: to nearest even, as torch converts), kept as 16 float32 lanes. */
static inline __attribute__((always_inline)) __m512 round16(__m512 x, const int dtype) {
    if (dtype != BF16) return x;
    __m512i b = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline __attribute__((always_inline)) void store16(void *p, int64_t i, __m512 x, const int dtype) {
    if (dtype == BF16) {
        __m512i b = _mm512_castps_si512(round16(x, BF16));
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
        return;
    }
    _mm512_storeu_ps((float *)p + i, x);
}

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

#endif
