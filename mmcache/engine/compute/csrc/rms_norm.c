/* RMS normalisation of a decoder's hidden states, as the Llama family of transformers computes it
 * (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm):
 *
 *     h = float32(x);  r = 1 / sqrt(mean(h * h) + eps);  out = weight * dtype(h * r)
 *
 * with the last product taken in float32 and rounded once to the input's type (for bfloat16, to nearest even,
 * as torch multiplies two bfloat16 tensors). One pass per row instead of the seven tensor operations (and two
 * float32 copies of the whole input) of the module's own forward.
 *
 * Layout: x and out (rows, cols), rows `stride` elements apart, contiguous within a row; weight (cols); all of
 * one element type, float32 or bfloat16.
 *
 * Invariants: a row's result depends only on that row and the weight (the same bits whatever the number of
 * rows or threads). The sum of squares is taken in float32 in this kernel's own order (four vectors of VL
 * lanes, then across them, see simd.h), which may differ from torch's by an ulp, so a result may differ from the
 * module's own forward in the last bit of a few elements: callers that compare runs bit for bit use the same path
 * on both sides.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

static inline __attribute__((always_inline)) void norm_row(const void *x, const void *w, void *out, int64_t cols,
                                                           float eps, const int dtype) {
    const int64_t body = cols - cols % VL, quad = cols - cols % (4 * VL);
    vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
    for (int64_t c = 0; c < quad; c += 4 * VL)
        for (int j = 0; j < 4; j++) {
            vf h = vf_load(x, c + VL * j, dtype);
            acc[j] = vf_fmadd(h, h, acc[j]);
        }
    for (int64_t c = quad; c < body; c += VL) {
        vf h = vf_load(x, c, dtype);
        acc[0] = vf_fmadd(h, h, acc[0]);
    }
    float sum = vf_sum(vf_add(vf_add(acc[0], acc[1]), vf_add(acc[2], acc[3])));
    for (int64_t c = body; c < cols; c++) {
        float h = scalar_load(x, c, dtype);
        sum += h * h;
    }
    const float r = 1.0f / sqrtf(sum / (float)cols + eps);
    const vf rv = vf_set1(r);
    for (int64_t c = 0; c < body; c += VL) {
        vf y = vf_round(vf_mul(vf_load(x, c, dtype), rv), dtype);
        vf_store(out, c, vf_mul(vf_load(w, c, dtype), y), dtype);
    }
    for (int64_t c = body; c < cols; c++)
        scalar_store(out, c, scalar_load(w, c, dtype) * round_to(scalar_load(x, c, dtype) * r, dtype), dtype);
}

/* Returns 0, or 1 when the arguments are outside what this kernel handles. */
int mmc_rms_norm(int dtype, const void *x, int64_t stride, const void *weight, int64_t rows, int64_t cols,
                 float eps, void *out, int nthreads) {
    if ((dtype != F32 && dtype != BF16) || rows < 0 || cols < 1 || stride < cols || !(eps >= 0.0f)) return 1;
    const int64_t size = dtype == BF16 ? 2 : 4;
    const char *xs = (const char *)x;
    char *os = (char *)out;
    /* Splitting a few rows among threads costs more than it saves. */
    const int threads = rows * cols >= (1 << 16) && nthreads > 1 ? nthreads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        if (dtype == BF16)
            norm_row(xs + i * stride * size, weight, os + i * cols * size, cols, eps, BF16);
        else
            norm_row(xs + i * stride * size, weight, os + i * cols * size, cols, eps, F32);
    }
    return 0;
}
