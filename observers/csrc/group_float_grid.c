/* Error of every candidate scale of a float-element search (FP4 E2M1, FP6 E3M2/E2M3, FP8 E4M3/E5M2,
 * NVFP4's E2M1 with its E4M3 block scales), per group, in one read of the data.
 *
 * The eager float searches (observers/mse_grid.py, observers/lc_search.py, observers/modelopt_search.py)
 * run a dozen torch passes per candidate (divide, clamp, exponent bits, multiply, round, divide,
 * subtract, abs, power, sum), each a round trip through a buffer; the float grid rounding alone is six.
 * This kernel is group_mse_grid.c with the integer clamp-and-round replaced by the float grid rounding
 * of observers/formats.py (round_to_float_grid_), bit for bit, from float_grid.h: clamp to +-max_value,
 * round to a multiple of the binade's step 2^(e - man_bits), half to even (one add and one subtract of a
 * constant whose ulp is the step).
 *
 * group_float_grid_<isa>(x, weight, rows, run, piece, groups, count, step, step_c, step_q, exp_bits,
 *                        man_bits, max_value, norm, direct, factor, best_value, best_index, rule, amax,
 *                        p, global, power, divisor, eps, threads, out):
 *   x (and weight, or NULL) hold `rows` contiguous rows of `run` fp32 values; row r belongs to group
 *   q = r % groups. Rows are cut into pieces of `piece` values; unit u = r * pieces + p. For candidate
 *   c the step s of group q is, by `rule`: 0, step[c*step_c + q*step_q] (step_q 0: one step per
 *   candidate for every group, as the NVFP4 FP8 sweep tries); 1 (free fp32 rule),
 *   max(amax[q]*p[c] / divisor, eps); 2 (NVFP4), e4m3(clamp(amax[q]*p[c] / divisor * global[c], 2^-9,
 *   448)) / global[c], the E4M3 cast of the block scale inside the candidate loop. These are the fp32
 *   operations of the torch rules in their order, so the steps are theirs bit for bit.
 *   With code = round_to_float_grid(x/s) (x/s correctly rounded, as fake_quantize divides),
 *     out[c*units + u] = sum over the piece of  weight * |code - x/s|^norm        (in steps)
 *   or with `direct`   sum of weight * |code*s - x|^norm                        (in the data's units)
 *   summed in fp32, in the same order for a candidate whatever `count` is. The power is computed as in
 *   group_mse_grid.c: exact for norm 1 and 2 (and 3 with `direct`), else a few ulps from the exact power.
 *   A NaN quotient makes the sum NaN, an infinite one infinite, as on the eager path.
 *   Pick mode (best_index not NULL; each unit must then be a whole group): instead of out, each unit
 *   writes the least of its candidates' sums (times factor[c*step_c + q*step_q] when factor is given,
 *   or with rule 2 and `power`, power[c*128 + E4M3 code of the block scale]: s^norm for errors in steps)
 *   to best_value[u] and the first candidate reaching it to best_index[u], NaN read as +inf: the (C, Q)
 *   errors are never written or read back.
 *   AVX-512 also has a lane-per-row path for short groups (run <= 32, groups % 16 == 0: NVFP4, MX) and
 *   divides by one fma-corrected reciprocal multiply (exact; see reciprocals_avx512).
 * simd_level() (simd_level.h) says which variants this CPU runs.
 */
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "float_grid.h"
#include "simd_power.h"

/* What the exported functions share with the per-unit loops; out is (count, units). `elements` is the
 * element grid (float_grid.h), `e4m3` the block scales' grid of rule 2. */
struct grid {
    const float *step;
    int64_t step_c, step_q, count, units;
    float norm;
    struct float_grid elements, e4m3;
    float log_table[POWER_LOG_TABLE]; /* power_avx512's */
    int direct;
    /* the step rule: 0 the step table; 1 free, s = max(amax[q]*p[c] / divisor, eps); 2 NVFP4,
     * s = e4m3(clamp(amax[q]*p[c] / divisor * global[c], 2^-9, 448)) / global[c], with power[c*128 + code]
     * the factor (s^norm) of E4M3 code `code` */
    int rule;
    const float *amax, *p, *global, *power;
    float divisor, eps;
};

enum { RULE_TABLE = 0, RULE_FREE = 1, RULE_E4M3 = 2 };

/* The E4M3 code (1..126) of an E4M3 value >= 2^-9. */
static inline int e4m3_code(float e) {
    if (e < 0x1p-6f) return (int)(e * 512.0f);
    const uint32_t b = float_bits(e);
    return (int)((((b >> 23) - 120u) << 3) | ((b >> 20) & 7u));
}

/* Candidate c's step for group q (and, rule 2, its E4M3 code), in the caller's fp32 operations. */
static inline float step_of(const struct grid *g, int64_t c, int64_t q, int *code) {
    if (g->rule == RULE_TABLE) return g->step[c * g->step_c + q * g->step_q];
    const float a = g->amax[q] * g->p[c];
    if (g->rule == RULE_FREE) {
        const float s = a / g->divisor;
        return s < g->eps ? g->eps : s;
    }
    float raw = a / g->divisor * g->global[c];
    raw = raw < 0x1p-9f ? 0x1p-9f : (raw > 448.0f ? 448.0f : raw);
    const float e = float_grid_round(raw, &g->e4m3); /* torch's cast: round half to even */
    if (code) *code = e4m3_code(e);
    return e / g->global[c];
}

/* The pick factor of candidate c and group q (NULL table: 1). */
static inline float factor_of(const struct grid *g, const float *factor, int64_t c, int64_t q) {
    if (g->rule == RULE_E4M3 && g->power) {
        int code = 0;
        step_of(g, c, q, &code);
        return g->power[c * 128 + code];
    }
    return factor ? factor[c * g->step_c + q * g->step_q] : 1.0f;
}

/* The grid constants of an E<exp_bits>M<man_bits> format saturating at max_value (and, below, the step rule). */
static struct grid make_grid(const float *step, int64_t step_c, int64_t step_q, int64_t count, int64_t units,
                             int exp_bits, int man_bits, double max_value, double norm, int direct) {
    struct grid g;
    g.step = step;
    g.step_c = step_c;
    g.step_q = step_q;
    g.count = count;
    g.units = units;
    g.norm = (float)norm;
    g.elements = float_grid_of(exp_bits, man_bits, max_value);
    g.e4m3 = float_grid_of(4, 3, 448.0);
    power_log_table(g.norm, g.log_table);
    g.direct = direct;
    g.rule = 0;
    g.amax = g.p = g.global = g.power = 0;
    g.divisor = 1.0f;
    g.eps = 0.0f;
    return g;
}

static void set_rule(struct grid *g, int rule, const float *amax, const float *p, const float *global,
                     const float *power, double divisor, double eps) {
    g->rule = rule;
    g->amax = amax;
    g->p = p;
    g->global = global;
    g->power = power;
    g->divisor = (float)divisor;
    g->eps = (float)eps;
}

/* The powers computed exactly, as the eager paths do: _power_ (steps) squares for norm 2;
 * torch.pow (direct errors) also cubes for norm 3, as (e*e)*e. */
/* Pick mode: the least of a unit's candidate errors (each times factor[c*step_c + q*step_q] when
 * factor is given, one fp32 product as the caller's torch mul), NaN read as +inf, the first on
 * ties: what torch's argmin over nan_to_num(errors) gives. */
static void pick(const float *sums, const struct grid *g, const float *factor, int64_t q, float *best_value,
                 int64_t *best_index) {
    float least = __builtin_inff();
    int64_t index = 0;
    for (int64_t c = 0; c < g->count; ++c) {
        float value = sums[c];
        if (factor || (g->rule == RULE_E4M3 && g->power)) value = value * factor_of(g, factor, c, q);
        if (value != value) value = __builtin_inff();
        if (value < least) {
            least = value;
            index = c;
        }
    }
    *best_value = least;
    *best_index = index;
}

/* ---------------------------------------------------------------- AVX-512 */



/* 1/s of each candidate's steps, and whether the divide-free quotient is exact for every lane and value
 * up to `amax` (float_grid_fast_quotient's rule, lane by lane: s in [2^-125, 2^125] and no quotient
 * reaching 2^126, where v*(1/s) could overflow and the correction make it NaN); the rare other steps
 * (infinite, zero, huge, tiny beside the data) take the divide. */
__attribute__((target("avx512f"), always_inline)) static inline int
reciprocals_avx512(const __m512 *s, __m512 amax, int width, __m512 *rs) {
    __mmask16 safe = 0xFFFF;
    EACH {
        rs[j] = _mm512_div_ps(_mm512_set1_ps(1.0f), s[j]);
        const __m512 size = _mm512_abs_ps(s[j]);
        safe &= _mm512_cmp_ps_mask(size, _mm512_set1_ps(0x1p-125f), _CMP_GE_OQ) &
                _mm512_cmp_ps_mask(size, _mm512_set1_ps(0x1p125f), _CMP_LE_OQ) &
                _mm512_cmp_ps_mask(_mm512_mul_ps(amax, _mm512_abs_ps(rs[j])), _mm512_set1_ps(0x1p126f), _CMP_LT_OQ);
    }
    return safe == 0xFFFF;
}

/* err[j] = |grid(v/s[j]) - v/s[j]|^norm for the `width` candidates j (with `direct`,
 * |grid(v/s[j])*s[j] - v|^norm), grid() the float grid rounding of formats.py (float_grid.h) after the
 * correctly rounded v/s. Written stage by stage across the candidates, so the out-of-order core always
 * has `width` independent operations at hand. |e|^norm: exact for norm 1 and 2, else 2^(norm*log2 e),
 * 0 -> 0. */
__attribute__((target("avx512f"), always_inline)) static inline void
errors_avx512(__m512 v, const __m512 *s, const __m512 *rs, int fast, const struct grid *g, __m512 norm, int width,
              int kind, __m512 *err) {
    __m512 scaled[WIDTH_AVX512], a[WIDTH_AVX512];
    if (fast) {
        EACH scaled[j] = float_grid_quotient_avx512(v, s[j], rs[j]);
    } else {
        EACH scaled[j] = _mm512_div_ps(v, s[j]);
    }
    EACH a[j] = float_grid_round_avx512(scaled[j], &g->elements);
    /* code*s - v = fake_quant(v) - v, rounded as the eager dequantization; only the odd powers take its
     * magnitude here (the square and the general power read |e| themselves) */
    if (g->direct) {
        EACH err[j] = _mm512_sub_ps(_mm512_mul_ps(a[j], s[j]), v);
    } else {
        EACH err[j] = _mm512_sub_ps(a[j], scaled[j]);
    }
    if (kind == POWER_ONE || kind == POWER_THREE) {
        EACH err[j] = _mm512_abs_ps(err[j]);
    }
    if (width == 8) { /* in halves: eight candidates' powers at once spill more than they overlap */
        power_avx512(err, norm, 4, kind, g->log_table);
        power_avx512(err + 4, norm, 4, kind, g->log_table);
    } else {
        power_avx512(err, norm, width, kind, g->log_table);
    }
}

/* The largest |v| of a piece (what bounds its quotients). */
__attribute__((target("avx512f"), always_inline)) static inline __m512 piece_amax_avx512(const float *x,
                                                                                        int64_t length) {
    __m512 amax = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= length; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    if (i < length)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps((__mmask16)((1u << (length - i)) - 1u), x + i)));
    return _mm512_set1_ps(_mm512_reduce_max_ps(amax));
}

/* Errors of `width` candidates (first c) over one piece, each summed in its own accumulator;
 * out points at this unit's entry of candidate 0. */
__attribute__((target("avx512f"), always_inline)) static inline void
candidates_avx512(const float *x, const float *w, int64_t length, __m512 amax, const struct grid *g, int64_t q,
                  int64_t c, int width, int kind, float *out) {
    const __m512 norm = _mm512_set1_ps(g->norm);
    __m512 s[WIDTH_AVX512], sum[WIDTH_AVX512];
    EACH {
        s[j] = _mm512_set1_ps(step_of(g, c + j, q, 0));
        sum[j] = _mm512_setzero_ps();
    }
    __m512 err[WIDTH_AVX512], rs[WIDTH_AVX512];
    const int fast = reciprocals_avx512(s, amax, width, rs);
    int64_t i = 0;
    for (; i + 16 <= length; i += 16) {
        errors_avx512(_mm512_loadu_ps(x + i), s, rs, fast, g, norm, width, kind, err);
        if (w) {
            EACH err[j] = _mm512_mul_ps(err[j], _mm512_loadu_ps(w + i));
        }
        EACH sum[j] = _mm512_add_ps(sum[j], err[j]);
    }
    if (i < length) {
        const __mmask16 tail = (__mmask16)((1u << (length - i)) - 1u);
        errors_avx512(_mm512_maskz_loadu_ps(tail, x + i), s, rs, fast, g, norm, width, kind, err);
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
    const __m512 amax = piece_amax_avx512(x, length);
    int64_t c = 0;
    for (; c + 8 <= g->count; c += 8) candidates_avx512(x, w, length, amax, g, q, c, 8, kind, out);
    for (; c + 4 <= g->count; c += 4) candidates_avx512(x, w, length, amax, g, q, c, 4, kind, out);
    for (; c < g->count; ++c) candidates_avx512(x, w, length, amax, g, q, c, 1, kind, out);
}

/* Short groups (run <= 32: NVFP4's 16, MX's 32), sixteen rows at a time, one row per lane: element k
 * of the sixteen rows is gathered into one vector, so each candidate's sums build up lane-wise over k
 * (no horizontal sum per row and candidate), a candidate's sixteen steps are one load (or one
 * broadcast) and the pick is a vector compare. The sums run over k in order (another order than the
 * one-row loop, the same for every candidate). Needs groups % 16 == 0 (the sixteen rows are sixteen
 * consecutive groups) and step_q 0 or 1. */
__attribute__((target("avx512f"), always_inline)) static inline void
block_candidates_avx512(const __m512 *t, const __m512 *tw, int64_t run, __m512 amax, const struct grid *g,
                        const float *factor, int64_t q, int64_t c, int width, int kind, float *out, __m512 *best,
                        __m512i *index) {
    const __m512 norm = _mm512_set1_ps(g->norm);
    __m512 s[WIDTH_AVX512], err[WIDTH_AVX512], sum[WIDTH_AVX512];
    __m512i code[WIDTH_AVX512];
    EACH {
        sum[j] = _mm512_setzero_ps();
        code[j] = _mm512_setzero_si512();
        if (g->rule == RULE_TABLE) {
            const float *at = g->step + (c + j) * g->step_c + q * g->step_q;
            s[j] = g->step_q ? _mm512_loadu_ps(at) : _mm512_set1_ps(*at);
            continue;
        }
        const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(g->amax + q), _mm512_set1_ps(g->p[c + j]));
        if (g->rule == RULE_FREE) {
            s[j] = _mm512_max_ps(_mm512_set1_ps(g->eps), _mm512_div_ps(a, _mm512_set1_ps(g->divisor)));
            continue;
        }
        const __m512 global = _mm512_set1_ps(g->global[c + j]);
        __m512 raw = _mm512_mul_ps(_mm512_div_ps(a, _mm512_set1_ps(g->divisor)), global);
        raw = _mm512_min_ps(_mm512_set1_ps(448.0f), _mm512_max_ps(_mm512_set1_ps(0x1p-9f), raw));
        const __m512 e = float_grid_round_avx512(raw, &g->e4m3); /* torch's cast: round half to even */
        s[j] = _mm512_div_ps(e, global);
        const __m512i bits = _mm512_castps_si512(e);
        const __m512i normal = _mm512_or_si512(
            _mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(120)), 3),
            _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(7)));
        code[j] = _mm512_mask_mov_epi32(normal, _mm512_cmp_ps_mask(e, _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ),
                                        _mm512_cvttps_epi32(_mm512_mul_ps(e, _mm512_set1_ps(512.0f))));
    }
    __m512 rs[WIDTH_AVX512];
    const int fast = reciprocals_avx512(s, amax, width, rs);
    for (int64_t k = 0; k < run; ++k) {
        errors_avx512(t[k], s, rs, fast, g, norm, width, kind, err);
        if (tw) {
            EACH err[j] = _mm512_mul_ps(err[j], tw[k]);
        }
        EACH sum[j] = _mm512_add_ps(sum[j], err[j]);
    }
    if (!index) {
        EACH _mm512_storeu_ps(out + (c + j) * g->units, sum[j]);
        return;
    }
    for (int j = 0; j < width; ++j) { /* in candidate order: strict <, so the first least is kept */
        __m512 value = sum[j];
        if (g->rule == RULE_E4M3 && g->power) {
            value = _mm512_mul_ps(value, _mm512_i32gather_ps(code[j], g->power + (c + j) * 128, 4));
        } else if (factor) {
            const float *at = factor + (c + j) * g->step_c + q * g->step_q;
            value = _mm512_mul_ps(value, g->step_q ? _mm512_loadu_ps(at) : _mm512_set1_ps(*at));
        }
        value = _mm512_mask_mov_ps(value, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q),
                                   _mm512_set1_ps(__builtin_inff()));
        const __mmask16 lower = _mm512_cmp_ps_mask(value, *best, _CMP_LT_OQ);
        *best = _mm512_mask_mov_ps(*best, lower, value);
        *index = _mm512_mask_mov_epi32(*index, lower, _mm512_set1_epi32((int)(c + j)));
    }
}

__attribute__((target("avx512f"), always_inline)) static inline void
block_avx512(const float *x, const float *weight, int64_t run, const struct grid *g, int64_t r0, int64_t groups,
             int kind, const float *factor, float *best_value, int64_t *best_index, float *out) {
    __m512 t[32], tw[32];
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)run));
    __m512 amax = _mm512_setzero_ps(); /* each row's largest |v|: what bounds its quotients */
    for (int64_t k = 0; k < run; ++k) {
        const __m512i at = _mm512_add_epi32(rows, _mm512_set1_epi32((int)k));
        t[k] = _mm512_i32gather_ps(at, x + r0 * run, 4);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(t[k]));
        if (weight) tw[k] = _mm512_i32gather_ps(at, weight + r0 * run, 4);
    }
    const __m512 *w = weight ? tw : 0;
    const int64_t q = r0 % groups;
    __m512 best = _mm512_set1_ps(__builtin_inff());
    __m512i index = _mm512_setzero_si512();
    __m512i *picks = best_index ? &index : 0;
    float *o = out ? out + r0 : 0;
    int64_t c = 0;
    for (; c + 8 <= g->count; c += 8)
        block_candidates_avx512(t, w, run, amax, g, factor, q, c, 8, kind, o, &best, picks);
    for (; c + 4 <= g->count; c += 4)
        block_candidates_avx512(t, w, run, amax, g, factor, q, c, 4, kind, o, &best, picks);
    for (; c < g->count; ++c) block_candidates_avx512(t, w, run, amax, g, factor, q, c, 1, kind, o, &best, picks);
    if (best_index) {
        _mm512_storeu_ps(best_value + r0, best);
        _mm512_storeu_si512((void *)(best_index + r0), _mm512_cvtepi32_epi64(_mm512_castsi512_si256(index)));
        _mm512_storeu_si512((void *)(best_index + r0 + 8), _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(index, 1)));
    }
}

__attribute__((target("avx512f"))) void
group_float_grid_avx512(const float *x, const float *weight, int64_t rows, int64_t run, int64_t piece, int64_t groups,
                        int64_t count, const float *step, int64_t step_c, int64_t step_q, int exp_bits, int man_bits,
                        double max_value, double norm, int direct, const float *factor, float *best_value,
                        int64_t *best_index, int rule, const float *amax, const float *p, const float *global,
                        const float *power, double divisor, double eps, int threads, float *out) {
    const int64_t pieces = (run + piece - 1) / piece;
    struct grid g = make_grid(step, step_c, step_q, count, rows * pieces, exp_bits, man_bits, max_value, norm, direct);
    set_rule(&g, rule, amax, p, global, power, divisor, eps);
    const int kind = power_kind(norm, direct);
    if (run <= 32 && pieces == 1 && groups % 16 == 0 && (rule != RULE_TABLE || step_q == 0 || step_q == 1)) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t b = 0; b < rows / 16; ++b) {
            if (kind == POWER_ONE)
                block_avx512(x, weight, run, &g, b * 16, groups, POWER_ONE, factor, best_value, best_index, out);
            else if (kind == POWER_TWO)
                block_avx512(x, weight, run, &g, b * 16, groups, POWER_TWO, factor, best_value, best_index, out);
            else if (kind == POWER_THREE)
                block_avx512(x, weight, run, &g, b * 16, groups, POWER_THREE, factor, best_value, best_index, out);
            else
                block_avx512(x, weight, run, &g, b * 16, groups, POWER_ANY, factor, best_value, best_index, out);
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < rows * pieces; ++u) {
        const int64_t r = u / pieces, start = (u % pieces) * piece;
        const int64_t length = run - start < piece ? run - start : piece;
        const float *p = x + r * run + start, *w = weight ? weight + r * run + start : 0;
        float local[best_index ? count : 1];
        struct grid unit = g;
        float *sums = out + u;
        if (best_index) {
            unit.units = 1;
            sums = local;
        }
        if (kind == POWER_ONE)
            unit_errors_avx512(p, w, length, &unit, r % groups, POWER_ONE, sums);
        else if (kind == POWER_TWO)
            unit_errors_avx512(p, w, length, &unit, r % groups, POWER_TWO, sums);
        else if (kind == POWER_THREE)
            unit_errors_avx512(p, w, length, &unit, r % groups, POWER_THREE, sums);
        else
            unit_errors_avx512(p, w, length, &unit, r % groups, POWER_ANY, sums);
        if (best_index) pick(local, &g, factor, r % groups, best_value + u, best_index + u);
    }
}

/* ---------------------------------------------------------------- AVX2 */


/* As errors_avx512 with AVX2's instructions: the exponent and mantissa come from the bits
 * (denormals scaled by 2^23 first), log2 from an 8-entry table and a degree-5 series, 2^n is
 * applied in two halves (gradual underflow), and +inf/NaN errors pass through unchanged. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
errors_avx2(__m256 v, const __m256 *s, const struct grid *g, __m256 norm, int width, int kind, __m256 *err) {
    __m256 scaled[WIDTH_AVX2], a[WIDTH_AVX2];
    EACH scaled[j] = _mm256_div_ps(v, s[j]);
    EACH a[j] = float_grid_round_avx2(scaled[j], &g->elements);
    if (g->direct) {
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
    __m256 s[WIDTH_AVX2], sum[WIDTH_AVX2], err[WIDTH_AVX2];
    EACH {
        s[j] = _mm256_set1_ps(step_of(g, c + j, q, 0));
        sum[j] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 8 <= length; i += 8) {
        errors_avx2(_mm256_loadu_ps(x + i), s, g, norm, width, kind, err);
        if (w) {
            EACH err[j] = _mm256_mul_ps(err[j], _mm256_loadu_ps(w + i));
        }
        EACH sum[j] = _mm256_add_ps(sum[j], err[j]);
    }
    if (i < length) {
        const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(length - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        errors_avx2(_mm256_maskload_ps(x + i, tail), s, g, norm, width, kind, err);
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

__attribute__((target("avx2,fma"))) void
group_float_grid_avx2(const float *x, const float *weight, int64_t rows, int64_t run, int64_t piece, int64_t groups,
                      int64_t count, const float *step, int64_t step_c, int64_t step_q, int exp_bits, int man_bits,
                      double max_value, double norm, int direct, const float *factor, float *best_value,
                      int64_t *best_index, int rule, const float *amax, const float *p, const float *global,
                      const float *power, double divisor, double eps, int threads, float *out) {
    const int64_t pieces = (run + piece - 1) / piece;
    struct grid g = make_grid(step, step_c, step_q, count, rows * pieces, exp_bits, man_bits, max_value, norm, direct);
    set_rule(&g, rule, amax, p, global, power, divisor, eps);
    const int kind = power_kind(norm, direct);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < rows * pieces; ++u) {
        const int64_t r = u / pieces, start = (u % pieces) * piece;
        const int64_t length = run - start < piece ? run - start : piece;
        const float *p = x + r * run + start, *w = weight ? weight + r * run + start : 0;
        float local[best_index ? count : 1];
        struct grid unit = g;
        float *sums = out + u;
        if (best_index) {
            unit.units = 1;
            sums = local;
        }
        if (kind == POWER_ONE)
            unit_errors_avx2(p, w, length, &unit, r % groups, POWER_ONE, sums);
        else if (kind == POWER_TWO)
            unit_errors_avx2(p, w, length, &unit, r % groups, POWER_TWO, sums);
        else if (kind == POWER_THREE)
            unit_errors_avx2(p, w, length, &unit, r % groups, POWER_THREE, sums);
        else
            unit_errors_avx2(p, w, length, &unit, r % groups, POWER_ANY, sums);
        if (best_index) pick(local, &g, factor, r % groups, best_value + u, best_index + u);
    }
}

#endif

#include "simd_level.h"
