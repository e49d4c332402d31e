/* Vector helpers shared by the engine's compiled kernels (decode_attention.c, rms_norm.c): 16 lanes of float32
 * loaded from float32 or bfloat16, and stored back rounding to nearest even as torch converts. */
#ifndef MMC_SIMD_H
#define MMC_SIMD_H
#include <immintrin.h>
#include <stdint.h>

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

static inline __attribute__((always_inline)) void store16(void *p, int64_t i, __m512 x, const int dtype) {
    if (dtype == BF16) { /* round to nearest even, as torch's float -> bfloat16 conversion */
        __m512i b = _mm512_castps_si512(x);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        b = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
        return;
    }
    _mm512_storeu_ps((float *)p + i, x);
}

#endif
