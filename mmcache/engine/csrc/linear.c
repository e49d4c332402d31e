/* Linear products of a few rows (a decode step's) with a weight read where it lies, in its own element type:
 *
 *     out[m][n] = sum over k of x[m][k] * w[n][k]  (+ bias[n])
 *
 * x (M, K) float32, rows K apart; w (N, K) float32 or bfloat16, rows K apart (nn.Linear's own layout, so a
 * module's weight is read in place); bias (N) float32 or null; out (M, N) float32.
 *
 * Why: on a CPU whose oneDNN has no bfloat16 path (AVX2 without AVX-512), the engine multiplies bfloat16
 * weights through a float32 copy (kernels.PackedWeight, "widened"), so a decode step reads twice the weight's
 * bytes, and oneDNN's float32 product at one to sixteen rows reads them well under the memory's speed (about
 * 12 of 17-19 GB/s at one row on an AMD Zen 3, less at more rows). Here each bfloat16 weight is widened in
 * registers (exactly: a bfloat16 is the upper half of a float32), so a step reads the weight's own two bytes
 * per element once, and every product of the step's rows with a block of weight rows is taken while that
 * block is in L1. Used by the engine where the library is its AVX2 build (kernels.PackedWeight), for float32
 * weights too (also faster there at these row counts); measured by benchmarks/row_products.py.
 *
 * Invariants: out[m][n] depends only on row m of x, row n of w and bias[n], never on M, the other rows or the
 * number of threads: a fixed order of float32 sums (lane j of a vector accumulates k = j, j + VL, j + 2 VL ...
 * by fused multiply-adds, k ascending; the lanes then summed as simd.h's vf_sum does; the K % VL last elements
 * added after, k ascending; the bias last). Each multiply-add rounds once; where x holds widened bfloat16
 * values (a bfloat16 model's activations), the products themselves are exact in float32.
 */
#include <stdint.h>

#include "simd.h"

#define WROWS 4                    /* weight rows per block */
#define AHEAD 2                    /* blocks between the one computed and the one prefetched */
#define XROWS (VL == 16 ? 6 : 3)   /* input rows per pass over a block: WROWS * XROWS accumulators in registers
                                    * (12 of AVX2's 16, with the 4 weight vectors; x is read by the multiply-adds) */

/* Rows x[0 .. nx-1] (nx <= XROWS) times weight rows w[0 .. nw-1] (nw <= WROWS), into o[i][j]. next: the weight
 * rows of a later block (the same nw rows apart), asked of the memory while this one is computed, or null. Rows
 * of 1-2 KB (a 0.5B model's K of 896) are too short for the hardware prefetcher to find each in time: at one
 * row of x, asking two blocks ahead took a (151936, 896) bfloat16 product from 14 to 17.6 GB/s on Zen 3. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t K, const char *w, int64_t wrow,
                                                        const char *next, const int nx, const int nw,
                                                        float o[XROWS][WROWS], const int dtype) {
    vf acc[XROWS][WROWS];
    for (int i = 0; i < nx; i++)
        for (int j = 0; j < nw; j++) acc[i][j] = vf_zero();
    const int64_t body = K - K % VL, size = dtype == BF16 ? 2 : 4, line = 64 / size; /* elements per cache line */
    for (int64_t k = 0; k < body; k += VL) {
        vf wv[WROWS];
        if (next && k % line == 0)
            for (int j = 0; j < nw; j++) _mm_prefetch(next + j * wrow + k * size, _MM_HINT_T0);
        for (int j = 0; j < nw; j++) wv[j] = vf_load(w + j * wrow, k, dtype);
        for (int i = 0; i < nx; i++) {
            const vf xv = vf_loadu(x + i * K + k);
            for (int j = 0; j < nw; j++) acc[i][j] = vf_fmadd(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < nx; i++)
        for (int j = 0; j < nw; j++) {
            float s = vf_sum(acc[i][j]);
            for (int64_t k = body; k < K; k++) s += x[i * K + k] * scalar_load(w + j * wrow, k, dtype);
            o[i][j] = s;
        }
}

/* Weight rows n0 .. n0+nw-1 against every row of x (next: see block; asked for in the first pass only). */
static inline __attribute__((always_inline)) void rows_of(const float *x, int64_t M, int64_t K, const char *w,
                                                          int64_t wrow, const char *next, const int nw,
                                                          const float *bias, float *out, int64_t N, int64_t n0,
                                                          const int dtype) {
    float o[XROWS][WROWS];
    int64_t m = 0;
    for (; m + XROWS <= M; m += XROWS, next = 0) {
        block(x + m * K, K, w, wrow, next, XROWS, nw, o, dtype);
        for (int i = 0; i < XROWS; i++)
            for (int j = 0; j < nw; j++) out[(m + i) * N + n0 + j] = o[i][j] + (bias ? bias[n0 + j] : 0.0f);
    }
    const int rest = (int)(M - m); /* the rows left, in one pass (nx a constant in each copy) */
    switch (rest) {
    case 1: block(x + m * K, K, w, wrow, next, 1, nw, o, dtype); break;
    case 2: block(x + m * K, K, w, wrow, next, 2, nw, o, dtype); break;
#if XROWS > 3
    case 3: block(x + m * K, K, w, wrow, next, 3, nw, o, dtype); break;
    case 4: block(x + m * K, K, w, wrow, next, 4, nw, o, dtype); break;
    case 5: block(x + m * K, K, w, wrow, next, 5, nw, o, dtype); break;
#endif
    default: return;
    }
    for (int i = 0; i < rest; i++)
        for (int j = 0; j < nw; j++) out[(m + i) * N + n0 + j] = o[i][j] + (bias ? bias[n0 + j] : 0.0f);
}

static void product(const float *x, int64_t M, int64_t K, const char *w, int64_t N, const float *bias,
                    float *out, int nthreads, const int dtype) {
    const int64_t wrow = K * (dtype == BF16 ? 2 : 4), blocks = N / WROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t b = 0; b < blocks; b++)
        rows_of(x, M, K, w + b * WROWS * wrow, wrow, b + AHEAD < blocks ? w + (b + AHEAD) * WROWS * wrow : 0,
                WROWS, bias, out, N, b * WROWS, dtype);
    for (int64_t n = blocks * WROWS; n < N; n++) /* the last N % WROWS weight rows one at a time */
        rows_of(x, M, K, w + n * wrow, wrow, 0, 1, bias, out, N, n, dtype);
}

/* Returns 0, or 1 when the arguments are outside what this kernel handles. */
int mmc_linear(int dtype, const float *x, int64_t M, int64_t K, const void *w, int64_t N, const float *bias,
               float *out, int nthreads) {
    if ((dtype != F32 && dtype != BF16) || M < 0 || K < 1 || N < 1 || nthreads < 1) return 1;
    if (M == 0) return 0;
    if (!x || !w || !out) return 1;
    if (dtype == BF16)
        product(x, M, K, (const char *)w, N, bias, out, nthreads, BF16);
    else
        product(x, M, K, (const char *)w, N, bias, out, nthreads, F32);
    return 0;
}
