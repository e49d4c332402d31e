/* Linear products of a few bfloat16 rows (a decode step's) on the AMX tile unit, bfloat16 in and out:
 *
 *     out[m][n] = bf16(sum over k of x[m][k] * w[n][k] (+ bias[n]))
 *
 * x (M, K) bfloat16, rows K apart; w (N, K) bfloat16 (nn.Linear's layout), laid out once by mmc_tile_pack in
 * blocks of 64 output columns: block j holds, for each 32 k in ascending order, four 16-column tiles of 1 KB,
 * each 16 rows of 16 column pairs (row r, column c: w[64 j + 16 t + c][32 kb + 2 r] then the same at 2 r + 1,
 * the tile unit's pair layout), so a block is one contiguous stream; columns past N and k past K are zero. bias
 * (N) float32 or null; out (M, N) bfloat16, rows N apart.
 *
 * Why: a decode step multiplies every weight of the model with a few rows, so its products are as fast as the
 * weights stream from memory. oneDNN's bfloat16 products of 1-16 rows stream them at about 13-17 GB/s on the
 * Intel AMX machine of benchmarks/RESULTS.md; here each 1 KB tile of weight is loaded once, asked of the memory
 * one step (4 KB) ahead (past the weight's end too: a prefetch never faults), and multiplied on the tile unit
 * with 16 rows of x at once, a small part of the time its load takes, so the products run at the weights'
 * streaming rate, 20-24 GB/s there (a little more where the copy lies on huge pages: native.TileWeight). Rows
 * past 16 are done in groups of 16, each group over a block of columns while that block is still in L2, so the
 * weights are read from memory once per product.
 *
 * On a CPU with AVX-512 BF16 but no tile unit the same laid-out weight serves mmc_vector_linear (the vector way,
 * below): oneDNN's own products there give a row other bits in other company (its blocking of k changes with
 * the number of rows), which would rule out the engine's whole hits; this way does not.
 *
 * Invariants: out[m][n] depends only on row m of x, row n of w and bias[n], never on M, the other rows, the
 * block n falls in or the number of threads: the tile unit's float32 sums of bfloat16 products, 32 k at a time
 * in ascending order of k, then the bias added and the sum rounded to bfloat16 once (to nearest even, as torch
 * rounds); on the vector way float32 sums of pairs of products, pairs in ascending order of k (other bits than
 * the tile unit's). Each way is built only where the compiler targets it (HAVE_TILES: AMX; HAVE_VECTORS:
 * AVX-512 BF16); elsewhere its entry points refuse.
 */
#define _GNU_SOURCE /* syscall() */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_COLS 64   /* output columns per block: four tiles of 16 */
#define TILE_K 32      /* k per tile row: 16 pairs */
#define GROUP 16       /* rows of x per tile */
#define BLOCK_BYTES (4 * 1024) /* one block's four tiles for one step of TILE_K */

/* Elements (bfloat16) of the laid-out copy of a (N, K) weight; 0 for a shape this does not take. */
int64_t mmc_tile_elements(int64_t N, int64_t K) {
    if (N < 1 || K < 1) return 0;
    return ((N + TILE_COLS - 1) / TILE_COLS) * TILE_COLS * ((K + TILE_K - 1) / TILE_K) * TILE_K;
}

/* w (N, K) into blocks at out (mmc_tile_elements(N, K) elements). Returns 0, or 1 for arguments outside what this
 * handles. The layout does not need the tile unit, so this runs on any CPU (tests check it everywhere). */
int mmc_tile_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *out, int nthreads) {
    if (!w || !out || N < 1 || K < 1 || nthreads < 1) return 1;
    const int64_t blocks = (N + TILE_COLS - 1) / TILE_COLS, steps = (K + TILE_K - 1) / TILE_K;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t j = 0; j < blocks; j++)
        for (int64_t kb = 0; kb < steps; kb++)
            for (int t = 0; t < 4; t++) {
                uint16_t *dst = out + ((j * steps + kb) * 4 + t) * (GROUP * 32);
                for (int c = 0; c < 16; c++) {
                    const int64_t n = j * TILE_COLS + t * 16 + c;
                    for (int kk = 0; kk < TILE_K; kk++) {
                        const int64_t k = kb * TILE_K + kk;
                        dst[(kk / 2) * 32 + c * 2 + (kk & 1)] = n < N && k < K ? w[n * K + k] : 0;
                    }
                }
            }
    return 0;
}

#if defined(__AVX512BF16__)
#define HAVE_VECTORS 1

/* Rows of x padded to whole groups and k to whole steps, zero beyond (x itself where already so); per thread, kept
 * between calls (grown as needed, never freed: at most a few MB per thread that calls). */
static _Thread_local uint16_t *scratch;
static _Thread_local int64_t scratch_elements;

static const uint16_t *padded(const uint16_t *x, int64_t M, int64_t K, int64_t Mp, int64_t Kp) {
    if (M == Mp && K == Kp) return x;
    if (scratch_elements < Mp * Kp) {
        uint16_t *grown = realloc(scratch, (size_t)(Mp * Kp) * sizeof *grown);
        if (!grown) return 0;
        scratch = grown;
        scratch_elements = Mp * Kp;
    }
    for (int64_t m = 0; m < Mp; m++) {
        uint16_t *row = scratch + m * Kp;
        if (m < M) {
            memcpy(row, x + m * K, (size_t)K * sizeof *row);
            memset(row + K, 0, (size_t)(Kp - K) * sizeof *row);
        } else {
            memset(row, 0, (size_t)Kp * sizeof *row);
        }
    }
    return scratch;
}

/* The vector way, for CPUs with AVX-512 BF16 but no tile unit (AMD Zen 4, Intel Cooper Lake): the same laid-out
 * weight, each 64-byte row of a tile (16 columns' pairs for one pair of k) met by one row of x's same pair,
 * broadcast, in one VDPBF16PS per 16 columns. Rows are taken R at a time (R <= VEC_GROUP: 4R sums, 4 weight
 * vectors and a broadcast in the 32 registers) over one block, the block's first group asking for its next
 * step one step ahead, so the weights stream from memory once and the later groups find them in L2. Each sum
 * lane adds its row's pairs of k in ascending order, as the tile unit does, so out[m][n] depends only on row m
 * of x, row n of w and bias[n] (the sums need not equal the tile unit's bits: the engine uses one way for its
 * life). */
#define VEC_GROUP 6

static inline __attribute__((always_inline)) void vector_rows(const uint16_t *a, int64_t Kp, int R,
                                                               const char *block, int64_t steps, int ahead,
                                                               int64_t m0, int64_t M, int64_t j, int64_t N,
                                                               const float *bias, uint16_t *out) {
    __m512 acc[VEC_GROUP][4];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < 4; t++) acc[i][t] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < steps; kb++) {
        const char *b = block + kb * BLOCK_BYTES;
        if (ahead)
            for (int i = 0; i < BLOCK_BYTES; i += 64) _mm_prefetch(b + BLOCK_BYTES + i, _MM_HINT_T0);
        const uint16_t *xk = a + kb * TILE_K;
        for (int r = 0; r < TILE_K / 2; r++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + r * 64);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b + 1024 + r * 64);
            const __m512bh w2 = (__m512bh)_mm512_loadu_si512(b + 2048 + r * 64);
            const __m512bh w3 = (__m512bh)_mm512_loadu_si512(b + 3072 + r * 64);
            for (int i = 0; i < R; i++) {
                int32_t pair;
                memcpy(&pair, xk + i * Kp + 2 * r, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);
                acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xb, w2);
                acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xb, w3);
            }
        }
    }
    for (int t = 0; t < 4; t++) {
        const int64_t n0 = j * TILE_COLS + t * 16;
        if (n0 >= N) break;
        const __mmask16 keep = N - n0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
        for (int i = 0; i < R && m0 + i < M; i++)
            _mm256_mask_storeu_epi16(out + (m0 + i) * N + n0, keep,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][t], bv)));
    }
}

int mmc_vector_rows(void) { return VEC_GROUP; }

/* out = x w^T (+ bias) as above on the vector way, w laid out by mmc_tile_pack. Returns 0; 1 for arguments outside
 * what this handles; 3 where memory for the padded rows could not be had. */
int mmc_vector_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *wt, int64_t N, const float *bias,
                      uint16_t *out, int nthreads) {
    if (!x || !wt || !out || M < 1 || K < 1 || N < 1 || nthreads < 1) return 1;
    const int64_t Kp = (K + TILE_K - 1) / TILE_K * TILE_K;
    const int64_t steps = Kp / TILE_K, blocks = (N + TILE_COLS - 1) / TILE_COLS;
    const uint16_t *xp = padded(x, M, K, M, Kp); /* k past K zero: the laid-out weight is zero there too */
    if (!xp) return 3;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && blocks > 1)
    for (int64_t j = 0; j < blocks; j++) {
        const char *block = (const char *)wt + j * steps * BLOCK_BYTES;
        for (int64_t m0 = 0; m0 < M; m0 += VEC_GROUP) {
            const int64_t left = M - m0;
            const uint16_t *a = xp + m0 * Kp;
            switch (left >= VEC_GROUP ? VEC_GROUP : (int)left) { /* constant R: the sums stay in registers */
            case 1: vector_rows(a, Kp, 1, block, steps, m0 == 0, m0, M, j, N, bias, out); break;
            case 2: vector_rows(a, Kp, 2, block, steps, m0 == 0, m0, M, j, N, bias, out); break;
            case 3: vector_rows(a, Kp, 3, block, steps, m0 == 0, m0, M, j, N, bias, out); break;
            case 4: vector_rows(a, Kp, 4, block, steps, m0 == 0, m0, M, j, N, bias, out); break;
            case 5: vector_rows(a, Kp, 5, block, steps, m0 == 0, m0, M, j, N, bias, out); break;
            default: vector_rows(a, Kp, VEC_GROUP, block, steps, m0 == 0, m0, M, j, N, bias, out); break;
            }
        }
    }
    return 0;
}

#else

int mmc_vector_rows(void) { return 0; }

int mmc_vector_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *wt, int64_t N, const float *bias,
                      uint16_t *out, int nthreads) {
    (void)x, (void)M, (void)K, (void)wt, (void)N, (void)bias, (void)out, (void)nthreads;
    return 2;
}

#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_TILES 1

static int tiles_granted; /* Linux let this process use the tile registers (asked once, by mmc_tile_rows) */

struct tile_config {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Rows m0 .. m0 + rows - 1 of the four 16 x 16 float32 tiles c (block j), plus the bias, rounded into out. */
static void store_rows(const float c[4][GROUP * 16], int64_t m0, int rows, int64_t j, int64_t N, const float *bias,
                       uint16_t *out) {
    for (int t = 0; t < 4; t++) {
        const int64_t n0 = j * TILE_COLS + t * 16;
        if (n0 >= N) break;
        const __mmask16 keep = N - n0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c[t] + r * 16), b);
            _mm256_mask_storeu_epi16(out + (m0 + r) * N + n0, keep, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

int mmc_tile_rows(void) {
    static int asked;
    if (!asked) { /* ARCH_REQ_XCOMP_PERM for XTILEDATA; a repeated ask is answered the same */
        tiles_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        asked = 1;
    }
    return tiles_granted ? GROUP : 0;
}

/* out = x w^T (+ bias) as above, w laid out by mmc_tile_pack. Returns 0; 1 for arguments outside what this
 * handles; 2 where the tile unit is not granted; 3 where memory for the padded rows could not be had. */
int mmc_tile_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *wt, int64_t N, const float *bias,
                    uint16_t *out, int nthreads) {
    if (!x || !wt || !out || M < 1 || K < 1 || N < 1 || nthreads < 1) return 1;
    if (!mmc_tile_rows()) return 2;
    const int64_t Mp = (M + GROUP - 1) / GROUP * GROUP, Kp = (K + TILE_K - 1) / TILE_K * TILE_K;
    const int64_t steps = Kp / TILE_K, blocks = (N + TILE_COLS - 1) / TILE_COLS;
    const uint16_t *xp = padded(x, M, K, Mp, Kp);
    if (!xp) return 3;
    const int64_t stride = Kp * (int64_t)sizeof(uint16_t);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && blocks > 1)
    {
        struct tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = GROUP;
        _tile_loadconfig(&cfg);
        float c[4][GROUP * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t j = 0; j < blocks; j++) {
            const char *block = (const char *)wt + j * steps * BLOCK_BYTES;
            for (int64_t m0 = 0; m0 < Mp; m0 += GROUP) {
                const uint16_t *a = xp + m0 * Kp;
                /* tiles 0-3: the four column tiles' sums; 4: 16 rows of x; 5-7: weight tiles in turn */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < steps; kb++) {
                    const char *b = block + kb * BLOCK_BYTES;
                    if (m0 == 0) /* the next step's tiles (the next block's first after the last step) */
                        for (int i = 0; i < BLOCK_BYTES; i += 64) _mm_prefetch(b + BLOCK_BYTES + i, _MM_HINT_T0);
                    _tile_loadd(4, a + kb * TILE_K, stride);
                    _tile_loadd(5, b, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, b + 1024, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(7, b + 2048, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, b + 3072, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                _tile_stored(2, c[2], 64);
                _tile_stored(3, c[3], 64);
                store_rows((const float(*)[GROUP * 16])c, m0, (int)(M - m0 < GROUP ? M - m0 : GROUP), j, N, bias,
                           out);
            }
        }
        _tile_release();
    }
    return 0;
}

#else

int mmc_tile_rows(void) { return 0; }

int mmc_tile_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *wt, int64_t N, const float *bias,
                    uint16_t *out, int nthreads) {
    (void)x, (void)M, (void)K, (void)wt, (void)N, (void)bias, (void)out, (void)nthreads;
    return 2;
}

#endif
