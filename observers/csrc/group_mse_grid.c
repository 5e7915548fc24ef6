/* Error of every shrink-grid candidate of mse_grid, per group, in one read of the data.
 *
 * The eager search (observers/mse_grid.py, _unit_errors) runs about eight torch passes per
 * candidate (divide, round, clamp, subtract, abs, log, multiply, exp), each a round trip through
 * a buffer. This kernel evaluates the candidates while a piece of a row sits in L1, eight (AVX2:
 * four) candidates per loaded vector written stage by stage (independent dependency chains, so
 * the long log/exp chains overlap), with table-driven log2/exp2 polynomials instead of libm.
 * Built with -fopenmp -ffp-contract=off and loaded by observers/kernels.py (plain C, no torch
 * headers; the loop runs on torch's own OpenMP threads).
 *
 * group_mse_grid_<isa>(x, weight, rows, run, piece, groups, count, step, low, high, bound_c,
 *                      bound_q, norm, direct, threads, out):
 *   x (and weight, or NULL for unweighted) hold `rows` contiguous rows of `run` fp32 values;
 *   row r belongs to group q = r % groups (the (N, Q, K) layout read as N*Q rows). Each row is
 *   cut into pieces of `piece` values (the last may be shorter); unit u = r * pieces + p is
 *   piece p of row r. For candidate c, with s = step[c*groups + q],
 *   lo = low[c*bound_c + q*bound_q] and hi = high[c*bound_c + q*bound_q],
 *     out[c*units + u] = sum over the piece of  weight * |clamp(rint(x/s), lo, hi) - x/s|^norm
 *   summed in fp32, in the same order for a candidate whatever `count` is. x/s is a true
 *   division (the one fake_quantize does, so the codes are the eager codes) and rint rounds half
 *   to even; low and high are integers within +-2^22 (int codes). With `direct` the error is
 *   measured in the data's units instead, |clamp(rint(x/s), lo, hi)*s - x| (the dequantized value
 *   minus x, as observers/lc_search.py measures it). |e|^norm is exact for norm 1 and 2 (and 3
 *   with `direct`, as torch.pow), else 2^(norm*log2 e) with 0^norm = 0: log2 from a 32-entry (AVX2: 8) table and a
 *   degree-3 (5) polynomial, exp2 from a 16-entry table, a degree-3 polynomial and scalef (AVX2:
 *   a degree-6 polynomial and the exponent bits), a few ulps from the exact power, as torch's
 *   exp(norm*log e) on the eager path. A NaN quotient (0/0 from a zero step) makes the sum NaN,
 *   as on the eager path.
 * simd_level() (simd_level.h) says which variants this CPU runs.
 */
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "simd_power.h"

/* What the exported functions share with the per-unit loops; out is (count, units). */
struct grid {
    const float *step, *low, *high;
    int64_t groups, count, bound_c, bound_q, units;
    float norm;
    int direct;
    const float *log_table; /* power_avx512's */
};

/* The powers computed exactly, as the eager paths do: _power_ (steps) squares for norm 2;
 * torch.pow (direct errors) also cubes for norm 3, as (e*e)*e. */
/* ---------------------------------------------------------------- AVX-512 */


/* err[j] = |clamp(rint(v/s[j]), lo[j], hi[j]) - v/s[j]|^norm for the `width` candidates j (with
 * `direct`, |clamp(...)*s[j] - v|^norm).
 * Written stage by stage across the candidates, so the out-of-order core always has `width`
 * independent operations at hand: one candidate's chain (divide, round, log2, exp2) is about
 * 100 cycles long, more than its scheduler covers from a few chains. The code is rounded after
 * the clamp (the same value: the bounds are integers) with the 1.5*2^23 trick, exact for |v| <=
 * 2^22, which the clamp ensures. |e|^norm: exact for norm 1 and 2, else 2^(norm*log2 e), 0 -> 0. */
__attribute__((target("avx512f"), always_inline)) static inline void
errors_avx512(__m512 v, const __m512 *s, const __m512 *lo, const __m512 *hi, __m512 norm, int direct, int width,
              int kind, const float *log_table, __m512 *err) {
    const __m512 round_magic = _mm512_set1_ps(0x1.8p23f);
    __m512 scaled[WIDTH_AVX512], a[WIDTH_AVX512];
    EACH scaled[j] = _mm512_div_ps(v, s[j]);
    EACH a[j] = _mm512_min_ps(hi[j], _mm512_max_ps(lo[j], scaled[j])); /* second operands: NaN propagates */
    EACH a[j] = _mm512_sub_ps(_mm512_add_ps(a[j], round_magic), round_magic);
    if (direct) { /* |code*s - v| = |fake_quant(v) - v|, rounded as the eager dequantization */
        EACH err[j] = _mm512_abs_ps(_mm512_sub_ps(_mm512_mul_ps(a[j], s[j]), v));
    } else {
        EACH err[j] = _mm512_abs_ps(_mm512_sub_ps(a[j], scaled[j]));
    }
    power_avx512(err, norm, width, kind, log_table);
}

/* Errors of `width` candidates (first c) over one piece, each summed in its own accumulator;
 * out points at this unit's entry of candidate 0. */
__attribute__((target("avx512f"), always_inline)) static inline void
candidates_avx512(const float *x, const float *w, int64_t length, const struct grid *g, int64_t q, int64_t c,
                  int width, int kind, float *out) {
    const __m512 norm = _mm512_set1_ps(g->norm);
    __m512 s[WIDTH_AVX512], lo[WIDTH_AVX512], hi[WIDTH_AVX512], sum[WIDTH_AVX512];
    EACH {
        const int64_t b = (c + j) * g->bound_c + q * g->bound_q;
        s[j] = _mm512_set1_ps(g->step[(c + j) * g->groups + q]);
        lo[j] = _mm512_set1_ps(g->low[b]);
        hi[j] = _mm512_set1_ps(g->high[b]);
        sum[j] = _mm512_setzero_ps();
    }
    __m512 err[WIDTH_AVX512];
    int64_t i = 0;
    for (; i + 16 <= length; i += 16) {
        errors_avx512(_mm512_loadu_ps(x + i), s, lo, hi, norm, g->direct, width, kind, g->log_table, err);
        if (w) {
            EACH err[j] = _mm512_mul_ps(err[j], _mm512_loadu_ps(w + i));
        }
        EACH sum[j] = _mm512_add_ps(sum[j], err[j]);
    }
    if (i < length) {
        const __mmask16 tail = (__mmask16)((1u << (length - i)) - 1u);
        errors_avx512(_mm512_maskz_loadu_ps(tail, x + i), s, lo, hi, norm, g->direct, width, kind, g->log_table,
                      err);
        if (w) {
            EACH err[j] = _mm512_mul_ps(err[j], _mm512_maskz_loadu_ps(tail, w + i));
        }
        EACH sum[j] = _mm512_mask_add_ps(sum[j], tail, sum[j], err[j]);
    }
    EACH out[(c + j) * g->units] = _mm512_reduce_add_ps(sum[j]);
}

/* All candidates of one unit; `kind` is a constant at each call site, so each power gets its own loops. */
__attribute__((target("avx512f"), always_inline)) static inline void
unit_errors_avx512(const float *x, const float *w, int64_t length, const struct grid *g, int64_t q, int kind,
                   float *out) {
    int64_t c = 0;
    for (; c + 8 <= g->count; c += 8) candidates_avx512(x, w, length, g, q, c, 8, kind, out);
    for (; c + 4 <= g->count; c += 4) candidates_avx512(x, w, length, g, q, c, 4, kind, out);
    for (; c < g->count; ++c) candidates_avx512(x, w, length, g, q, c, 1, kind, out);
}

__attribute__((target("avx512f"))) void group_mse_grid_avx512(const float *x, const float *weight, int64_t rows,
                                                              int64_t run, int64_t piece, int64_t groups,
                                                              int64_t count, const float *step, const float *low,
                                                              const float *high, int64_t bound_c, int64_t bound_q,
                                                              double norm, int direct, int threads, float *out) {
    const int64_t pieces = (run + piece - 1) / piece;
    float log_table[POWER_LOG_TABLE];
    power_log_table((float)norm, log_table);
    const struct grid g = {step,  low,   high, groups, count, bound_c, bound_q, rows * pieces, (float)norm,
                           direct, log_table};
    const int kind = power_kind(norm, direct);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < rows * pieces; ++u) {
        const int64_t r = u / pieces, start = (u % pieces) * piece;
        const int64_t length = run - start < piece ? run - start : piece;
        const float *p = x + r * run + start, *w = weight ? weight + r * run + start : 0;
        if (kind == POWER_ONE)
            unit_errors_avx512(p, w, length, &g, r % groups, POWER_ONE, out + u);
        else if (kind == POWER_TWO)
            unit_errors_avx512(p, w, length, &g, r % groups, POWER_TWO, out + u);
        else if (kind == POWER_THREE)
            unit_errors_avx512(p, w, length, &g, r % groups, POWER_THREE, out + u);
        else
            unit_errors_avx512(p, w, length, &g, r % groups, POWER_ANY, out + u);
    }
}

/* ---------------------------------------------------------------- AVX2 */


/* As errors_avx512 with AVX2's instructions: the exponent and mantissa come from the bits
 * (denormals scaled by 2^23 first), log2 from an 8-entry table and a degree-5 series, 2^n is
 * applied in two halves (gradual underflow), and +inf/NaN errors pass through unchanged. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
errors_avx2(__m256 v, const __m256 *s, const __m256 *lo, const __m256 *hi, __m256 norm, int direct, int width,
            int kind, __m256 *err) {
    const __m256 round_magic = _mm256_set1_ps(0x1.8p23f);
    __m256 scaled[WIDTH_AVX2], a[WIDTH_AVX2];
    EACH scaled[j] = _mm256_div_ps(v, s[j]);
    EACH a[j] = _mm256_min_ps(hi[j], _mm256_max_ps(lo[j], scaled[j])); /* second operands: NaN propagates */
    EACH a[j] = _mm256_sub_ps(_mm256_add_ps(a[j], round_magic), round_magic);
    if (direct) {
        EACH a[j] = _mm256_sub_ps(_mm256_mul_ps(a[j], s[j]), v);
    } else {
        EACH a[j] = _mm256_sub_ps(a[j], scaled[j]);
    }
    EACH err[j] = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a[j]);
    power_avx2(err, norm, width, kind);
}

/* As candidates_avx512; the tail is read with a lane mask and its masked lanes add zero. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
candidates_avx2(const float *x, const float *w, int64_t length, const struct grid *g, int64_t q, int64_t c, int width,
                int kind, float *out) {
    const __m256 norm = _mm256_set1_ps(g->norm);
    __m256 s[WIDTH_AVX2], lo[WIDTH_AVX2], hi[WIDTH_AVX2], sum[WIDTH_AVX2], err[WIDTH_AVX2];
    EACH {
        const int64_t b = (c + j) * g->bound_c + q * g->bound_q;
        s[j] = _mm256_set1_ps(g->step[(c + j) * g->groups + q]);
        lo[j] = _mm256_set1_ps(g->low[b]);
        hi[j] = _mm256_set1_ps(g->high[b]);
        sum[j] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 8 <= length; i += 8) {
        errors_avx2(_mm256_loadu_ps(x + i), s, lo, hi, norm, g->direct, width, kind, err);
        if (w) {
            EACH err[j] = _mm256_mul_ps(err[j], _mm256_loadu_ps(w + i));
        }
        EACH sum[j] = _mm256_add_ps(sum[j], err[j]);
    }
    if (i < length) {
        const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(length - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        errors_avx2(_mm256_maskload_ps(x + i, tail), s, lo, hi, norm, g->direct, width, kind, err);
        if (w) {
            EACH err[j] = _mm256_mul_ps(err[j], _mm256_maskload_ps(w + i, tail));
        }
        EACH sum[j] = _mm256_add_ps(sum[j], _mm256_and_ps(err[j], _mm256_castsi256_ps(tail)));
    }
    EACH out[(c + j) * g->units] = sum_avx2(sum[j]);
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
unit_errors_avx2(const float *x, const float *w, int64_t length, const struct grid *g, int64_t q, int kind,
                 float *out) {
    int64_t c = 0;
    for (; c + 4 <= g->count; c += 4) candidates_avx2(x, w, length, g, q, c, 4, kind, out);
    for (; c < g->count; ++c) candidates_avx2(x, w, length, g, q, c, 1, kind, out);
}

__attribute__((target("avx2,fma"))) void group_mse_grid_avx2(const float *x, const float *weight, int64_t rows,
                                                            int64_t run, int64_t piece, int64_t groups, int64_t count,
                                                            const float *step, const float *low, const float *high,
                                                            int64_t bound_c, int64_t bound_q, double norm, int direct,
                                                            int threads, float *out) {
    const int64_t pieces = (run + piece - 1) / piece;
    const struct grid g = {step, low, high, groups, count, bound_c, bound_q, rows * pieces, (float)norm, direct, 0};
    const int kind = power_kind(norm, direct);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < rows * pieces; ++u) {
        const int64_t r = u / pieces, start = (u % pieces) * piece;
        const int64_t length = run - start < piece ? run - start : piece;
        const float *p = x + r * run + start, *w = weight ? weight + r * run + start : 0;
        if (kind == POWER_ONE)
            unit_errors_avx2(p, w, length, &g, r % groups, POWER_ONE, out + u);
        else if (kind == POWER_TWO)
            unit_errors_avx2(p, w, length, &g, r % groups, POWER_TWO, out + u);
        else if (kind == POWER_THREE)
            unit_errors_avx2(p, w, length, &g, r % groups, POWER_THREE, out + u);
        else
            unit_errors_avx2(p, w, length, &g, r % groups, POWER_ANY, out + u);
    }
}

#endif

#include "simd_level.h"
