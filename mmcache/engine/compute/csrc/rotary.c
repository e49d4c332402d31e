/* Rotary position embedding as the Llama family of transformers applies it (apply_rotary_pos_emb):
 *
 *     out = x * cos + rotate_half(x) * sin,   rotate_half(x) = (-x[D/2:], x[:D/2])
 *
 * each product and the sum rounded to the element type in turn, exactly as torch's three elementwise
 * operations round them (bfloat16: each float32 result rounded to nearest even; float32: no fused multiply-add),
 * so the result has the same bits as the module's code. One pass per row instead of six tensor operations and
 * their temporaries.
 *
 * Layout: x (B, H, T, D) and out (B, H, T, D) with any strides in elements over B, H and T (both may be views),
 * contiguous within a row of D; cos and sin (B, T, D), the same strides as each other, contiguous within a row.
 * All of one element type, float32 or bfloat16; D even.
 *
 * Invariants: each output element depends only on its row of x and its row of cos and sin: the same bits in
 * any company and on any number of threads.
 */
#include <stdint.h>

#include "simd.h"

static inline __attribute__((always_inline)) void rotate_row(const void *x, const void *c, const void *s, void *o,
                                                             int64_t D, const int dtype) {
    const int64_t half = D / 2;
    int64_t j = 0;
    if (half % VL == 0)
        for (; j < half; j += VL) {
            const vf x1 = vf_load(x, j, dtype), x2 = vf_load(x, j + half, dtype);
            const vf neg = vf_sub(vf_zero(), x2); /* exact: -x2 */
            const vf a1 = vf_round(vf_mul(x1, vf_load(c, j, dtype)), dtype);
            const vf b1 = vf_round(vf_mul(neg, vf_load(s, j, dtype)), dtype);
            const vf a2 = vf_round(vf_mul(x2, vf_load(c, j + half, dtype)), dtype);
            const vf b2 = vf_round(vf_mul(x1, vf_load(s, j + half, dtype)), dtype);
            vf_store(o, j, vf_add(a1, b1), dtype);
            vf_store(o, j + half, vf_add(a2, b2), dtype);
        }
    for (; j < half; j++) {
        const float x1 = scalar_load(x, j, dtype), x2 = scalar_load(x, j + half, dtype);
        const float a1 = round_to(x1 * scalar_load(c, j, dtype), dtype);
        const float b1 = round_to(-x2 * scalar_load(s, j, dtype), dtype);
        const float a2 = round_to(x2 * scalar_load(c, j + half, dtype), dtype);
        const float b2 = round_to(x1 * scalar_load(s, j + half, dtype), dtype);
        scalar_store(o, j, a1 + b1, dtype);
        scalar_store(o, j + half, a2 + b2, dtype);
    }
}

/* Returns 0, or 1 when the arguments are outside what this kernel handles. Strides in elements: x's and out's
 * over B, H and T (xb, xh, xt; ob, oh, ot), cos's and sin's over B and T (cb, ct). */
int mmc_rotary(int dtype, const void *x, int64_t xb, int64_t xh, int64_t xt, const void *cos, const void *sin,
               int64_t cb, int64_t ct, int64_t B, int64_t H, int64_t T, int64_t D, void *out, int64_t ob, int64_t oh,
               int64_t ot, int nthreads) {
    if ((dtype != F32 && dtype != BF16) || B < 0 || H < 0 || T < 0 || D < 2 || D % 2) return 1;
    const int64_t size = dtype == BF16 ? 2 : 4;
    const char *xs = (const char *)x, *cs = (const char *)cos, *ss = (const char *)sin;
    char *os = (char *)out;
    const int threads = B * H * T * D >= (1 << 16) && nthreads > 1 ? nthreads : 1;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const char *xr = xs + (b * xb + h * xh) * size, *cr = cs + b * cb * size, *sr = ss + b * cb * size;
            char *orow = os + (b * ob + h * oh) * size;
            for (int64_t t = 0; t < T; t++) {
                if (dtype == BF16)
                    rotate_row(xr + t * xt * size, cr + t * ct * size, sr + t * ct * size, orow + t * ot * size, D,
                               BF16);
                else
                    rotate_row(xr + t * xt * size, cr + t * ct * size, sr + t * ct * size, orow + t * ot * size, D,
                               F32);
            }
        }
    return 0;
}
