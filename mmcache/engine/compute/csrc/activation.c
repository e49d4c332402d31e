/* The gated MLP's activation and product for bfloat16 rows: out = act(gate) * up, element by element,
 *
 *     out[i] = bf16(bf16(silu(gate[i])) * up[i]),   silu(g) = g / (1 + e^-g)
 *
 * rounded to bfloat16 twice as torch's two operations (``act_fn(gate).mul_(up)``) round them, with e^x from
 * simd.h (vf_exp to degree 7, relative error ~1e-8, where torch uses its own vectorised exponential: results
 * may differ from torch's in the last bit of a few elements).
 *
 * Why: torch computes the exponential on vectors, except for the elements past the last whole vector of each
 * thread's share of the tensor, which take the scalar library function; where the shares fall depends on the
 * number of rows, so an element's bits could depend on how many rows were computed with it. Here every element
 * takes the same vector code (a short tail is copied into a whole vector first), so out[i] depends only on
 * gate[i] and up[i]: the engine's row-independent forward (``Engine.whole_hits``) relies on that.
 */
#include <stdint.h>
#include <string.h>

#include "simd.h"

MMC_INLINE vf silu_mul(vf g, vf u) {
    /* e^-g capped at e^88 (float32's largest power of e is ~e^88.7): below g = -88 the quotient is a tiny number
     * (torch's is -0) rather than an overflow, which the AVX2 build's exponent scaling does not represent */
    const vf e = vf_exp(vf_sub(vf_zero(), vf_max(g, vf_set1(-88.0f))), 7);
    const vf s = vf_round(vf_div(g, vf_add(vf_set1(1.0f), e)), BF16);
    return vf_mul(s, u);
}

/* Returns 0, or 1 for arguments outside what this handles. gate, up, out: n bfloat16 elements each (out may be
 * gate or up). */
int mmc_silu_mul(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n, int nthreads) {
    if (!gate || !up || !out || n < 0 || nthreads < 1) return 1;
    const int64_t whole = n / VL * VL;
    const int threads = n >= (1 << 16) && nthreads > 1 ? nthreads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < whole; i += VL)
        vf_store(out, i, silu_mul(vf_load(gate, i, BF16), vf_load(up, i, BF16)), BF16);
    if (whole < n) {
        uint16_t g[VL], u[VL], o[VL];
        memset(g, 0, sizeof g);
        memset(u, 0, sizeof u);
        memcpy(g, gate + whole, (size_t)(n - whole) * sizeof *g);
        memcpy(u, up + whole, (size_t)(n - whole) * sizeof *u);
        vf_store(o, 0, silu_mul(vf_load(g, 0, BF16), vf_load(u, 0, BF16)), BF16);
        memcpy(out + whole, o, (size_t)(n - whole) * sizeof *o);
    }
    return 0;
}
