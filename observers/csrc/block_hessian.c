/* The local_hessian sweep's pick: per row and block of 16 the first candidate step of least dwᵀ H_b dw.
 *
 * The eager path (observers/modelopt_search.py, candidate_errors with a Hessian, then argmin) fake-quantizes
 * the whole weight once per candidate (126 E4M3 block scales) and runs a batched matmul over the blocks,
 * a dozen passes through buffers of the weight's size per candidate. This kernel keeps sixteen rows of one
 * block column (a 1 KiB tile) and that column's H_b (1 KiB) in L1 through all candidates.
 *
 * block_hessian_<isa>(x, rows, blocks, hessian, step, count, exp_bits, man_bits, max_value, threads,
 *                     best_value, best_index):
 *   x holds `rows` contiguous rows of `blocks` blocks of 16 fp32 values (the weight (rows, in), in =
 *   16*blocks, with 16*in < 2^31: the gathers take int32 offsets), hessian `blocks` contiguous 16x16 fp32
 *   matrices, step `count` fp32 steps (one per candidate, shared by every block). For candidate c,
 *   s = step[c], and each block's values x_k:
 *     code_k = grid(x_k/s)    (x_k/s correctly rounded, grid() the float grid rounding of float_grid.h)
 *     dw_k   = x_k - code_k*s (both fp32 roundings, as eager's codes.mul_(s) then data - dequantized)
 *     form   = Σ_j dw_j · (Σ_i dw_i·H_b[i][j])   (bmm(dw, H_b) times dw, summed: H_b need not be symmetric)
 *   and best_value[r*blocks + b], best_index[r*blocks + b] get the least form over the candidates (NaN read
 *   as +inf) and the first candidate reaching it. The codes and dw are the eager ones bit for bit; the form
 *   is summed in a fixed order with fused multiply-adds (i, then j, in order), another order than the
 *   eager matmul's, so it differs from eager's by a few ulps of its terms' magnitudes. Every candidate
 *   runs the same operations in the same order, so two candidates giving the same dequantized block give
 *   the same form, an exact tie, and the first is kept, as eager's argmin keeps it. The AVX-512 (16 lanes)
 *   and AVX2 (8 lanes) variants run the same operations per lane: their results are identical.
 *
 * Layout: one lane per row, sixteen (AVX2: eight) rows of the same block column at once, so H_b is shared
 * by every lane: H_b[i][j] is a broadcast operand, Σ_i dw_i·H_b[i][j] sixteen vector fma chains, the pick a
 * vector compare. Element k of the lanes' rows is gathered into one vector once per tile; a last tile with
 * fewer rows runs with its missing lanes masked (zeros, never stored). Work units are (tile, block) pairs,
 * consecutive blocks of the same rows, split over the threads by OpenMP.
 * simd_level() (simd_level.h) says which variants this CPU runs.
 */
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "float_grid.h"

/* What the exported functions share with the per-unit loops. */
struct sweep {
    const float *x, *hessian, *step;
    int64_t rows, blocks, count;
    struct float_grid grid;
    float *best_value;
    int64_t *best_index;
};

static struct sweep make_sweep(const float *x, int64_t rows, int64_t blocks, const float *hessian, const float *step,
                               int64_t count, int exp_bits, int man_bits, double max_value, float *best_value,
                               int64_t *best_index) {
    struct sweep w;
    w.x = x;
    w.hessian = hessian;
    w.step = step;
    w.rows = rows;
    w.blocks = blocks;
    w.count = count;
    w.grid = float_grid_of(exp_bits, man_bits, max_value);
    w.best_value = best_value;
    w.best_index = best_index;
    return w;
}

/* The `live` first lanes' picks into row r0 + lane of block b. */
static void store_picks(const struct sweep *w, int64_t r0, int64_t b, int live, const float *value,
                        const int32_t *index) {
    for (int lane = 0; lane < live; ++lane) {
        w->best_value[(r0 + lane) * w->blocks + b] = value[lane];
        w->best_index[(r0 + lane) * w->blocks + b] = index[lane];
    }
}

/* ---------------------------------------------------------------- AVX-512 */

/* Candidate s's form per lane. dw_i and the sixteen partial sums Σ_i dw_i·H[i][j] build up together, i in
 * order (H[i][j] an fma's broadcast operand); then Σ_j dw_j·(...) in order. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 form_avx512(const __m512 *t, const float *h,
                                                                                  float s, float r, int fast,
                                                                                  const struct float_grid *g) {
    const __m512 vs = _mm512_set1_ps(s), vr = _mm512_set1_ps(r);
    __m512 dw[16], hdw[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
        const __m512 q = fast ? float_grid_quotient_avx512(t[i], vs, vr) : _mm512_div_ps(t[i], vs);
        dw[i] = _mm512_sub_ps(t[i], _mm512_mul_ps(float_grid_round_avx512(q, g), vs));
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
            const __m512 hij = _mm512_set1_ps(h[i * 16 + j]);
            hdw[j] = i == 0 ? _mm512_mul_ps(dw[0], hij) : _mm512_fmadd_ps(dw[i], hij, hdw[j]);
        }
    }
    __m512 form = _mm512_mul_ps(dw[0], hdw[0]);
#pragma GCC unroll 16
    for (int j = 1; j < 16; ++j) form = _mm512_fmadd_ps(dw[j], hdw[j], form);
    return form;
}

/* Rows r0 .. r0+15 (those below `rows`) of block b through every candidate. */
__attribute__((target("avx512f"))) static void tile_avx512(const struct sweep *w, int64_t r0, int64_t b) {
    const int live = w->rows - r0 < 16 ? (int)(w->rows - r0) : 16;
    const __mmask16 lanes = (__mmask16)((1u << live) - 1u);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(w->blocks * 16)));
    const float *base = w->x + (r0 * w->blocks + b) * 16;
    __m512 t[16], size = _mm512_setzero_ps();
    for (int k = 0; k < 16; ++k) {
        t[k] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, _mm512_add_epi32(rows, _mm512_set1_epi32(k)),
                                        base, 4);
        size = _mm512_max_ps(_mm512_abs_ps(t[k]), size); /* max(NaN, m) is m: a NaN value, NaN on both
                                                              quotient paths, is passed over; an inf stays */
    }
    const float amax = _mm512_reduce_max_ps(size);
    const float *h = w->hessian + b * 256;
    __m512 best = _mm512_set1_ps(__builtin_inff());
    __m512i index = _mm512_setzero_si512();
    for (int64_t c = 0; c < w->count; ++c) {
        const float s = w->step[c], r = 1.0f / s;
        __m512 form = float_grid_fast_quotient(s, r, amax) ? form_avx512(t, h, s, r, 1, &w->grid)
                                                         : form_avx512(t, h, s, r, 0, &w->grid);
        form = _mm512_mask_mov_ps(form, _mm512_cmp_ps_mask(form, form, _CMP_UNORD_Q), _mm512_set1_ps(__builtin_inff()));
        const __mmask16 lower = _mm512_cmp_ps_mask(form, best, _CMP_LT_OQ); /* strict: the first least stays */
        best = _mm512_mask_mov_ps(best, lower, form);
        index = _mm512_mask_mov_epi32(index, lower, _mm512_set1_epi32((int)c));
    }
    float value[16];
    int32_t picked[16];
    _mm512_storeu_ps(value, best);
    _mm512_storeu_si512((void *)picked, index);
    store_picks(w, r0, b, live, value, picked);
}

__attribute__((target("avx512f"))) void block_hessian_avx512(const float *x, int64_t rows, int64_t blocks,
                                                             const float *hessian, const float *step, int64_t count,
                                                             int exp_bits, int man_bits, double max_value,
                                                             int threads, float *best_value, int64_t *best_index) {
    const struct sweep w =
        make_sweep(x, rows, blocks, hessian, step, count, exp_bits, man_bits, max_value, best_value, best_index);
    const int64_t tiles = (rows + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < tiles * blocks; ++u) tile_avx512(&w, (u / blocks) * 16, u % blocks);
}

/* ---------------------------------------------------------------- AVX2 */

/* As form_avx512 over eight lanes, in the same operations and order per lane. AVX2 has sixteen registers,
 * so the dw are computed first and the partial sums run in two halves of j (each sum's own chain over i is
 * unchanged). */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 form_avx2(const __m256 *t, const float *h,
                                                                                 float s, float r, int fast,
                                                                                 const struct float_grid *g) {
    const __m256 vs = _mm256_set1_ps(s), vr = _mm256_set1_ps(r);
    __m256 dw[16], hdw[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
        const __m256 q = fast ? float_grid_quotient_avx2(t[i], vs, vr) : _mm256_div_ps(t[i], vs);
        dw[i] = _mm256_sub_ps(t[i], _mm256_mul_ps(float_grid_round_avx2(q, g), vs));
    }
    for (int half = 0; half < 16; half += 8) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
#pragma GCC unroll 8
            for (int j = half; j < half + 8; ++j) {
                const __m256 hij = _mm256_set1_ps(h[i * 16 + j]);
                hdw[j] = i == 0 ? _mm256_mul_ps(dw[0], hij) : _mm256_fmadd_ps(dw[i], hij, hdw[j]);
            }
        }
    }
    __m256 form = _mm256_mul_ps(dw[0], hdw[0]);
#pragma GCC unroll 16
    for (int j = 1; j < 16; ++j) form = _mm256_fmadd_ps(dw[j], hdw[j], form);
    return form;
}

/* As tile_avx512 over rows r0 .. r0+7. */
__attribute__((target("avx2,fma"))) static void tile_avx2(const struct sweep *w, int64_t r0, int64_t b) {
    const int live = w->rows - r0 < 8 ? (int)(w->rows - r0) : 8;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lanes = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live), lane));
    const __m256i rows = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)(w->blocks * 16)));
    const float *base = w->x + (r0 * w->blocks + b) * 16;
    __m256 t[16], size = _mm256_setzero_ps();
    for (int k = 0; k < 16; ++k) {
        t[k] = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base, _mm256_add_epi32(rows, _mm256_set1_epi32(k)),
                                        lanes, 4);
        size = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), t[k]), size); /* as tile_avx512 */
    }
    float sizes[8], amax = 0.0f;
    _mm256_storeu_ps(sizes, size);
    for (int lane_index = 0; lane_index < 8; ++lane_index) amax = sizes[lane_index] > amax ? sizes[lane_index] : amax;
    const float *h = w->hessian + b * 256;
    __m256 best = _mm256_set1_ps(__builtin_inff());
    __m256i index = _mm256_setzero_si256();
    for (int64_t c = 0; c < w->count; ++c) {
        const float s = w->step[c], r = 1.0f / s;
        __m256 form = float_grid_fast_quotient(s, r, amax) ? form_avx2(t, h, s, r, 1, &w->grid)
                                                         : form_avx2(t, h, s, r, 0, &w->grid);
        form = _mm256_blendv_ps(form, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(form, form, _CMP_UNORD_Q));
        const __m256 lower = _mm256_cmp_ps(form, best, _CMP_LT_OQ); /* strict: the first least stays */
        best = _mm256_blendv_ps(best, form, lower);
        index = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(index), _mm256_castsi256_ps(_mm256_set1_epi32((int)c)), lower));
    }
    float value[8];
    int32_t picked[8];
    _mm256_storeu_ps(value, best);
    _mm256_storeu_si256((__m256i *)picked, index);
    store_picks(w, r0, b, live, value, picked);
}

__attribute__((target("avx2,fma"))) void block_hessian_avx2(const float *x, int64_t rows, int64_t blocks,
                                                            const float *hessian, const float *step, int64_t count,
                                                            int exp_bits, int man_bits, double max_value, int threads,
                                                            float *best_value, int64_t *best_index) {
    const struct sweep w =
        make_sweep(x, rows, blocks, hessian, step, count, exp_bits, man_bits, max_value, best_value, best_index);
    const int64_t tiles = (rows + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < tiles * blocks; ++u) tile_avx2(&w, (u / blocks) * 8, u % blocks);
}

#endif

#include "simd_level.h"
