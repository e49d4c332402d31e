/* Paged decode attention for x86 CPUs with AVX-512 or AVX2 (vectors of VL lanes, simd.h): one query token per
 * sequence, its keys and values read where they lie in the page pool (no gather, no padding, no mask). Also, on
 * CPUs with AMX tiles or AVX-512 BF16, the attention of a bfloat16 prefill chunk over its cached prefix and its
 * own keys (mmc_chunk_attention, near the end of this file).
 *
 * Built and loaded at run time by mmcache/engine/compute/native.py; the engine falls back to ATen when this
 * file cannot be compiled (no C compiler, neither AVX-512 nor AVX2 with FMA).
 *
 * Layout (all contiguous, element type float32 or bfloat16 alike for q, the pools and out):
 *   q      (n, H, G, D)     queries grouped by KV head: G query heads read KV head h
 *   k, v   (H, P, S, D)     one layer's key or value pool: H KV heads, P pages of S slots
 *   table  (n, T) int64     each sequence's page ids, position t in page table[j][t / S] at slot t % S
 *   lo, hi (n) int64        sequence j attends to positions lo[j] .. hi[j] - 1 (hi > lo)
 *   out    (n, H, G, D)
 *
 * Invariants: the result for (sequence j, KV head h) depends only on q[j, h], its pages and lo[j], hi[j]: the
 * same bits whatever else the call holds, and the same bits on every run. Arithmetic is float32 throughout
 * (bfloat16 inputs are widened exactly); probabilities are not rounded to bfloat16. Scores go through a
 * two-pass softmax (all scores, then their maximum, then exp), so no running rescale is needed.
 *
 * Scores of bfloat16 keys run on the tile unit (AMX) in blocks of 16 keys where the CPU has it and Linux grants
 * it (mmc_init), and on the vector unit otherwise and for the keys left over; the weighted sum of the values
 * always runs on the vector unit.
 */
#define _GNU_SOURCE /* syscall() */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#define MAX_G 16   /* query rows per KV head */
#define MAX_D 512  /* head dimension, a multiple of 16 */
#define MIX_ROWS (VL == 16 ? 7 : 3) /* query rows per block of the weighted sum of values (at most 7) */

#if VL == 16
/* a[0..7] -> the eight sums of their 16 lanes, in order. */
static inline __m256 sum8(const __m512 *a) {
    __m512 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 f = _mm512_add_ps(e, _mm512_shuffle_f32x4(e, e, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps256(_mm512_shuffle_f32x4(f, f, _MM_SHUFFLE(0, 0, 2, 0)));
}

/* The same on 8 lanes, to degree 7 (the upper lanes are computed and dropped). */
static inline __m256 exp8(__m256 x) { return _mm512_castps512_ps256(vf_exp(_mm512_castps256_ps512(x), 7)); }
#else
/* a[0..7] -> the eight sums of their 8 lanes, in order. */
static inline __m256 sum8(const __m256 *a) {
    __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 b2 = _mm256_hadd_ps(a[4], a[5]), b3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3); /* a[0..3] in each half, then a[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

static inline __m256 exp8(__m256 x) { return vf_exp(x, 7); }
#endif

/* Scores of `count` consecutive key rows against G query rows, one row of GP floats each (the query's scores
 * in columns 0 .. G-1, zeros after). The general form: any D, the query rows read from L1 for every key. */
static inline __attribute__((always_inline)) void score_keys(const void *q, const float *qf, const int G,
                                                             int D, const char *krow, int64_t count,
                                                             float scale, float *s, const int dtype) {
    const int GP = G <= 8 ? 8 : 16;
    const size_t stride = (size_t)D * (dtype == BF16 ? 2 : 4);
    for (int64_t i = 0; i < count; i++, krow += stride, s += GP) {
        vf acc[MAX_G];
        for (int g = 0; g < GP; g++) acc[g] = vf_zero();
#if defined(__AVX512BF16__)
        if (dtype == BF16) { /* bfloat16 pairs multiplied and summed in float32 */
            for (int d = 0; d < D; d += 32) {
                const __mmask32 m = D - d >= 32 ? 0xFFFFFFFFu : 0xFFFFu; /* D is a multiple of 16 */
                __m512bh kc = (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)krow + d);
                for (int g = 0; g < G; g++) {
                    __m512bh qc = (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)q + g * D + d);
                    acc[g] = _mm512_dpbf16_ps(acc[g], qc, kc);
                }
            }
        } else
#endif
        {
            (void)q;
            for (int d = 0; d < D; d += VL) {
                vf kc = vf_load(krow, d, dtype);
                for (int g = 0; g < G; g++) acc[g] = vf_fmadd(vf_loadu(qf + g * D + d), kc, acc[g]);
            }
        }
        for (int h = 0; h < GP; h += 8) _mm256_storeu_ps(s + h, _mm256_mul_ps(sum8(acc + h), _mm256_set1_ps(scale)));
    }
}

#if defined(__AVX512BF16__)
/* The same for bfloat16 at D = 64 and G <= 8 (the common decoder shape): the query rows stay in registers. */
static inline __attribute__((always_inline)) void score_keys_d64(const uint16_t *q, const int G, const char *krow,
                                                                 int64_t count, float scale, float *s) {
    __m512bh q0[8], q1[8];
    for (int g = 0; g < G; g++) {
        q0[g] = (__m512bh)_mm512_loadu_si512(q + g * 64);
        q1[g] = (__m512bh)_mm512_loadu_si512(q + g * 64 + 32);
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < count; i++, krow += 128, s += 8) {
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(krow), k1 = (__m512bh)_mm512_loadu_si512(krow + 64);
        __m512 acc[8];
        for (int g = 0; g < 8; g++) acc[g] = _mm512_setzero_ps();
        for (int g = 0; g < G; g++) acc[g] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[g], q0[g], k0), q1[g], k1);
        _mm256_storeu_ps(s, _mm256_mul_ps(sum8(acc), sc));
    }
}
#endif

typedef void (*score_fn)(const void *q, const float *qf, int D, const char *krow, int64_t count, float scale,
                         float *s);

#define SCORE_FNS(Gc)                                                                                        \
    static void score_f32_##Gc(const void *q, const float *qf, int D, const char *k, int64_t n, float c,      \
                               float *s) { score_keys(q, qf, Gc, D, k, n, c, s, F32); }                       \
    static void score_bf16_##Gc(const void *q, const float *qf, int D, const char *k, int64_t n, float c,     \
                                float *s) { score_keys(q, qf, Gc, D, k, n, c, s, BF16); }
SCORE_FNS(1) SCORE_FNS(2) SCORE_FNS(3) SCORE_FNS(4) SCORE_FNS(5) SCORE_FNS(6) SCORE_FNS(7) SCORE_FNS(8)
SCORE_FNS(9) SCORE_FNS(10) SCORE_FNS(11) SCORE_FNS(12) SCORE_FNS(13) SCORE_FNS(14) SCORE_FNS(15) SCORE_FNS(16)
#undef SCORE_FNS
static const score_fn SCORE_F32[MAX_G + 1] = {0, score_f32_1, score_f32_2, score_f32_3, score_f32_4,
    score_f32_5, score_f32_6, score_f32_7, score_f32_8, score_f32_9, score_f32_10, score_f32_11, score_f32_12,
    score_f32_13, score_f32_14, score_f32_15, score_f32_16};
static const score_fn SCORE_BF16[MAX_G + 1] = {0, score_bf16_1, score_bf16_2, score_bf16_3, score_bf16_4,
    score_bf16_5, score_bf16_6, score_bf16_7, score_bf16_8, score_bf16_9, score_bf16_10, score_bf16_11,
    score_bf16_12, score_bf16_13, score_bf16_14, score_bf16_15, score_bf16_16};

#if defined(__AVX512BF16__)
#define SCORE_D64(Gc)                                                                                        \
    static void score_d64_##Gc(const void *q, const float *qf, int D, const char *k, int64_t n, float c,      \
                               float *s) { (void)qf; (void)D; score_keys_d64((const uint16_t *)q, Gc, k, n, c, s); }
SCORE_D64(1) SCORE_D64(2) SCORE_D64(3) SCORE_D64(4) SCORE_D64(5) SCORE_D64(6) SCORE_D64(7) SCORE_D64(8)
#undef SCORE_D64
static const score_fn SCORE_BF16_D64[9] = {0, score_d64_1, score_d64_2, score_d64_3, score_d64_4, score_d64_5,
                                           score_d64_6, score_d64_7, score_d64_8};
#endif

/* out rows g0 .. g0+NG-1, dims d0 .. d0+VL*NC-1: the sum over positions of p[t][g] v[t][d], divided by l[g]. */
static inline __attribute__((always_inline)) void mix_block(const float *p, int GP, int g0, const int NG,
                                                            int64_t d0, const int NC, const char *v, int64_t D,
                                                            int64_t S, const int64_t *pages, int64_t lo,
                                                            int64_t hi, const float *l, void *out, const int dtype) {
    const size_t esize = dtype == BF16 ? 2 : 4;
    vf acc[7][4];
    for (int i = 0; i < NG; i++)
        for (int c = 0; c < NC; c++) acc[i][c] = vf_zero();
    const float *pt = p + g0;
    for (int64_t t = lo; t < hi;) {
        int64_t page = pages[t / S], off = t % S, end = hi - t < S - off ? hi : t + (S - off);
        const char *row = v + ((page * S + off) * D + d0) * esize;
        for (; t < end; t++, pt += GP, row += D * esize) {
            for (int c = 0; c < NC; c++) {
                vf vc = vf_load(row, VL * c, dtype);
                for (int i = 0; i < NG; i++) acc[i][c] = vf_fmadd(vf_set1(pt[i]), vc, acc[i][c]);
            }
        }
    }
    for (int i = 0; i < NG; i++) {
        vf inv = vf_set1(1.0f / l[g0 + i]);
        for (int c = 0; c < NC; c++) vf_store(out, (g0 + i) * D + d0 + VL * c, vf_mul(acc[i][c], inv), dtype);
    }
}

typedef void (*mix_fn)(const float *p, int GP, int g0, int64_t d0, const char *v, int64_t D, int64_t S,
                       const int64_t *pages, int64_t lo, int64_t hi, const float *l, void *out);

#define MIX_FN(NG, NC)                                                                                       \
    static void mix_f32_##NG##_##NC(const float *p, int GP, int g0, int64_t d0, const char *v, int64_t D,     \
                                    int64_t S, const int64_t *pg, int64_t lo, int64_t hi, const float *l,     \
                                    void *out) { mix_block(p, GP, g0, NG, d0, NC, v, D, S, pg, lo, hi, l, out, F32); } \
    static void mix_bf16_##NG##_##NC(const float *p, int GP, int g0, int64_t d0, const char *v, int64_t D,    \
                                     int64_t S, const int64_t *pg, int64_t lo, int64_t hi, const float *l,    \
                                     void *out) { mix_block(p, GP, g0, NG, d0, NC, v, D, S, pg, lo, hi, l, out, BF16); }
#define MIX_ROW(NG) MIX_FN(NG, 1) MIX_FN(NG, 2) MIX_FN(NG, 3) MIX_FN(NG, 4)
MIX_ROW(1) MIX_ROW(2) MIX_ROW(3) MIX_ROW(4) MIX_ROW(5) MIX_ROW(6) MIX_ROW(7)
#define MIX_PTRS(T, NG) {mix_##T##_##NG##_1, mix_##T##_##NG##_2, mix_##T##_##NG##_3, mix_##T##_##NG##_4}
static const mix_fn MIX_F32[7][4] = {MIX_PTRS(f32, 1), MIX_PTRS(f32, 2), MIX_PTRS(f32, 3), MIX_PTRS(f32, 4),
                                     MIX_PTRS(f32, 5), MIX_PTRS(f32, 6), MIX_PTRS(f32, 7)};
static const mix_fn MIX_BF16[7][4] = {MIX_PTRS(bf16, 1), MIX_PTRS(bf16, 2), MIX_PTRS(bf16, 3), MIX_PTRS(bf16, 4),
                                      MIX_PTRS(bf16, 5), MIX_PTRS(bf16, 6), MIX_PTRS(bf16, 7)};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
static int amx_ready; /* set by mmc_init: the kernel let this process use the tile registers */

/* Scores of bfloat16 keys on the tile unit, 16 keys at a time: tile 0 holds 16 key rows by 32 dims, tiles 2..
 * the query rows transposed in pairs (VNNI), tile 1 a 16 x GP block of scores. Each score is the same float32
 * sum of bfloat16 products as on the vector path, in another order. amx_begin loads the query once per
 * (sequence, KV head); amx_scores then runs over any number of whole blocks; amx_end frees the tiles. */
static void amx_begin(const uint16_t *q, int G, int D) {
    const int GP = G <= 8 ? 8 : 16, nb = D / 32;
    struct __attribute__((aligned(64))) {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg = {0};
    uint16_t qt[6][16][32] __attribute__((aligned(64)));
    for (int c = 0; c < nb; c++)
        for (int r = 0; r < 16; r++)
            for (int g = 0; g < GP; g++)
                for (int e = 0; e < 2; e++) qt[c][r][2 * g + e] = g < G ? q[g * D + 32 * c + 2 * r + e] : 0;
    cfg.palette = 1;
    for (int t = 0; t < 2 + nb; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = t == 0 ? 64 : (uint16_t)(GP * 4);
    }
    _tile_loadconfig(&cfg);
    /* tile numbers are immediates: query chunk c lives in tile 2 + c */
#define LOAD_B(c, tile) if (nb > c) _tile_loadd(tile, qt[c], 64);
    LOAD_B(0, 2) LOAD_B(1, 3) LOAD_B(2, 4) LOAD_B(3, 5) LOAD_B(4, 6) LOAD_B(5, 7)
#undef LOAD_B
}

static void amx_scores(int G, int D, const char *krow, int64_t count, float scale, float *s) {
    const int GP = G <= 8 ? 8 : 16, nb = D / 32;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t i = 0; i + 16 <= count; i += 16, krow += 16 * D * 2, s += 16 * GP) {
        _tile_zero(1);
#define DOT(c, tile) if (nb > c) { _tile_loadd(0, krow + 64 * c, D * 2); _tile_dpbf16ps(1, 0, tile); }
        DOT(0, 2) DOT(1, 3) DOT(2, 4) DOT(3, 5) DOT(4, 6) DOT(5, 7)
#undef DOT
        _tile_stored(1, s, GP * 4);
        for (int j = 0; j < 16 * GP; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), sc));
    }
}

static void amx_end(void) { _tile_release(); }
#endif

/* One (sequence, KV head): G query rows over positions lo .. hi-1. s: scratch of GP * (hi - lo) floats. */
static void attend(const void *q, const char *k, const char *v, const int64_t *pages, int64_t lo, int64_t hi,
                   int G, int64_t D, int64_t S, float scale, float *s, void *out, int dtype) {
    const int GP = G <= 8 ? 8 : 16;
    const size_t esize = dtype == BF16 ? 2 : 4;
    float qf[MAX_G * MAX_D];
    score_fn score = dtype == BF16 ? SCORE_BF16[G] : SCORE_F32[G];
#if defined(__AVX512BF16__)
    if (dtype == BF16 && D == 64 && G <= 8) score = SCORE_BF16_D64[G];
#endif
#if defined(__AVX512BF16__)
    if (dtype == F32) /* bfloat16 queries are read as they are */
#endif
        for (int g = 0; g < G; g++)
            for (int64_t d = 0; d < D; d += VL) vf_storeu(qf + g * D + d, vf_load(q, g * D + d, dtype));
#if defined(HAVE_AMX)
    const int tiles = amx_ready && dtype == BF16 && D % 32 == 0 && D <= 192 && hi - lo >= 16;
    if (tiles) amx_begin((const uint16_t *)q, G, (int)D);
#endif
    float *row = s;
    for (int64_t t = lo; t < hi;) {
        int64_t page = pages[t / S], off = t % S, count = hi - t < S - off ? hi - t : S - off;
        const char *krow = k + (page * S + off) * D * esize;
#if defined(HAVE_AMX)
        if (tiles && count >= 16) { /* whole blocks of 16 keys on the tile unit, the rest below */
            int64_t whole = count / 16 * 16;
            amx_scores(G, (int)D, krow, whole, scale, row);
            row += whole * GP, t += whole, count -= whole, krow += whole * D * esize;
            if (!count) continue;
        }
#endif
        score(q, qf, (int)D, krow, count, scale, row);
        row += count * GP;
        t += count;
    }
#if defined(HAVE_AMX)
    if (tiles) amx_end();
#endif
    const int64_t n = hi - lo;
    float l[MAX_G];
    for (int h = 0; h < GP; h += 8) {
        __m256 m = _mm256_set1_ps(-__builtin_inff());
        for (int64_t t = 0; t < n; t++) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t * GP + h));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t * GP + h), m));
            _mm256_storeu_ps(s + t * GP + h, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(l + h, sum);
    }
    /* Query rows in blocks of at most MIX_ROWS (as even as possible), dims in blocks of 4 VL: at most 4 MIX_ROWS
     * accumulators, within the vector registers (32 with AVX-512, 16 with AVX2). */
    const int blocks = (G + MIX_ROWS - 1) / MIX_ROWS, per = (G + blocks - 1) / blocks;
    for (int64_t d0 = 0; d0 < D; d0 += 4 * VL) {
        int nc = (int)((D - d0) / VL < 4 ? (D - d0) / VL : 4);
        for (int g0 = 0; g0 < G; g0 += per) {
            int ng = G - g0 < per ? G - g0 : per;
            mix_fn mix = dtype == BF16 ? MIX_BF16[ng - 1][nc - 1] : MIX_F32[ng - 1][nc - 1];
            mix(s, GP, g0, d0, v, D, S, pages, lo, hi, l, out);
        }
    }
}

struct job {
    int dtype;
    const char *q, *k, *v;
    const int64_t *table, *lo, *hi;
    int64_t table_stride, H, G, D, P, S;
    float scale;
    char *out;
};

static void run_task(const struct job *b, int64_t j, int64_t h, float *s) {
    const size_t esize = b->dtype == BF16 ? 2 : 4, row = (size_t)((j * b->H + h) * b->G * b->D) * esize;
    const size_t pool = (size_t)(h * b->P * b->S * b->D) * esize;
    attend(b->q + row, b->k + pool, b->v + pool, b->table + j * b->table_stride, b->lo[j], b->hi[j], (int)b->G,
           b->D, b->S, b->scale, s, b->out + row, b->dtype);
}

#if defined(__AVX512BF16__)
/* Chunk attention: a prefill chunk of n tokens per sequence, its query heads stacked per KV head into R = G n
 * rows (row r is token r % n), over the S cached keys before the chunk, which every row sees whole, and the
 * chunk's own n keys, of which token i sees 0 .. i (causal). The cached keys' rows lie D apart, the chunk's own
 * kn_row and vn_row apart (the step's keys of all heads side by side). Per (KV head, block of 16 rows): scores
 * S^T = K Q^T, 16 keys x 16 rows at a time (the rows' transpose packed once per block, in dimension pairs),
 * each row's maximum taken while the scores are still in L1; then e^(scale (s - max)) summed in float32 and
 * rounded to bfloat16 in key pairs (ATen's flash kernel rounds them for bfloat16 inputs too), then
 * out^T = V^T P^T, 16 dims x 16 rows at a time, the values packed once per call. Key blocks past the block's last
 * visible key are skipped. Writes out (float32, divided by the sum) and lse = scale max + log(sum).
 *
 * The two products run one of two ways, chosen per call: on the tile unit (AMX; head size D of 32 or 64; keys
 * as the A operand read in place), or on the vector unit with AVX-512 BF16 dot products (vdpbf16ps; each lane
 * one of the block's rows, a key's or a value's dimension pair broadcast; D a multiple of 32 up to 128), for
 * CPUs without tiles. Each way sums a score and an output in its own fixed order, so a row's bits depend on the
 * way, its query, its token and the keys and values, never on the other rows of its call; a process takes the
 * same way for every call of a shape. */
struct chunk_job {
    const uint16_t *q, *k, *v, *kn, *vn; /* k, v: the S cached keys; kn, vn: the chunk's own n */
    int64_t R, S, n, T, TP, VS, D, k_head, v_head, kn_head, vn_head, kn_row, vn_row; /* strides in elements */
    float scale;
    uint16_t *vt; /* per head D * VS values, cached keys then the chunk's, zero past T = S + n: on the tile unit
                   * V^T (D rows VS apart, TP used), on the vector unit key pairs (TP / 2, D, 2) */
    float *out, *lse;
};

#define CHUNK_MAX_D 128

/* Key u of the concatenation (cached, then the chunk's own), u < T. */
static inline const uint16_t *key_row(const struct chunk_job *b, int64_t h, int64_t u) {
    return u < b->S ? b->k + h * b->k_head + u * b->D : b->kn + h * b->kn_head + (u - b->S) * b->kn_row;
}

/* 16 key rows starting at key t, in place when they come from one source (*stride: bytes between rows), else
 * gathered into tail (zero past the last key). */
static inline const char *key_rows(const struct chunk_job *b, int64_t h, int64_t t, uint16_t *tail,
                                   int64_t *stride) {
    const int64_t D = b->D;
    if (t + 16 <= b->S || (t >= b->S && t + 16 <= b->T)) {
        *stride = (t < b->S ? D : b->kn_row) * 2;
        return (const char *)key_row(b, h, t);
    }
    for (int64_t j = 0; j < 16; j++) {
        const uint16_t *src = t + j < b->T ? key_row(b, h, t + j) : 0;
        for (int64_t d = 0; d < D; d++) tail[j * D + d] = src ? src[d] : 0;
    }
    *stride = D * 2;
    return (const char *)tail;
}

/* What one block of rows r0 .. r0+nr-1 sees. */
struct chunk_rows {
    int nr;
    int32_t tok[16];  /* each row's token (rows past R: the last token, which sees everything) */
    int64_t limit;    /* keys 0 .. limit-1 are visible to some row of the block */
    int64_t masked;   /* keys from here on are hidden from some row */
    int64_t L32;      /* limit rounded up to whole 32-key blocks */
};

/* The block's geometry, and its queries transposed in dimension pairs: qt[p] holds, for each of the 16 rows,
 * dimensions 2p and 2p+1 (zero for rows past R). */
static void chunk_rows_of(const struct chunk_job *b, int64_t h, int64_t r0, struct chunk_rows *w,
                          uint16_t (*qt)[32]) {
    const int64_t D = b->D;
    w->nr = (int)(b->R - r0 < 16 ? b->R - r0 : 16);
    const uint16_t *q = b->q + (h * b->R + r0) * D;
    for (int64_t p = 0; p < D / 2; p++)
        for (int g = 0; g < 16; g++)
            for (int e = 0; e < 2; e++) qt[p][2 * g + e] = g < w->nr ? q[g * D + 2 * p + e] : 0;
    int64_t lo = b->n - 1, hi = 0;
    for (int g = 0; g < 16; g++) {
        w->tok[g] = (int32_t)(g < w->nr ? (r0 + g) % b->n : b->n - 1);
        if (g < w->nr && w->tok[g] < lo) lo = w->tok[g];
        if (g < w->nr && w->tok[g] > hi) hi = w->tok[g];
    }
    w->limit = b->S + hi + 1;
    w->masked = b->S + lo + 1;
    w->L32 = (w->limit + 31) / 32 * 32;
}

/* Scores of keys t .. t+15 (already in s) hidden from rows whose token is before them set to -inf; returns the
 * lanes' running maximum m updated with them. */
static inline __m512 mask_and_max(const struct chunk_job *b, const struct chunk_rows *w, int64_t t, float *s,
                                  __m512 m) {
    const __m512i tokv = _mm512_loadu_si512(w->tok);
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    for (int64_t i = t; i < t + 16; i++) {
        __m512 x = _mm512_load_ps(s + i * 16);
        if (i >= w->masked) /* key i - S of the chunk, seen by rows whose token is at least that */
            x = _mm512_mask_mov_ps(x, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int32_t)(i - b->S)), tokv), ninf);
        _mm512_store_ps(s + i * 16, x);
        m = _mm512_max_ps(m, x);
    }
    return m;
}

/* Scores s (keys 0 .. limit-1, each key 16 lanes, one per row) to probabilities pt in the second product's
 * layout (each pair of keys: the 16 rows' two bfloat16 side by side); *sum gets each row's sum of e, *msc its
 * scaled maximum. */
static void chunk_softmax(const struct chunk_job *b, const struct chunk_rows *w, float *s, __m512 m,
                          uint16_t *pt, __m512 *sum, __m512 *msc) {
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    for (int64_t i = w->limit; i < w->L32; i++) _mm512_store_ps(s + i * 16, ninf);
    const __m512 sc = _mm512_set1_ps(b->scale);
    *msc = _mm512_mul_ps(m, sc);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < w->L32; i += 2) {
        __m512 e0 = vf_exp(_mm512_fmsub_ps(_mm512_load_ps(s + i * 16), sc, *msc), 5);
        __m512 e1 = vf_exp(_mm512_fmsub_ps(_mm512_load_ps(s + (i + 1) * 16), sc, *msc), 5);
        total = _mm512_add_ps(total, _mm512_add_ps(e0, e1));
        __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0); /* e0's 16 bfloat16 then e1's */
        _mm512_store_si512(pt + i * 16, _mm512_permutexvar_epi16(pairs, both));
    }
    *sum = total;
}

/* ot (D x 16: out^T) divided by each row's sum into out, and each row's log-sum-exp. */
static void chunk_finish(const struct chunk_job *b, const struct chunk_rows *w, int64_t h, int64_t r0,
                         const float *ot, __m512 sum, __m512 msc) {
    const int64_t D = b->D;
    float l[16], mx[16];
    _mm512_storeu_ps(l, sum);
    _mm512_storeu_ps(mx, msc);
    float *out = b->out + (h * b->R + r0) * D, *lse = b->lse + h * b->R + r0;
    for (int g = 0; g < w->nr; g++) {
        const float inv = 1.0f / l[g];
        for (int64_t d = 0; d < D; d++) out[g * D + d] = ot[d * 16 + g] * inv;
        lse[g] = mx[g] + logf(l[g]);
    }
}

#if defined(HAVE_AMX)
static void chunk_block_tiles(const struct chunk_job *b, int64_t h, int64_t r0, float *s, uint16_t *pt,
                              float *ot) {
    const int64_t D = b->D, S = b->S, ks = D * 2;
    const int nb = (int)(D / 32);
    uint16_t qt[CHUNK_MAX_D / 2][32] __attribute__((aligned(64)));
    struct chunk_rows w;
    chunk_rows_of(b, h, r0, &w, qt);
    _tile_loadd(2, qt[0], 64);
    if (nb > 1) _tile_loadd(3, qt[16], 64);
    const int64_t limit = w.limit, masked_from = w.masked, L32 = w.L32;
    uint16_t tail[16 * CHUNK_MAX_D] __attribute__((aligned(64)));
    __m512 m = _mm512_set1_ps(-__builtin_inff()); /* each row's largest visible score */
    int64_t t = 0;
    /* four blocks of 16 cached keys at a time in tiles 4..7, so the products overlap */
    for (const char *k = (const char *)(b->k + h * b->k_head); t + 64 <= S && t + 64 <= masked_from; t += 64) {
        const char *kr = k + t * ks;
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        _tile_loadd(0, kr, ks); _tile_dpbf16ps(4, 0, 2);
        _tile_loadd(1, kr + 16 * ks, ks); _tile_dpbf16ps(5, 1, 2);
        _tile_loadd(0, kr + 32 * ks, ks); _tile_dpbf16ps(6, 0, 2);
        _tile_loadd(1, kr + 48 * ks, ks); _tile_dpbf16ps(7, 1, 2);
        if (nb > 1) {
            _tile_loadd(0, kr + 64, ks); _tile_dpbf16ps(4, 0, 3);
            _tile_loadd(1, kr + 16 * ks + 64, ks); _tile_dpbf16ps(5, 1, 3);
            _tile_loadd(0, kr + 32 * ks + 64, ks); _tile_dpbf16ps(6, 0, 3);
            _tile_loadd(1, kr + 48 * ks + 64, ks); _tile_dpbf16ps(7, 1, 3);
        }
        _tile_stored(4, s + t * 16, 64); _tile_stored(5, s + (t + 16) * 16, 64);
        _tile_stored(6, s + (t + 32) * 16, 64); _tile_stored(7, s + (t + 48) * 16, 64);
        for (int64_t i = t; i < t + 64; i += 4)
            m = _mm512_max_ps(_mm512_max_ps(m, _mm512_load_ps(s + i * 16)),
                              _mm512_max_ps(_mm512_max_ps(_mm512_load_ps(s + (i + 1) * 16),
                                                          _mm512_load_ps(s + (i + 2) * 16)),
                                            _mm512_load_ps(s + (i + 3) * 16)));
    }
    for (; t < limit; t += 16) { /* the rest one block at a time; a row's keys past its token are -inf */
        int64_t stride;
        const char *krow = key_rows(b, h, t, tail, &stride);
        _tile_zero(1);
        _tile_loadd(0, krow, stride);
        _tile_dpbf16ps(1, 0, 2);
        if (nb > 1) { _tile_loadd(0, krow + 64, stride); _tile_dpbf16ps(1, 0, 3); }
        _tile_stored(1, s + t * 16, 64);
        m = mask_and_max(b, &w, t, s, m);
    }
    __m512 sum, msc;
    chunk_softmax(b, &w, s, m, pt, &sum, &msc);
    const int64_t VS = b->VS;
    const uint16_t *vt = b->vt + h * D * VS; /* C tiles 4..7: dims 0..63 (4 and 5 only at D = 32) */
    const int wide = D == 64;
    _tile_zero(4);
    _tile_zero(5);
    if (wide) { _tile_zero(6); _tile_zero(7); }
    for (int64_t i = 0; i < L32; i += 32) {
        _tile_loadd(1, pt + i * 16, 64);
        _tile_loadd(0, vt + i, VS * 2); _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, vt + 16 * VS + i, VS * 2); _tile_dpbf16ps(5, 2, 1);
        if (wide) {
            _tile_loadd(3, vt + 32 * VS + i, VS * 2); _tile_dpbf16ps(6, 3, 1);
            _tile_loadd(0, vt + 48 * VS + i, VS * 2); _tile_dpbf16ps(7, 0, 1);
        }
    }
    _tile_stored(4, ot, 64);
    _tile_stored(5, ot + 256, 64);
    if (wide) { _tile_stored(6, ot + 512, 64); _tile_stored(7, ot + 768, 64); }
    chunk_finish(b, &w, h, r0, ot, sum, msc);
}
#endif /* HAVE_AMX */

/* 16 keys' scores for the block's 16 rows: s[i][g] = sum over dimension pairs p of q_g . key i, p ascending; key
 * i is the row at k + i * D. Returns m updated with them (the caller masks blocks some row may not see, and
 * takes their maximum after). */
static inline __attribute__((always_inline)) __m512 vector_scores16(const uint16_t (*qt)[32], const int64_t D,
                                                                    const uint16_t *k, float *s, __m512 m) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        const __m512bh qv = (__m512bh)_mm512_load_si512(qt[p]);
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_set1_epi32(*(const int32_t *)(k + i * D + 2 * p)));
    }
    for (int i = 0; i < 16; i++) {
        _mm512_store_ps(s + i * 16, acc[i]);
        m = _mm512_max_ps(m, acc[i]);
    }
    return m;
}

/* out^T for dims d0 .. d0+15 of the block's 16 rows: the sum over key pairs j < L32 / 2, j ascending, of the
 * rows' probabilities of keys 2j, 2j+1 times those keys' values. */
static inline __attribute__((always_inline)) void vector_mix16(const uint16_t *pt, const uint16_t *vp, int64_t D,
                                                               int64_t d0, int64_t L32, float *ot) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const int32_t *vd = (const int32_t *)vp + d0; /* key pair j's dimensions d0 .. d0+15: one cache line */
    for (int64_t j = 0; j < L32 / 2; j++, vd += D) {
        const __m512bh pv = (__m512bh)_mm512_load_si512(pt + j * 32);
        for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbf16_ps(acc[i], pv, (__m512bh)_mm512_set1_epi32(vd[i]));
    }
    for (int i = 0; i < 16; i++) _mm512_store_ps(ot + (d0 + i) * 16, acc[i]);
}

/* One block of rows on the vector unit. D is a constant in each copy the dispatcher below makes, so the 16 key
 * rows of a step lie at constant offsets from one pointer (keys that are not D apart in memory are copied first):
 * with the rows' stride a variable, the loop ran out of registers for their addresses and the call took 12%
 * longer at the hit's shape. */
static inline __attribute__((always_inline)) void chunk_block_vector_d(const struct chunk_job *b, int64_t h,
                                                                        int64_t r0, float *s, uint16_t *pt,
                                                                        float *ot, const int64_t D) {
    uint16_t qt[CHUNK_MAX_D / 2][32] __attribute__((aligned(64)));
    uint16_t tail[16 * CHUNK_MAX_D] __attribute__((aligned(64)));
    struct chunk_rows w;
    chunk_rows_of(b, h, r0, &w, qt);
    __m512 m = _mm512_set1_ps(-__builtin_inff()); /* each row's largest visible score */
    for (int64_t t = 0; t < w.limit; t += 16) {
        int64_t stride;
        const char *krow = key_rows(b, h, t, tail, &stride);
        if (stride != D * 2) {
            for (int j = 0; j < 16; j++) memcpy(tail + j * D, krow + j * stride, D * 2);
            krow = (const char *)tail;
        }
        const uint16_t *k = (const uint16_t *)krow;
        if (t + 16 <= w.masked) { /* every row sees these keys */
            m = vector_scores16((const uint16_t(*)[32])qt, D, k, s + t * 16, m);
        } else {
            vector_scores16((const uint16_t(*)[32])qt, D, k, s + t * 16, m);
            m = mask_and_max(b, &w, t, s, m);
        }
    }
    __m512 sum, msc;
    chunk_softmax(b, &w, s, m, pt, &sum, &msc);
    const uint16_t *vp = b->vt + h * D * b->VS;
    for (int64_t d0 = 0; d0 < D; d0 += 16) vector_mix16(pt, vp, D, d0, w.L32, ot);
    chunk_finish(b, &w, h, r0, ot, sum, msc);
}

static void chunk_block_vector(const struct chunk_job *b, int64_t h, int64_t r0, float *s, uint16_t *pt,
                               float *ot) {
    switch (b->D) {
    case 32: chunk_block_vector_d(b, h, r0, s, pt, ot, 32); break;
    case 64: chunk_block_vector_d(b, h, r0, s, pt, ot, 64); break;
    case 96: chunk_block_vector_d(b, h, r0, s, pt, ot, 96); break;
    default: chunk_block_vector_d(b, h, r0, s, pt, ot, 128); break;
    }
}

/* Which way a call with head size D runs: 2 on the tile unit, 1 on the vector unit, 0 neither (the caller uses
 * another path). Where the tile unit is granted, other head sizes stay on ATen's kernel, which was as fast as a
 * first tile version at 128 (the vector way has not been measured against it there). vector_only: the vector
 * way whatever the CPU grants (tests compare the two ways). */
static int chunk_way(int64_t D, int vector_only) {
#if defined(HAVE_AMX)
    if (!vector_only && amx_ready) return D == 32 || D == 64 ? 2 : 0;
#else
    (void)vector_only;
#endif
    return D >= 32 && D <= CHUNK_MAX_D && D % 32 == 0 ? 1 : 0;
}

/* Returns 0; 1 when the shape is outside what this kernel handles; 2 when memory ran out. k and v may be null
 * when S = 0. */
int mmc_chunk_attention(const void *q, const void *k, const void *v, const void *kn, const void *vn, int64_t H,
                        int64_t R, int64_t S, int64_t n, int64_t D, int64_t k_head, int64_t v_head, int64_t kn_head,
                        int64_t vn_head, int64_t kn_row, int64_t vn_row, float scale, float *out, float *lse,
                        int nthreads, int vector_only) {
    const int way = chunk_way(D, vector_only);
    if (!way || S < 0 || n < 1 || R < 1 || R % n || H < 1 || (S && (!k || !v))) return 1;
    const int64_t T = S + n, TP = (T + 31) / 32 * 32;
    /* V^T's rows an odd number of cache lines apart: at a power of two (T = 2,048: 4 KB) a tile's 16 rows would all
     * fall in one set of L1 */
    const int64_t VS = way == 2 ? (TP / 32 | 1) * 32 : TP;
    uint16_t *vt = (uint16_t *)aligned_alloc(64, (size_t)(H * D * VS) * 2);
    if (!vt) return 2;
    const struct chunk_job job = {(const uint16_t *)q, (const uint16_t *)k, (const uint16_t *)v,
                                  (const uint16_t *)kn, (const uint16_t *)vn, R, S, n, T, TP, VS, D,
                                  k_head, v_head, kn_head, vn_head, kn_row, vn_row, scale, vt, out, lse};
    const int64_t blocks = (R + 15) / 16, tasks = H * blocks;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < H * (TP / 32); i++) { /* the values packed, 32 keys of one head at a time */
            const int64_t h = i / (TP / 32), t0 = i % (TP / 32) * 32;
            const uint16_t *src[32];
            for (int j = 0; j < 32; j++)
                src[j] = t0 + j < S ? job.v + h * v_head + (t0 + j) * D
                         : t0 + j < T ? job.vn + h * vn_head + (t0 + j - S) * vn_row : 0;
            if (way == 2) { /* V^T: row d holds the keys side by side (read from L1) */
                uint16_t *dst = vt + h * D * VS + t0;
                /* 32 rows of one source, a fixed stride apart (cached, or the chunk's own): a dimension pair of 16
                 * rows per gather, its two halves apart into rows d and d + 1; else one value at a time */
                const int64_t stride = t0 + 32 <= S ? D : t0 >= S && t0 + 32 <= T ? vn_row : 0;
                if (stride && stride * 2 * 31 <= INT32_MAX) {
                    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
                                                                             3, 2, 1, 0), _mm512_set1_epi32((int)stride * 2));
                    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                                          30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
                    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
                    const char *lo = (const char *)src[0], *hi = (const char *)src[16];
                    for (int64_t d = 0; d < D; d += 2) {
                        const __m512i a = _mm512_i32gather_epi32(rows, lo + d * 2, 1);
                        const __m512i c = _mm512_i32gather_epi32(rows, hi + d * 2, 1);
                        _mm512_store_si512(dst + d * VS, _mm512_permutex2var_epi16(a, even, c));
                        _mm512_store_si512(dst + (d + 1) * VS, _mm512_permutex2var_epi16(a, odd, c));
                    }
                } else {
                    for (int64_t d = 0; d < D; d++)
                        for (int j = 0; j < 32; j++) dst[d * VS + j] = src[j] ? src[j][d] : 0;
                }
            } else { /* pairs: for keys 2j, 2j+1, each dimension's two values side by side */
                uint16_t *dst = vt + h * D * VS + t0 * D;
                const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                    39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
                const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
                for (int j = 0; j < 32; j += 2, dst += 2 * D)
                    for (int64_t d = 0; d < D; d += 32) { /* D is a multiple of 32 on this way */
                        const __m512i a = src[j] ? _mm512_loadu_si512(src[j] + d) : _mm512_setzero_si512();
                        const __m512i c = src[j + 1] ? _mm512_loadu_si512(src[j + 1] + d) : _mm512_setzero_si512();
                        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, lo, c));
                        _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(a, hi, c));
                    }
            }
        }
        float *sc = (float *)aligned_alloc(64, sizeof(float) * 16 * (size_t)TP);
        uint16_t *pt = (uint16_t *)aligned_alloc(64, 2 * 16 * (size_t)TP);
        float *ot = (float *)aligned_alloc(64, sizeof(float) * 16 * CHUNK_MAX_D);
        if (!sc || !pt || !ot) {
#pragma omp atomic write
            failed = 1;
        }
#if defined(HAVE_AMX)
        if (way == 2) {
            struct __attribute__((aligned(64))) {
                uint8_t palette, start_row, reserved[14];
                uint16_t colsb[16];
                uint8_t rows[16];
            } cfg = {0};
            cfg.palette = 1;
            for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
            _tile_loadconfig(&cfg);
        }
#endif
        /* Rows late in the chunk see more keys: hand the blocks out a few at a time. */
#pragma omp for schedule(dynamic, 4)
        for (int64_t task = 0; task < tasks; task++) {
            if (!sc || !pt || !ot) continue;
#if defined(HAVE_AMX)
            if (way == 2) {
                chunk_block_tiles(&job, task / blocks, task % blocks * 16, sc, pt, ot);
                continue;
            }
#endif
            chunk_block_vector(&job, task / blocks, task % blocks * 16, sc, pt, ot);
        }
#if defined(HAVE_AMX)
        if (way == 2) _tile_release();
#endif
        free(sc);
        free(pt);
        free(ot);
    }
    free(vt);
    return failed ? 2 : 0;
}

int mmc_chunk_way(int64_t D, int vector_only) { return chunk_way(D, vector_only); }
#else
int mmc_chunk_attention(const void *q, const void *k, const void *v, const void *kn, const void *vn, int64_t H,
                        int64_t R, int64_t S, int64_t n, int64_t D, int64_t k_head, int64_t v_head, int64_t kn_head,
                        int64_t vn_head, int64_t kn_row, int64_t vn_row, float scale, float *out, float *lse,
                        int nthreads, int vector_only) {
    (void)kn_row, (void)vn_row, (void)q, (void)k, (void)v, (void)kn, (void)vn, (void)H, (void)R, (void)S, (void)n;
    (void)D, (void)k_head, (void)vector_only;
    (void)v_head, (void)kn_head, (void)vn_head, (void)scale, (void)out, (void)lse, (void)nthreads;
    return 1;
}

int mmc_chunk_way(int64_t D, int vector_only) { (void)D, (void)vector_only; return 0; }
#endif

/* float32 lanes per vector in this build: 16 (AVX-512) or 8 (AVX2). */
int mmc_lanes(void) { return VL; }

/* Called once after loading, before any other call: returns 1 where scores run on the tile unit (AMX), else 0.
 * use_tiles 0: never (the vector unit's ways, as on a CPU without the tile unit). */
int mmc_init(int use_tiles) {
#if defined(HAVE_AMX)
    /* Linux hands out the tile registers' state only to processes that ask (ARCH_REQ_XCOMP_PERM, XTILEDATA). */
    amx_ready = use_tiles && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_ready;
#else
    (void)use_tiles;
    return 0;
#endif
}

/* Returns 0, or 1 when the shape is outside what this kernel handles (the caller then uses another path). */
int mmc_decode_attention(int dtype, const void *q, const void *k, const void *v, const int64_t *table,
                         int64_t table_stride, const int64_t *lo, const int64_t *hi, int64_t n, int64_t H,
                         int64_t G, int64_t D, int64_t P, int64_t S, float scale, void *out, int nthreads) {
    if ((dtype != F32 && dtype != BF16) || G < 1 || G > MAX_G || D < 16 || D > MAX_D || D % 16 || S < 1)
        return 1;
    int64_t longest = 0;
    for (int64_t j = 0; j < n; j++) {
        if (hi[j] <= lo[j] || lo[j] < 0 || (hi[j] - 1) / S >= table_stride) return 1;
        for (int64_t i = lo[j] / S; i <= (hi[j] - 1) / S; i++)
            if (table[j * table_stride + i] < 0 || table[j * table_stride + i] >= P) return 1;
        if (hi[j] - lo[j] > longest) longest = hi[j] - lo[j];
    }
    const struct job job = {dtype, (const char *)q, (const char *)k, (const char *)v, table, lo, hi,
                             table_stride, H, G, D, P, S, scale, (char *)out};
    /* Sequences that start on the same page (a shared prefix) next to each other, and each thread a run of
     * tasks of one KV head where the heads divide evenly among the threads: a prefix's keys and values, read
     * by one sequence, are still in that core's cache for the next. */
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (!order) return 2;
    for (int64_t j = 0; j < n; j++) {
        int64_t i = j, first = table[j * table_stride + lo[j] / S];
        for (; i > 0 && table[order[i - 1] * table_stride + lo[order[i - 1]] / S] > first; i--) order[i] = order[i - 1];
        order[i] = j;
    }
    const int64_t tasks = n * H;
    const int by_head = nthreads > 0 && H % nthreads == 0;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *s = (float *)malloc(sizeof(float) * 16 * (size_t)longest);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
        if (by_head) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < tasks; task++)
                if (s) run_task(&job, order[task % n], task / n, s);
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < tasks; task++)
                if (s) run_task(&job, order[task % n], task / n, s);
        }
        free(s);
    }
    free(order);
    return failed ? 2 : 0;
}
