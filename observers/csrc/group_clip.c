/* The AWQ clip search's pick: per row and group of an integer grid, the first of `count` candidate ranges
 * whose dwᵀ H dw is least.
 *
 * The eager path (observers/awq.py, clip_picks) fake-quantizes every candidate weight once per ratio and
 * runs a batched matmul over the groups: about ten passes through buffers of the weights' size per ratio,
 * and a permuted copy for the matmul. This kernel keeps sixteen rows of one group column and that
 * group's H (one weight's (size, size) block) in L1 through every ratio.
 *
 * group_clip_<isa>(x, weights, rows, groups, size, hessian, step, zero, qmin, qmax, count, threads, best):
 *   x holds `weights` weights of `rows` rows of `groups` groups of `size` fp32 values, contiguous
 *   ((weights·rows, groups·size), with rows·groups·size < 2^31: the gathers take int32 offsets); hessian
 *   holds per weight and group one contiguous (size, size) fp32 matrix ((weights, groups, size, size));
 *   step and zero hold per candidate, row and group an fp32 step and zero point ((count, weights·rows,
 *   groups)). For candidate c, with s = step[c][r][b], z = zero[c][r][b], and the group's values x_k:
 *     code_k = min(qmax, max(qmin, rint(x_k/s) + z))   (as eager's element_codes: x/s correctly rounded,
 *                                                       half to even, the zero point added, clamped)
 *     dw_k   = x_k - (code_k - z)·s                     (eager's codes.sub_(z).mul_(s), then x minus that)
 *     form   = Σ_j dw_j · (Σ_i dw_i·H[i][j])            (bmm(dw, H) times dw, summed)
 *   and best[r*groups + b] (int64) gets the pick as eager keeps it: candidate 0 first, then a candidate
 *   only when its form is strictly less than the kept one (a NaN form never replaces, a NaN kept form is
 *   never replaced). The codes and dw are eager's bit for bit; the form is summed in a fixed order with
 *   fused multiply-adds (i, then j, in order), another order than the eager matmul's, so it differs from
 *   eager's by a few ulps of its terms' magnitudes, which can move a pick only between two candidates
 *   that tie that closely. Candidates giving the same dequantized group give the same form (each runs the
 *   same operations), so exact ties keep the first, as eager does. The AVX-512 (16 lanes) and AVX2 (8
 *   lanes) variants run the same operations per lane: their picks are identical.
 *
 * Layout: one lane per row, sixteen (AVX2: eight) rows of one weight and group column at once, so H is
 * shared by every lane (a broadcast operand) and the steps and zero points are gathered per lane. A last
 * tile of a weight with fewer rows runs with its missing lanes masked (zeros, never stored). Work units are
 * (weight, tile, group) triples, consecutive groups of the same rows, split over the threads by OpenMP.
 * simd_level() (simd_level.h) says which variants this CPU runs.
 */
#include <stdint.h>

#define MAX_SIZE 256 /* the widest group the kernel takes (observers/awq.py asks only up to this) */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* What the exported functions share with the per-unit loops. */
struct clip_search {
    const float *x, *hessian, *step, *zero;
    int64_t weights, rows, groups, size, count;
    float qmin, qmax;
    int64_t *best;
};

static struct clip_search make_search(const float *x, int64_t weights, int64_t rows, int64_t groups, int64_t size,
                                      const float *hessian, const float *step, const float *zero, float qmin,
                                      float qmax, int64_t count, int64_t *best) {
    struct clip_search w;
    w.x = x;
    w.hessian = hessian;
    w.step = step;
    w.zero = zero;
    w.weights = weights;
    w.rows = rows;
    w.groups = groups;
    w.size = size;
    w.count = count;
    w.qmin = qmin;
    w.qmax = qmax;
    w.best = best;
    return w;
}

/* ---------------------------------------------------------------- AVX-512 */

/* Rows r0 .. r0+live-1 (global row indices, one weight's) of group b through every candidate. */
__attribute__((target("avx512f"))) static void tile_avx512(const struct clip_search *w, int64_t weight, int64_t r0,
                                                           int live, int64_t b) {
    const int64_t size = w->size, stride = w->groups * size, all_rows = w->weights * w->rows;
    const __mmask16 lanes = (__mmask16)((1u << live) - 1u);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)stride));
    const __m512i entries = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)w->groups));
    const float *base = w->x + r0 * stride + b * size;
    const float *h = w->hessian + (weight * w->groups + b) * size * size;
    const __m512 vlo = _mm512_set1_ps(w->qmin), vhi = _mm512_set1_ps(w->qmax);
    __m512 t[MAX_SIZE], dw[MAX_SIZE], hdw[MAX_SIZE];
    for (int64_t k = 0; k < size; ++k)
        t[k] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, _mm512_add_epi32(rows, _mm512_set1_epi32((int)k)),
                                        base, 4);
    __m512 kept = _mm512_setzero_ps();
    __m512i index = _mm512_setzero_si512();
    for (int64_t c = 0; c < w->count; ++c) {
        const int64_t at = (c * all_rows + r0) * w->groups + b;
        const __m512 s = _mm512_mask_i32gather_ps(_mm512_set1_ps(1.0f), lanes, entries, w->step + at, 4);
        const __m512 z = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, entries, w->zero + at, 4);
        for (int64_t i = 0; i < size; ++i) {
            const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(t[i], s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512 code = _mm512_min_ps(vhi, _mm512_max_ps(vlo, _mm512_add_ps(q, z))); /* NaN stays NaN */
            dw[i] = _mm512_sub_ps(t[i], _mm512_mul_ps(_mm512_sub_ps(code, z), s));
        }
        for (int64_t j = 0; j < size; ++j) hdw[j] = _mm512_mul_ps(dw[0], _mm512_set1_ps(h[j]));
        for (int64_t i = 1; i < size; ++i) {
            const float *hi = h + i * size;
            for (int64_t j = 0; j < size; ++j) hdw[j] = _mm512_fmadd_ps(dw[i], _mm512_set1_ps(hi[j]), hdw[j]);
        }
        __m512 form = _mm512_mul_ps(dw[0], hdw[0]);
        for (int64_t j = 1; j < size; ++j) form = _mm512_fmadd_ps(dw[j], hdw[j], form);
        if (c == 0) {
            kept = form;
            continue;
        }
        const __mmask16 lower = _mm512_cmp_ps_mask(form, kept, _CMP_LT_OQ); /* strict: the first least stays */
        kept = _mm512_mask_mov_ps(kept, lower, form);
        index = _mm512_mask_mov_epi32(index, lower, _mm512_set1_epi32((int)c));
    }
    int32_t picked[16];
    _mm512_storeu_si512((void *)picked, index);
    for (int l = 0; l < live; ++l) w->best[(r0 + l) * w->groups + b] = picked[l];
}

__attribute__((target("avx512f"))) void group_clip_avx512(const float *x, int64_t weights, int64_t rows,
                                                          int64_t groups, int64_t size, const float *hessian,
                                                          const float *step, const float *zero, float qmin,
                                                          float qmax, int64_t count, int threads, int64_t *best) {
    const struct clip_search w = make_search(x, weights, rows, groups, size, hessian, step, zero, qmin, qmax, count, best);
    const int64_t tiles = (rows + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < weights * tiles * groups; ++u) {
        const int64_t weight = u / (tiles * groups), tile = (u / groups) % tiles, r = tile * 16;
        const int live = rows - r < 16 ? (int)(rows - r) : 16;
        tile_avx512(&w, weight, weight * rows + r, live, u % groups);
    }
}

/* ---------------------------------------------------------------- AVX2 */

/* As tile_avx512 over eight lanes, in the same operations and order per lane. */
__attribute__((target("avx2,fma"))) static void tile_avx2(const struct clip_search *w, int64_t weight, int64_t r0,
                                                          int live, int64_t b) {
    const int64_t size = w->size, stride = w->groups * size, all_rows = w->weights * w->rows;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lanes = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live), lane));
    const __m256i rows = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)stride));
    const __m256i entries = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)w->groups));
    const float *base = w->x + r0 * stride + b * size;
    const float *h = w->hessian + (weight * w->groups + b) * size * size;
    const __m256 vlo = _mm256_set1_ps(w->qmin), vhi = _mm256_set1_ps(w->qmax);
    __m256 t[MAX_SIZE], dw[MAX_SIZE], hdw[MAX_SIZE];
    for (int64_t k = 0; k < size; ++k)
        t[k] = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base, _mm256_add_epi32(rows, _mm256_set1_epi32((int)k)),
                                        lanes, 4);
    __m256 kept = _mm256_setzero_ps();
    __m256i index = _mm256_setzero_si256();
    for (int64_t c = 0; c < w->count; ++c) {
        const int64_t at = (c * all_rows + r0) * w->groups + b;
        const __m256 s = _mm256_mask_i32gather_ps(_mm256_set1_ps(1.0f), w->step + at, entries, lanes, 4);
        const __m256 z = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), w->zero + at, entries, lanes, 4);
        for (int64_t i = 0; i < size; ++i) {
            const __m256 q = _mm256_round_ps(_mm256_div_ps(t[i], s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256 code = _mm256_min_ps(vhi, _mm256_max_ps(vlo, _mm256_add_ps(q, z))); /* NaN stays NaN */
            dw[i] = _mm256_sub_ps(t[i], _mm256_mul_ps(_mm256_sub_ps(code, z), s));
        }
        for (int64_t j = 0; j < size; ++j) hdw[j] = _mm256_mul_ps(dw[0], _mm256_set1_ps(h[j]));
        for (int64_t i = 1; i < size; ++i) {
            const float *hi = h + i * size;
            for (int64_t j = 0; j < size; ++j) hdw[j] = _mm256_fmadd_ps(dw[i], _mm256_set1_ps(hi[j]), hdw[j]);
        }
        __m256 form = _mm256_mul_ps(dw[0], hdw[0]);
        for (int64_t j = 1; j < size; ++j) form = _mm256_fmadd_ps(dw[j], hdw[j], form);
        if (c == 0) {
            kept = form;
            continue;
        }
        const __m256 lower = _mm256_cmp_ps(form, kept, _CMP_LT_OQ); /* strict: the first least stays */
        kept = _mm256_blendv_ps(kept, form, lower);
        index = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(index), _mm256_castsi256_ps(_mm256_set1_epi32((int)c)), lower));
    }
    int32_t picked[8];
    _mm256_storeu_si256((__m256i *)picked, index);
    for (int l = 0; l < live; ++l) w->best[(r0 + l) * w->groups + b] = picked[l];
}

__attribute__((target("avx2,fma"))) void group_clip_avx2(const float *x, int64_t weights, int64_t rows,
                                                         int64_t groups, int64_t size, const float *hessian,
                                                         const float *step, const float *zero, float qmin, float qmax,
                                                         int64_t count, int threads, int64_t *best) {
    const struct clip_search w = make_search(x, weights, rows, groups, size, hessian, step, zero, qmin, qmax, count, best);
    const int64_t tiles = (rows + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < weights * tiles * groups; ++u) {
        const int64_t weight = u / (tiles * groups), tile = (u / groups) % tiles, r = tile * 8;
        const int live = rows - r < 8 ? (int)(rows - r) : 8;
        tile_avx2(&w, weight, weight * rows + r, live, u % groups);
    }
}

#endif

#include "simd_level.h"
