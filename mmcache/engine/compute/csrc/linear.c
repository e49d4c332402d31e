/* Linear products of a few rows (a decode step's) with a weight laid out once for them, in its own element type:
 *
 *     out[m][n] = sum over k of x[m][k] * w[n][k]  (+ bias[n])
 *
 * x (M, K) float32, rows K apart; w (N, K) float32 or bfloat16 (nn.Linear's layout), laid out by mmc_pack_rows
 * into panels of PW = 2 VL output columns, k-major: panel p holds, for each k, the PW elements w[p PW + c][k]
 * side by side (float32: c in order; bfloat16: in pairs, element 2c column c and 2c + 1 column c + VL, so that
 * one load, a shift and a mask give both vectors exactly), the last panel padded with zeros; bias (N) float32
 * or null; out (M, N) float32.
 *
 * Why: on a CPU whose oneDNN has no bfloat16 path (AVX2 without AVX-512), the engine multiplies bfloat16
 * weights through a float32 copy (kernels.PackedWeight, "widened"), so a decode step would read twice the
 * weight's bytes, and oneDNN's float32 product at one to sixteen rows reads them well under the memory's speed
 * (about 12 of 17-19 GB/s at one row on an AMD Zen 3, less at more rows). Here a step reads the weight's own
 * bytes once, in one stream per panel, and each panel's k-th PW elements meet up to MR input rows while in
 * registers: every multiply-add takes a weight vector already loaded and one input element broadcast, so from
 * a few rows on the product runs at the CPU's multiply-add rate rather than waiting on loads (ahead of oneDNN up
 * to 64 rows on Zen 3, at par or behind from 128: benchmarks/row_products.py). An earlier version read the
 * weight in place, (N, K), as dot products of 4 weight rows with 3 input rows per pass: each multiply-add then
 * loaded its input from L1, and it ran 1.2-1.7x slower at 1-16 rows. Used by the engine where the library is
 * its AVX2 build (kernels.PackedWeight), for float32 weights too.
 *
 * Invariants: out[m][n] depends only on row m of x, row n of w and bias[n], never on M, the other rows, the
 * panel n falls in or the number of threads: one float32 fused multiply-add per k, k ascending from zero (each
 * rounding once), then the bias added. Where x holds widened bfloat16 values (a bfloat16 model's activations),
 * the products themselves are exact in float32.
 */
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define PW (2 * VL)             /* output columns per panel */
#define MR (VL == 16 ? 12 : 6)  /* input rows per pass over a panel: 2 MR accumulators, 2 weight vectors and the
                                 * broadcast input in registers (15 of AVX2's 16, 27 of AVX-512's 32) */
#define FEW 3                   /* at most this many rows: two panels per pass (4 FEW accumulators) */
#define AHEAD 2048              /* bytes of a panel asked of the memory ahead of the multiply-adds (the hardware's
                                 * prefetcher alone kept one stream per core under the memory's speed) */

int mmc_row_panel(void) { return PW; }

/* Where column c of a panel lies within its k-th PW elements. */
static inline int64_t slot(int64_t c, int dtype) { return dtype == BF16 ? (c < VL ? 2 * c : 2 * (c - VL) + 1) : c; }

/* The panels of w (N, K), elements of type T, into out. */
#define PACK(T)                                                                                                 \
    for (int64_t p = 0; p < panels; p++)                                                                        \
        for (int64_t c = 0; c < PW; c++) {                                                                      \
            const int64_t n = p * PW + c;                                                                       \
            T *dst = (T *)out + p * K * PW + slot(c, dtype);                                                    \
            const T *src = (const T *)w + n * K;                                                                \
            for (int64_t k = 0; k < K; k++) dst[k * PW] = n < N ? src[k] : 0;                                   \
        }

/* w (N, K) into panels (ceil(N / PW), K, PW) at out. Returns 0, or 1 for arguments outside what this handles. */
int mmc_pack_rows(int dtype, const void *w, int64_t N, int64_t K, void *out, int nthreads) {
    if ((dtype != F32 && dtype != BF16) || N < 1 || K < 1 || nthreads < 1 || !w || !out) return 1;
    const int64_t panels = (N + PW - 1) / PW;
    if (dtype == BF16) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
        PACK(uint16_t)
    } else {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
        PACK(uint32_t)
    }
    return 0;
}
#undef PACK

/* Rows x[0 .. nx-1] times the panels at p0 and (nv == 4) p1, into o (rows ldo apart; 2 VL columns per panel),
 * the bias b (as many columns, or null) added after each sum. */
static inline __attribute__((always_inline)) void pass(const float *x, int64_t K, const char *p0, const char *p1,
                                                       const int nx, const int nv, float *o, int64_t ldo,
                                                       const float *b, const int dtype) {
    vf acc[MR][4];
    for (int i = 0; i < nx; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = vf_zero();
    const int64_t row = PW * (dtype == BF16 ? 2 : 4); /* bytes of a panel per k */
    for (int64_t k = 0; k < K; k++) {
        vf wv[4];
        _mm_prefetch(p0 + k * row + AHEAD, _MM_HINT_T0);
        if (nv == 4) _mm_prefetch(p1 + k * row + AHEAD, _MM_HINT_T0);
        if (dtype == BF16) {
            vf_load_pairs((const uint16_t *)p0 + k * PW, &wv[0], &wv[1]);
            if (nv == 4) vf_load_pairs((const uint16_t *)p1 + k * PW, &wv[2], &wv[3]);
        } else {
            wv[0] = vf_loadu((const float *)p0 + k * PW), wv[1] = vf_loadu((const float *)p0 + k * PW + VL);
            if (nv == 4)
                wv[2] = vf_loadu((const float *)p1 + k * PW), wv[3] = vf_loadu((const float *)p1 + k * PW + VL);
        }
        for (int i = 0; i < nx; i++) {
            const vf xv = vf_set1(x[i * K + k]);
            for (int j = 0; j < nv; j++) acc[i][j] = vf_fmadd(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < nx; i++)
        for (int j = 0; j < nv; j++)
            vf_storeu(o + i * ldo + j * VL, b ? vf_add(acc[i][j], vf_loadu(b + j * VL)) : acc[i][j]);
}

/* Every row of x against np (1 or 2) panels from pw on, output columns n0 on (those under N written). */
static inline __attribute__((always_inline)) void panels_of(const float *x, int64_t M, int64_t K, const char *pw,
                                                            int64_t psz, const int np, int64_t N, int64_t n0,
                                                            const float *bias, float *out, const int dtype) {
    const int64_t width = N - n0 < np * PW ? N - n0 : np * PW;
    float padded[2 * PW], tmp[MR * 2 * PW];
    const float *b = bias ? bias + n0 : 0;
    if (bias && width < np * PW) { /* the last panel: its bias padded, its columns through tmp */
        memset(padded, 0, sizeof padded);
        memcpy(padded, bias + n0, width * sizeof(float));
        b = padded;
    }
    for (int64_t m = 0; m < M; m += MR) {
        const int nx = M - m < MR ? (int)(M - m) : MR;
        float *o = width == np * PW ? out + m * N + n0 : tmp;
        const int64_t ldo = width == np * PW ? N : np * PW;
        const float *xm = x + m * K;
        if (np == 2) {
            switch (nx) { /* nx <= FEW here */
            case 1: pass(xm, K, pw, pw + psz, 1, 4, o, ldo, b, dtype); break;
            case 2: pass(xm, K, pw, pw + psz, 2, 4, o, ldo, b, dtype); break;
            default: pass(xm, K, pw, pw + psz, 3, 4, o, ldo, b, dtype); break;
            }
        } else {
            switch (nx) { /* nx a constant in each copy */
#define ROWS(r) case r: pass(xm, K, pw, 0, r, 2, o, ldo, b, dtype); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5)
#if MR > 6
            ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11)
#endif
#undef ROWS
            default: pass(xm, K, pw, 0, MR, 2, o, ldo, b, dtype); break;
            }
        }
        if (o == tmp)
            for (int i = 0; i < nx; i++) memcpy(out + (m + i) * N + n0, tmp + i * ldo, width * sizeof(float));
    }
}

static void product(const float *x, int64_t M, int64_t K, const char *w, int64_t N, const float *bias,
                    float *out, int nthreads, const int dtype) {
    const int64_t psz = K * PW * (dtype == BF16 ? 2 : 4), full = N / PW, panels = (N + PW - 1) / PW;
    const int64_t pairs = M <= FEW ? full / 2 : 0, units = pairs + panels - 2 * pairs; /* pairs, then singles */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t u = 0; u < units; u++) {
        if (u < pairs)
            panels_of(x, M, K, w + 2 * u * psz, psz, 2, N, 2 * u * PW, bias, out, dtype);
        else {
            const int64_t p = u + pairs;
            panels_of(x, M, K, w + p * psz, psz, 1, N, p * PW, bias, out, dtype);
        }
    }
}

/* x (M, K) times the panels of w (from mmc_pack_rows, N columns). Returns 0, or 1 when the arguments are
 * outside what this kernel handles. */
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
