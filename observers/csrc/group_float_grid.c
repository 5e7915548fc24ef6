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
 *   Short groups (run <= 32: NVFP4, MX) take a lane-per-row path, sixteen rows per vector on AVX-512
 *   (groups % 16 == 0), eight on AVX2 (groups % 8 == 0), whose pick with a fractional norm between 1
 *   and 3 and 32 or more candidates first bounds every candidate's value from three cheap sums and
 *   computes the full sums only of the candidates that may be least (the same picks, about 6 of 111
 *   candidates per row; see "pick mode with a fractional norm"). AVX-512 divides by one fma-corrected
 *   reciprocal multiply (exact; see reciprocals_avx512), AVX2 with the divide.
 * simd_level() (simd_level.h) says which variants this CPU runs.
 */
#include <stdint.h>
#include <stdlib.h>

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

/* ------------------------------------------------ pick mode with a fractional norm: bounds first
 *
 * A fractional norm 1 < p < 3 (llm-compressor's NVFP4 searches use 2.4) costs a logarithm and an
 * exponential per element and candidate, two thirds of the work, while a row's least error is usually
 * among a handful of its 111 candidates. So the pick runs in two passes over the block:
 *   1. every candidate's S1, S2, S3 per row (S_k = sum of weight * |e|^k, e the error this kernel powers,
 *      or one within a few parts in a million of it: block_bounds_avx512), which bound its sum S_p:
 *      log S_p is convex in p (a log-sum-exp of p * log|e|), so it lies below the chord through
 *      (2, log S2), (3, log S3) (through (1, .), (2, .) for p < 2) and above the chord through the other
 *      pair, extended (Holder's and Lyapunov's inequalities). With the pick factor these give each
 *      candidate an upper bound U and a lower bound L of its value, in log2.
 *   2. the full sums only for the (row, candidate) pairs whose L does not exceed max(the row's least
 *      U + slack, log2 of the block's floor), a vector of pairs at a time; any other candidate's value
 *      exceeds the row's least value, so it can neither be the least nor tie it. About 6 of 111
 *      candidates per row remain on LLM-like weights.
 * A pair's sum is the very sum of the full pass (block_candidates_avx512 or _avx2: the same step,
 * lane-wise quotient, power and order over k), so the picks are those of the full pass. The slack
 * covers the cubic log2 (LOG2_CUBIC_ERROR), the fp32 roundings of S_k and the power's few ulps. Values
 * below the block's floor (PRUNE_FLOOR, raised by heavy weights: floor_log2) are never pruned against
 * each other: there fp32 sums lose their relative precision (subnormal terms, powers that underflow).
 * A candidate whose S_k or factor for a row is below PRUNE_FLOOR, NaN or infinite bounds nothing there
 * and is kept (U = +inf, L = -inf); so is one whose errors may reach error_limit, where the full
 * pass's |e|^norm overflows before the weight (its sum is then +inf where the bounds hold a finite
 * one). A value that overflows only in its sum or times its factor is at least 2^128, above every
 * finite value: it cannot prune one (and a row whose values are all +inf keeps candidate 0 either
 * way). Weights must be 0 or at least PRUNE_FLOOR (heaviest_weight_avx512), else the block takes the
 * full pass. */

#define LOG2_CUBIC_ERROR 0x1p-10f /* the cubic below is within 6.4e-4 of log2 on [1, 2) */
/* log2 m ~ ((C3*m + C2)*m + C1)*m + C0 on [1, 2) (a least-squares fit, weighted to its largest errors) */
#define LOG2_C3 0.15823961f
#define LOG2_C2 -1.05182488f
#define LOG2_C1 3.04779769f
#define LOG2_C0 -2.15357394f
#define PRUNE_FLOOR 0x1p-100f

/* The chords' coefficients for log2 S1, log2 S2, log2 S3, and the slack of a comparison. */
struct prune {
    float upper[3], lower[3], slack;
    float error_limit; /* a power of two at most 2^(127/norm): an |e| below it has |e|^norm < 2^127 */
};

/* Whether a pick over `count` candidates of a `kind` power prunes with bounds, and their coefficients: a
 * norm strictly between 1 and 3 and not 2 (a general power, POWER_ANY), and at least PRUNE_COUNT
 * candidates (about 6 per row remain whatever the count, so fewer leave too little to skip: mse_grid's
 * chunks of 5 ran 35% slower pruned). */
#define PRUNE_COUNT 32
static int prune_of(double norm, int kind, int64_t count, struct prune *b) {
    if (kind != POWER_ANY || !(norm > 1.0 && norm < 3.0) || norm == 2.0 || count < PRUNE_COUNT) return 0;
    const float p = (float)norm;
    if (p > 2.0f) { /* upper: chord (2, 3); lower: chord (1, 2) extended */
        b->upper[0] = 0.0f, b->upper[1] = 3.0f - p, b->upper[2] = p - 2.0f;
        b->lower[0] = -(p - 2.0f), b->lower[1] = p - 1.0f, b->lower[2] = 0.0f;
    } else { /* upper: chord (1, 2); lower: chord (2, 3) extended back */
        b->upper[0] = 2.0f - p, b->upper[1] = p - 1.0f, b->upper[2] = 0.0f;
        b->lower[0] = 0.0f, b->lower[1] = 3.0f - p, b->lower[2] = -(2.0f - p);
    }
    float weight = 2.0f; /* the factor's log2, in both bounds */
    for (int i = 0; i < 3; ++i) weight += __builtin_fabsf(b->upper[i]) + __builtin_fabsf(b->lower[i]);
    b->slack = weight * LOG2_CUBIC_ERROR + 0x1p-12f;
    b->error_limit = bits_float((uint32_t)((int)(127.0 / norm) + 127) << 23);
    return 1;
}

/* log2 of the floor below which a block's values are never told apart: PRUNE_FLOOR, raised with the
 * block's heaviest weight past 2^20 (a weighted sum of powers that underflow, each a subnormal at most
 * 2^-149 off before the weight, is then still far below it). */
static float floor_log2(float heaviest) {
    const int exponent = (int)((float_bits(heaviest) >> 23) & 0xFF) - 127;
    return -100.0f + (float)(exponent > 20 ? exponent - 20 : 0);
}

/* A thread's scratch for the two passes over one block: per candidate and row (c*lanes + row, 16 lanes on
 * AVX-512, 8 on AVX2) its step, pick factor and lower bound, then the pairs that remain (c*lanes + row,
 * padded to whole groups of four vectors) and their sums. */
struct prune_scratch {
    float *steps, *factors, *lower, *sums;
    int32_t *pairs;
};

/* A thread's prune_scratch for `count` candidates (NULL: the pick runs without bounds). */
static struct prune_scratch *prune_scratch_new(int64_t count) {
    const int64_t cells = count * 16 + 64;
    struct prune_scratch *scratch = malloc(sizeof *scratch);
    if (!scratch) return 0;
    scratch->steps = malloc(4 * cells * sizeof(float) + cells * sizeof(int32_t));
    if (!scratch->steps) {
        free(scratch);
        return 0;
    }
    scratch->factors = scratch->steps + cells;
    scratch->lower = scratch->factors + cells;
    scratch->sums = scratch->lower + cells;
    scratch->pairs = (int32_t *)(scratch->sums + cells);
    return scratch;
}

static void prune_scratch_free(struct prune_scratch *scratch) {
    if (scratch) free(scratch->steps);
    free(scratch);
}

/* The pick over the pairs pass 2 summed (pair = c << shift | row, in candidate order), as pick() and the
 * block picks take it: each sum times its factor (when factored), NaN read as +inf, strict <, so each
 * row keeps its first least; rows without a pair keep +inf and candidate 0. */
static void pick_pairs(const struct prune_scratch *scratch, int64_t n, int factored, int shift, float *least,
                       int32_t *chosen) {
    const int32_t rows = 1 << shift;
    for (int32_t r = 0; r < rows; ++r) least[r] = __builtin_inff(), chosen[r] = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int32_t pair = scratch->pairs[i], row = pair & (rows - 1);
        float value = factored ? scratch->sums[i] * scratch->factors[pair] : scratch->sums[i];
        if (value != value) value = __builtin_inff();
        if (value < least[row]) least[row] = value, chosen[row] = pair >> shift;
    }
}

/* Whether candidate sums are multiplied by a factor before the pick (factor_of's). */
static inline int has_factor(const struct grid *g, const float *factor) {
    return factor || (g->rule == RULE_E4M3 && g->power);
}

/* ---------------------------------------------------------------- AVX-512 */



/* The lanes where float_grid_fast_quotient allows the divide-free quotient for every value up to `amax`. */
__attribute__((target("avx512f"), always_inline)) static inline __mmask16 float_grid_fast_avx512(__m512 s, __m512 r,
                                                                                               __m512 amax) {
    const __m512 size = _mm512_abs_ps(s);
    return _mm512_cmp_ps_mask(size, _mm512_set1_ps(0x1p-125f), _CMP_GE_OQ) &
           _mm512_cmp_ps_mask(size, _mm512_set1_ps(0x1p125f), _CMP_LE_OQ) &
           _mm512_cmp_ps_mask(_mm512_mul_ps(amax, _mm512_abs_ps(r)), _mm512_set1_ps(0x1p126f), _CMP_LT_OQ);
}

/* How a call's `width` candidates divide: rs[j] = 1/s[j], safe[j] the lanes where the divide-free quotient
 * is exact (float_grid_fast_avx512 on the lane's own largest |v|), all: every lane of every candidate. */
struct quotients {
    __m512 rs[WIDTH_AVX512];
    __mmask16 safe[WIDTH_AVX512];
    int all;
};

/* The quotients of the steps s[j] for values up to amax[j * amax_step] (float_grid_fast_quotient's rule,
 * lane by lane: s in [2^-125, 2^125] and no quotient reaching 2^126, where v*(1/s) could overflow and
 * the correction make it NaN); the rare other lanes (infinite, zero, huge, tiny steps beside the data)
 * take the divide. Lane by lane, so a lane's quotient depends on its own step and row only. */
__attribute__((target("avx512f"), always_inline)) static inline void
reciprocals_avx512(const __m512 *s, const __m512 *amax, int amax_step, int width, struct quotients *qs) {
    __mmask16 every = 0xFFFF;
    EACH {
        qs->rs[j] = _mm512_div_ps(_mm512_set1_ps(1.0f), s[j]);
        qs->safe[j] = float_grid_fast_avx512(s[j], qs->rs[j], amax[j * amax_step]);
        every &= qs->safe[j];
    }
    qs->all = every == 0xFFFF;
}

/* scaled[j] = v[j * v_step] / s[j], correctly rounded: the divide-free form where safe, the divide elsewhere. */
__attribute__((target("avx512f"), always_inline)) static inline void
quotients_avx512(const __m512 *v, int v_step, const __m512 *s, const struct quotients *qs, int width,
                 __m512 *scaled) {
    EACH scaled[j] = float_grid_quotient_avx512(v[j * v_step], s[j], qs->rs[j]);
    if (qs->all) return;
    EACH {
        if (qs->safe[j] != 0xFFFF)
            scaled[j] = _mm512_mask_div_ps(scaled[j], (__mmask16)~qs->safe[j], v[j * v_step], s[j]);
    }
}

/* err[j] = |grid(v/s[j]) - v/s[j]|^norm for the `width` candidates j (with `direct`,
 * |grid(v/s[j])*s[j] - v|^norm), candidate j reading v = v[j*v_step] (v_step 0: one value for all),
 * grid() the float grid rounding of formats.py (float_grid.h) after the correctly rounded v/s. Written
 * stage by stage across the candidates, so the out-of-order core always has `width` independent
 * operations at hand. |e|^norm: exact for norm 1 and 2, else 2^(norm*log2 e), 0 -> 0. */
__attribute__((target("avx512f"), always_inline)) static inline void
errors_avx512(const __m512 *v, int v_step, const __m512 *s, const struct quotients *qs, const struct grid *g,
              __m512 norm, int width, int kind, __m512 *err) {
    __m512 scaled[WIDTH_AVX512], a[WIDTH_AVX512];
    quotients_avx512(v, v_step, s, qs, width, scaled);
    EACH a[j] = float_grid_round_avx512(scaled[j], &g->elements);
    /* code*s - v = fake_quant(v) - v, rounded as the eager dequantization; only the odd powers take its
     * magnitude here (the square and the general power read |e| themselves) */
    if (g->direct) {
        EACH err[j] = _mm512_sub_ps(_mm512_mul_ps(a[j], s[j]), v[j * v_step]);
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
    __m512 err[WIDTH_AVX512];
    struct quotients qs;
    reciprocals_avx512(s, &amax, 0, width, &qs);
    int64_t i = 0;
    for (; i + 16 <= length; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        errors_avx512(&v, 0, s, &qs, g, norm, width, kind, err);
        if (w) {
            EACH err[j] = _mm512_mul_ps(err[j], _mm512_loadu_ps(w + i));
        }
        EACH sum[j] = _mm512_add_ps(sum[j], err[j]);
    }
    if (i < length) {
        const __mmask16 tail = (__mmask16)((1u << (length - i)) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(tail, x + i);
        errors_avx512(&v, 0, s, &qs, g, norm, width, kind, err);
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

/* Candidate c's steps for rows q..q+15 (rule 2: and their E4M3 codes), step_of's operations lane by lane. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 block_step_avx512(const struct grid *g,
                                                                                        int64_t q, int64_t c,
                                                                                        __m512i *code) {
    *code = _mm512_setzero_si512();
    if (g->rule == RULE_TABLE) {
        const float *at = g->step + c * g->step_c + q * g->step_q;
        return g->step_q ? _mm512_loadu_ps(at) : _mm512_set1_ps(*at);
    }
    const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(g->amax + q), _mm512_set1_ps(g->p[c]));
    if (g->rule == RULE_FREE)
        return _mm512_max_ps(_mm512_set1_ps(g->eps), _mm512_div_ps(a, _mm512_set1_ps(g->divisor)));
    const __m512 global = _mm512_set1_ps(g->global[c]);
    __m512 raw = _mm512_mul_ps(_mm512_div_ps(a, _mm512_set1_ps(g->divisor)), global);
    raw = _mm512_min_ps(_mm512_set1_ps(448.0f), _mm512_max_ps(_mm512_set1_ps(0x1p-9f), raw));
    const __m512 e = float_grid_round_avx512(raw, &g->e4m3); /* torch's cast: round half to even */
    const __m512i bits = _mm512_castps_si512(e);
    const __m512i normal =
        _mm512_or_si512(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(120)), 3),
                        _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(7)));
    *code = _mm512_mask_mov_epi32(normal, _mm512_cmp_ps_mask(e, _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ),
                                  _mm512_cvttps_epi32(_mm512_mul_ps(e, _mm512_set1_ps(512.0f))));
    return _mm512_div_ps(e, global);
}

/* Candidate c's pick factors for rows q..q+15 (`code` from block_step_avx512), when has_factor. */
__attribute__((target("avx512f"), always_inline)) static inline __m512
block_factor_avx512(const struct grid *g, const float *factor, int64_t q, int64_t c, __m512i code) {
    if (g->rule == RULE_E4M3 && g->power) return _mm512_i32gather_ps(code, g->power + c * 128, 4);
    const float *at = factor + c * g->step_c + q * g->step_q;
    return g->step_q ? _mm512_loadu_ps(at) : _mm512_set1_ps(*at);
}

__attribute__((target("avx512f"), always_inline)) static inline void
block_candidates_avx512(const __m512 *t, const __m512 *tw, int64_t run, __m512 amax, const struct grid *g,
                        const float *factor, int64_t q, int64_t c, int width, int kind, float *out, __m512 *best,
                        __m512i *index) {
    const __m512 norm = _mm512_set1_ps(g->norm);
    __m512 s[WIDTH_AVX512], err[WIDTH_AVX512], sum[WIDTH_AVX512];
    __m512i code[WIDTH_AVX512];
    EACH {
        sum[j] = _mm512_setzero_ps();
        s[j] = block_step_avx512(g, q, c + j, &code[j]);
    }
    struct quotients qs;
    reciprocals_avx512(s, &amax, 0, width, &qs);
    for (int64_t k = 0; k < run; ++k) {
        errors_avx512(t + k, 0, s, &qs, g, norm, width, kind, err);
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
        if (has_factor(g, factor)) value = _mm512_mul_ps(value, block_factor_avx512(g, factor, q, c + j, code[j]));
        value = _mm512_mask_mov_ps(value, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q),
                                   _mm512_set1_ps(__builtin_inff()));
        const __mmask16 lower = _mm512_cmp_ps_mask(value, *best, _CMP_LT_OQ);
        *best = _mm512_mask_mov_ps(*best, lower, value);
        *index = _mm512_mask_mov_epi32(*index, lower, _mm512_set1_epi32((int)(c + j)));
    }
}

/* log2 x within LOG2_CUBIC_ERROR for normal x > 0: exponent plus a cubic in the mantissa. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 log2_cubic_avx512(__m512 x) {
    const __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
    __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(LOG2_C3), m, _mm512_set1_ps(LOG2_C2));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(LOG2_C1));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(LOG2_C0));
    return _mm512_add_ps(_mm512_getexp_ps(x), y);
}

/* The lanes of x within [PRUNE_FLOOR, +inf): where log2_cubic_avx512 and the bounds' relative slack hold. */
__attribute__((target("avx512f"), always_inline)) static inline __mmask16 bounded_avx512(__m512 x) {
    return _mm512_cmp_ps_mask(x, _mm512_set1_ps(PRUNE_FLOOR), _CMP_GE_OQ) &
           _mm512_cmp_ps_mask(x, _mm512_set1_ps(__builtin_inff()), _CMP_LT_OQ);
}

/* Pass 1 for `width` candidates from c: steps and factors kept, lower bounds stored, least upper bound per
 * row updated. The errors are taken on |v| (the grid rounding is symmetric: the same |e|, one clamp less)
 * and, with `direct`, from |v| * (1/s) with an approximate reciprocal (two operations less): a quotient an
 * ulp or two off changes a code only next to a midpoint between two grid points, where both codes'
 * errors agree to a few parts in a million. In steps the quotient is the exact one (e = code - v/s would
 * carry its error absolutely). */
__attribute__((target("avx512f"), always_inline)) static inline void
block_bounds_avx512(const __m512 *t, const __m512 *tw, int64_t run, __m512 amax, const struct grid *g,
                    const float *factor, int64_t q, int64_t c, int width, const struct prune *b,
                    const struct prune_scratch *scratch, __m512 *least_upper) {
    __m512 s[WIDTH_AVX512], s1[WIDTH_AVX512], s2[WIDTH_AVX512], s3[WIDTH_AVX512];
    const int factored = has_factor(g, factor);
    EACH {
        __m512i code;
        s[j] = block_step_avx512(g, q, c + j, &code);
        _mm512_storeu_ps(scratch->steps + (c + j) * 16, s[j]);
        _mm512_storeu_ps(scratch->factors + (c + j) * 16,
                         factored ? block_factor_avx512(g, factor, q, c + j, code) : _mm512_set1_ps(1.0f));
        s1[j] = s2[j] = s3[j] = _mm512_setzero_ps();
    }
    struct quotients qs;
    int approximate = 0;
    if (g->direct) { /* 1/s within 2^-23: the first estimate and one Newton step */
        __mmask16 every = 0xFFFF;
        EACH {
            const __m512 r = _mm512_rcp14_ps(s[j]);
            qs.rs[j] = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(s[j], r, _mm512_set1_ps(1.0f)), r);
            every &= float_grid_fast_avx512(s[j], qs.rs[j], amax);
        }
        approximate = every == 0xFFFF;
    }
    if (!approximate) reciprocals_avx512(s, &amax, 0, width, &qs);
    for (int64_t k = 0; k < run; ++k) {
        __m512 scaled[WIDTH_AVX512], e[WIDTH_AVX512], we[WIDTH_AVX512];
        const __m512 v = _mm512_abs_ps(t[k]);
        if (approximate) {
            EACH scaled[j] = _mm512_mul_ps(v, qs.rs[j]);
        } else {
            quotients_avx512(&v, 0, s, &qs, width, scaled);
        }
        EACH e[j] = float_grid_round_magnitude_avx512(scaled[j], &g->elements);
        if (g->direct) {
            EACH e[j] = _mm512_sub_ps(_mm512_mul_ps(e[j], s[j]), v);
        } else {
            EACH e[j] = _mm512_sub_ps(e[j], scaled[j]);
        }
        EACH e[j] = _mm512_abs_ps(e[j]);
        EACH we[j] = tw ? _mm512_mul_ps(e[j], tw[k]) : e[j];
        EACH s1[j] = _mm512_add_ps(s1[j], we[j]);
        EACH we[j] = _mm512_mul_ps(we[j], e[j]);
        EACH s2[j] = _mm512_add_ps(s2[j], we[j]);
        EACH s3[j] = _mm512_fmadd_ps(we[j], e[j], s3[j]);
    }
    const __m512 top = _mm512_set1_ps(g->elements.max_value);
    EACH {
        const __m512 f = _mm512_loadu_ps(scratch->factors + (c + j) * 16);
        /* |e| <= amax + max_value*s (in steps amax/s + max_value): below error_limit no |e|^norm of the
         * full pass overflows, so its sums are the ones bounded */
        const __m512 largest = g->direct ? _mm512_fmadd_ps(top, s[j], amax)
                                         : _mm512_add_ps(_mm512_div_ps(amax, s[j]), top);
        const __mmask16 small = ~(bounded_avx512(s1[j]) & bounded_avx512(s2[j]) & bounded_avx512(s3[j]) &
                                  bounded_avx512(f) &
                                  _mm512_cmp_ps_mask(largest, _mm512_set1_ps(b->error_limit), _CMP_LT_OQ));
        const __m512 l1 = log2_cubic_avx512(s1[j]), l2 = log2_cubic_avx512(s2[j]), l3 = log2_cubic_avx512(s3[j]);
        const __m512 lf = factored ? log2_cubic_avx512(f) : _mm512_setzero_ps();
        __m512 upper = _mm512_fmadd_ps(_mm512_set1_ps(b->upper[0]), l1, lf);
        upper = _mm512_fmadd_ps(_mm512_set1_ps(b->upper[1]), l2, upper);
        upper = _mm512_fmadd_ps(_mm512_set1_ps(b->upper[2]), l3, upper);
        __m512 lower = _mm512_fmadd_ps(_mm512_set1_ps(b->lower[0]), l1, lf);
        lower = _mm512_fmadd_ps(_mm512_set1_ps(b->lower[1]), l2, lower);
        lower = _mm512_fmadd_ps(_mm512_set1_ps(b->lower[2]), l3, lower);
        upper = _mm512_mask_mov_ps(upper, small, _mm512_set1_ps(__builtin_inff()));
        lower = _mm512_mask_mov_ps(lower, small, _mm512_set1_ps(-__builtin_inff()));
        *least_upper = _mm512_min_ps(upper, *least_upper); /* a NaN bound gives the second operand */
        _mm512_storeu_ps(scratch->lower + (c + j) * 16, lower);
    }
}

/* Pass 2 for `width` vectors of sixteen pairs from pairs[0]: the sums of block_candidates_avx512, each
 * lane reading its own row (a permute of t[k], and of amax, each row's largest |v|) and its candidate's
 * step, so each lane's quotient, error and sum are those of the full pass. */
__attribute__((target("avx512f"), always_inline)) static inline void
pair_sums_avx512(const __m512 *t, const __m512 *tw, int64_t run, __m512 amax, const struct grid *g,
                 const int32_t *pairs, const float *steps, int width, int kind, float *sums) {
    const __m512 norm = _mm512_set1_ps(g->norm);
    __m512 s[WIDTH_AVX512], v[WIDTH_AVX512], err[WIDTH_AVX512], sum[WIDTH_AVX512];
    __m512i pair[WIDTH_AVX512];
    EACH {
        pair[j] = _mm512_loadu_si512((const void *)(pairs + 16 * j));
        s[j] = _mm512_i32gather_ps(pair[j], steps, 4);
        v[j] = _mm512_permutexvar_ps(pair[j], amax); /* permutexvar reads the low four bits of c*16 + row: the row */
        sum[j] = _mm512_setzero_ps();
    }
    struct quotients qs;
    reciprocals_avx512(s, v, 1, width, &qs);
    for (int64_t k = 0; k < run; ++k) {
        EACH v[j] = _mm512_permutexvar_ps(pair[j], t[k]);
        errors_avx512(v, 1, s, &qs, g, norm, width, kind, err);
        if (tw) {
            EACH err[j] = _mm512_mul_ps(err[j], _mm512_permutexvar_ps(pair[j], tw[k]));
        }
        EACH sum[j] = _mm512_add_ps(sum[j], err[j]);
    }
    EACH _mm512_storeu_ps(sums + 16 * j, sum[j]);
}

/* The pick of one block in the two passes; best and index as block_candidates_avx512 leaves them. */
__attribute__((target("avx512f"), always_inline)) static inline void
block_pruned_avx512(const __m512 *t, const __m512 *tw, int64_t run, __m512 amax, const struct grid *g,
                    const float *factor, int64_t q, const struct prune *b, float floor,
                    const struct prune_scratch *scratch, __m512 *best, __m512i *index) {
    __m512 least_upper = _mm512_set1_ps(__builtin_inff());
    int64_t c = 0;
    for (; c + 4 <= g->count; c += 4)
        block_bounds_avx512(t, tw, run, amax, g, factor, q, c, 4, b, scratch, &least_upper);
    for (; c < g->count; ++c) block_bounds_avx512(t, tw, run, amax, g, factor, q, c, 1, b, scratch, &least_upper);
    /* max(least U + slack, log2 of the block's floor): values below the floor are never told apart */
    const __m512 threshold =
        _mm512_max_ps(_mm512_set1_ps(floor), _mm512_add_ps(least_upper, _mm512_set1_ps(b->slack)));
    const __m512i rows = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t n = 0;
    for (c = 0; c < g->count; ++c) { /* NGT: a NaN lower bound keeps its pair */
        const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_loadu_ps(scratch->lower + c * 16), threshold, _CMP_NGT_UQ);
        const __m512i pairs = _mm512_add_epi32(rows, _mm512_set1_epi32((int)(c * 16)));
        _mm512_mask_compressstoreu_epi32(scratch->pairs + n, keep, pairs);
        n += __builtin_popcount(keep);
    }
    /* whole groups of four vectors, so that every call has four or eight chains to overlap */
    for (int64_t i = n; i % 64; ++i) scratch->pairs[i] = scratch->pairs[0];
    const int64_t vectors = (n + 63) / 64 * 4;
    int64_t v = 0;
    for (; v + 8 <= vectors; v += 8)
        pair_sums_avx512(t, tw, run, amax, g, scratch->pairs + v * 16, scratch->steps, 8, POWER_ANY,
                         scratch->sums + v * 16);
    for (; v < vectors; v += 4)
        pair_sums_avx512(t, tw, run, amax, g, scratch->pairs + v * 16, scratch->steps, 4, POWER_ANY,
                         scratch->sums + v * 16);
    float least[16];
    int32_t chosen[16];
    pick_pairs(scratch, n, has_factor(g, factor), 4, least, chosen);
    *best = _mm512_loadu_ps(least);
    *index = _mm512_loadu_si512((const void *)chosen);
}

/* The block's heaviest weight when every weight is 0 or within [PRUNE_FLOOR, +inf), else -1: what the
 * bounds of the pruned pick need (>= 0 for the inequalities; no tiny weight, so a product weight*|e|^k
 * below 2^-126, where fp32 keeps only an absolute precision of 2^-149, needs |e| < 2^-26 and errs by
 * less than 2^-140; the heaviest raises the block's floor, floor_log2). */
__attribute__((target("avx512f"), always_inline)) static inline float heaviest_weight_avx512(const __m512 *tw,
                                                                                            int64_t run) {
    __mmask16 ok = 0xFFFF;
    __m512 heaviest = _mm512_setzero_ps();
    for (int64_t k = 0; k < run; ++k) {
        ok &= _mm512_cmp_ps_mask(tw[k], _mm512_setzero_ps(), _CMP_EQ_OQ) | bounded_avx512(tw[k]);
        heaviest = _mm512_max_ps(heaviest, tw[k]);
    }
    return ok == 0xFFFF ? _mm512_reduce_max_ps(heaviest) : -1.0f;
}

__attribute__((target("avx512f"), always_inline)) static inline void
block_avx512(const float *x, const float *weight, int64_t run, const struct grid *g, int64_t r0, int64_t groups,
             int kind, const float *factor, float *best_value, int64_t *best_index, float *out,
             const struct prune *bounds, const struct prune_scratch *scratch) {
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
    const float heaviest = best_index && bounds && scratch && w ? heaviest_weight_avx512(w, run) : 1.0f;
    if (best_index && bounds && scratch && heaviest >= 0.0f) {
        block_pruned_avx512(t, w, run, amax, g, factor, q, bounds, floor_log2(heaviest), scratch, &best, &index);
    } else {
        __m512i *picks = best_index ? &index : 0;
        float *o = out ? out + r0 : 0;
        int64_t c = 0;
        for (; c + 8 <= g->count; c += 8)
            block_candidates_avx512(t, w, run, amax, g, factor, q, c, 8, kind, o, &best, picks);
        for (; c + 4 <= g->count; c += 4)
            block_candidates_avx512(t, w, run, amax, g, factor, q, c, 4, kind, o, &best, picks);
        for (; c < g->count; ++c) block_candidates_avx512(t, w, run, amax, g, factor, q, c, 1, kind, o, &best, picks);
    }
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
        struct prune bounds;
        const int prunable = best_index && prune_of(norm, kind, count, &bounds);
#pragma omp parallel num_threads(threads)
        {
            struct prune_scratch *scratch = prunable ? prune_scratch_new(count) : 0;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < rows / 16; ++b) {
                if (kind == POWER_ONE)
                    block_avx512(x, weight, run, &g, b * 16, groups, POWER_ONE, factor, best_value, best_index, out,
                                 0, 0);
                else if (kind == POWER_TWO)
                    block_avx512(x, weight, run, &g, b * 16, groups, POWER_TWO, factor, best_value, best_index, out,
                                 0, 0);
                else if (kind == POWER_THREE)
                    block_avx512(x, weight, run, &g, b * 16, groups, POWER_THREE, factor, best_value, best_index,
                                 out, 0, 0);
                else
                    block_avx512(x, weight, run, &g, b * 16, groups, POWER_ANY, factor, best_value, best_index, out,
                                 prunable ? &bounds : 0, scratch);
            }
            prune_scratch_free(scratch);
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


/* As errors_avx512 with AVX2's instructions (and the divide): the exponent and mantissa come from the bits
 * (denormals scaled by 2^23 first), log2 from an 8-entry table and a degree-5 series, 2^n is
 * applied in two halves (gradual underflow), and +inf/NaN errors pass through unchanged. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
errors_avx2(const __m256 *v, int v_step, const __m256 *s, const struct grid *g, __m256 norm, int width, int kind,
            __m256 *err) {
    __m256 scaled[WIDTH_AVX2], a[WIDTH_AVX2];
    EACH scaled[j] = _mm256_div_ps(v[j * v_step], s[j]);
    EACH a[j] = float_grid_round_avx2(scaled[j], &g->elements);
    if (g->direct) {
        EACH a[j] = _mm256_sub_ps(_mm256_mul_ps(a[j], s[j]), v[j * v_step]);
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
        const __m256 v = _mm256_loadu_ps(x + i);
        errors_avx2(&v, 0, s, g, norm, width, kind, err);
        if (w) {
            EACH err[j] = _mm256_mul_ps(err[j], _mm256_loadu_ps(w + i));
        }
        EACH sum[j] = _mm256_add_ps(sum[j], err[j]);
    }
    if (i < length) {
        const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(length - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 v = _mm256_maskload_ps(x + i, tail);
        errors_avx2(&v, 0, s, g, norm, width, kind, err);
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

/* Short groups on AVX2, eight rows at a time, one row per lane: block_candidates_avx512's layout (sums
 * over k in order, the pick a vector compare) and its bounded pick, with AVX2's instructions. Needs
 * groups % 8 == 0 and step_q 0 or 1. */

/* As block_step_avx512, eight rows. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 block_step_avx2(const struct grid *g,
                                                                                       int64_t q, int64_t c,
                                                                                       __m256i *code) {
    *code = _mm256_setzero_si256();
    if (g->rule == RULE_TABLE) {
        const float *at = g->step + c * g->step_c + q * g->step_q;
        return g->step_q ? _mm256_loadu_ps(at) : _mm256_set1_ps(*at);
    }
    const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(g->amax + q), _mm256_set1_ps(g->p[c]));
    if (g->rule == RULE_FREE)
        return _mm256_max_ps(_mm256_set1_ps(g->eps), _mm256_div_ps(a, _mm256_set1_ps(g->divisor)));
    const __m256 global = _mm256_set1_ps(g->global[c]);
    __m256 raw = _mm256_mul_ps(_mm256_div_ps(a, _mm256_set1_ps(g->divisor)), global);
    raw = _mm256_min_ps(_mm256_set1_ps(448.0f), _mm256_max_ps(_mm256_set1_ps(0x1p-9f), raw));
    const __m256 e = float_grid_round_avx2(raw, &g->e4m3); /* torch's cast: round half to even */
    const __m256i bits = _mm256_castps_si256(e);
    const __m256i normal =
        _mm256_or_si256(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(120)), 3),
                        _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(7)));
    const __m256i subnormal = _mm256_cvttps_epi32(_mm256_mul_ps(e, _mm256_set1_ps(512.0f)));
    *code = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(subnormal),
                                                 _mm256_cmp_ps(e, _mm256_set1_ps(0x1p-6f), _CMP_LT_OQ)));
    return _mm256_div_ps(e, global);
}

/* As block_factor_avx512, eight rows. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256
block_factor_avx2(const struct grid *g, const float *factor, int64_t q, int64_t c, __m256i code) {
    if (g->rule == RULE_E4M3 && g->power) return _mm256_i32gather_ps(g->power + c * 128, code, 4);
    const float *at = factor + c * g->step_c + q * g->step_q;
    return g->step_q ? _mm256_loadu_ps(at) : _mm256_set1_ps(*at);
}

/* As block_candidates_avx512, eight rows. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
block_candidates_avx2(const __m256 *t, const __m256 *tw, int64_t run, const struct grid *g, const float *factor,
                      int64_t q, int64_t c, int width, int kind, float *out, __m256 *best, __m256i *index) {
    const __m256 norm = _mm256_set1_ps(g->norm);
    __m256 s[WIDTH_AVX2], err[WIDTH_AVX2], sum[WIDTH_AVX2];
    __m256i code[WIDTH_AVX2];
    EACH {
        sum[j] = _mm256_setzero_ps();
        s[j] = block_step_avx2(g, q, c + j, &code[j]);
    }
    for (int64_t k = 0; k < run; ++k) {
        errors_avx2(t + k, 0, s, g, norm, width, kind, err);
        if (tw) {
            EACH err[j] = _mm256_mul_ps(err[j], tw[k]);
        }
        EACH sum[j] = _mm256_add_ps(sum[j], err[j]);
    }
    if (!index) {
        EACH _mm256_storeu_ps(out + (c + j) * g->units, sum[j]);
        return;
    }
    for (int j = 0; j < width; ++j) { /* in candidate order: strict <, so the first least is kept */
        __m256 value = sum[j];
        if (has_factor(g, factor)) value = _mm256_mul_ps(value, block_factor_avx2(g, factor, q, c + j, code[j]));
        value = _mm256_blendv_ps(value, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(value, value, _CMP_UNORD_Q));
        const __m256 lower = _mm256_cmp_ps(value, *best, _CMP_LT_OQ);
        *best = _mm256_blendv_ps(*best, value, lower);
        *index = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(*index),
                                                      _mm256_castsi256_ps(_mm256_set1_epi32((int)(c + j))), lower));
    }
}

/* As log2_cubic_avx512 for normal x > 0, the exponent and mantissa from the bits. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 log2_cubic_avx2(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256 m = _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x3F800000)));
    const __m256 exponent = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
    __m256 y = _mm256_fmadd_ps(_mm256_set1_ps(LOG2_C3), m, _mm256_set1_ps(LOG2_C2));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(LOG2_C1));
    y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(LOG2_C0));
    return _mm256_add_ps(exponent, y);
}

/* As bounded_avx512: the lanes within [PRUNE_FLOOR, +inf), as an all-ones lane mask. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 bounded_avx2(__m256 x) {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(PRUNE_FLOOR), _CMP_GE_OQ),
                         _mm256_cmp_ps(x, _mm256_set1_ps(__builtin_inff()), _CMP_LT_OQ));
}

/* As block_bounds_avx512, eight rows; quotients that are not approximated divide. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
block_bounds_avx2(const __m256 *t, const __m256 *tw, int64_t run, __m256 amax, const struct grid *g,
                  const float *factor, int64_t q, int64_t c, int width, const struct prune *b,
                  const struct prune_scratch *scratch, __m256 *least_upper) {
    __m256 s[WIDTH_AVX2], rs[WIDTH_AVX2], s1[WIDTH_AVX2], s2[WIDTH_AVX2], s3[WIDTH_AVX2];
    const int factored = has_factor(g, factor);
    EACH {
        __m256i code;
        s[j] = block_step_avx2(g, q, c + j, &code);
        _mm256_storeu_ps(scratch->steps + (c + j) * 8, s[j]);
        _mm256_storeu_ps(scratch->factors + (c + j) * 8,
                         factored ? block_factor_avx2(g, factor, q, c + j, code) : _mm256_set1_ps(1.0f));
        s1[j] = s2[j] = s3[j] = _mm256_setzero_ps();
    }
    int approximate = 0;
    if (g->direct) { /* 1/s within 2^-22: the first estimate and one Newton step; float_grid_fast_quotient's lanes */
        __m256 every = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        EACH {
            const __m256 r = _mm256_rcp_ps(s[j]), size = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), s[j]);
            rs[j] = _mm256_fmadd_ps(r, _mm256_fnmadd_ps(s[j], r, _mm256_set1_ps(1.0f)), r);
            every = _mm256_and_ps(every, _mm256_cmp_ps(size, _mm256_set1_ps(0x1p-125f), _CMP_GE_OQ));
            every = _mm256_and_ps(every, _mm256_cmp_ps(size, _mm256_set1_ps(0x1p125f), _CMP_LE_OQ));
            const __m256 largest = _mm256_mul_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), rs[j]));
            every = _mm256_and_ps(every, _mm256_cmp_ps(largest, _mm256_set1_ps(0x1p126f), _CMP_LT_OQ));
        }
        approximate = _mm256_movemask_ps(every) == 0xFF;
    }
    for (int64_t k = 0; k < run; ++k) {
        __m256 scaled[WIDTH_AVX2], e[WIDTH_AVX2], we[WIDTH_AVX2];
        const __m256 v = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), t[k]);
        if (approximate) {
            EACH scaled[j] = _mm256_mul_ps(v, rs[j]);
        } else {
            EACH scaled[j] = _mm256_div_ps(v, s[j]);
        }
        EACH e[j] = float_grid_round_magnitude_avx2(scaled[j], &g->elements);
        if (g->direct) {
            EACH e[j] = _mm256_sub_ps(_mm256_mul_ps(e[j], s[j]), v);
        } else {
            EACH e[j] = _mm256_sub_ps(e[j], scaled[j]);
        }
        EACH e[j] = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), e[j]);
        EACH we[j] = tw ? _mm256_mul_ps(e[j], tw[k]) : e[j];
        EACH s1[j] = _mm256_add_ps(s1[j], we[j]);
        EACH we[j] = _mm256_mul_ps(we[j], e[j]);
        EACH s2[j] = _mm256_add_ps(s2[j], we[j]);
        EACH s3[j] = _mm256_fmadd_ps(we[j], e[j], s3[j]);
    }
    const __m256 top = _mm256_set1_ps(g->elements.max_value);
    EACH {
        const __m256 f = _mm256_loadu_ps(scratch->factors + (c + j) * 8);
        const __m256 largest = g->direct ? _mm256_fmadd_ps(top, s[j], amax)
                                         : _mm256_add_ps(_mm256_div_ps(amax, s[j]), top);
        const __m256 faithful = _mm256_cmp_ps(largest, _mm256_set1_ps(b->error_limit), _CMP_LT_OQ);
        const __m256 ok = _mm256_and_ps(_mm256_and_ps(bounded_avx2(s1[j]), bounded_avx2(s2[j])),
                                        _mm256_and_ps(_mm256_and_ps(bounded_avx2(s3[j]), bounded_avx2(f)), faithful));
        const __m256 l1 = log2_cubic_avx2(s1[j]), l2 = log2_cubic_avx2(s2[j]), l3 = log2_cubic_avx2(s3[j]);
        const __m256 lf = factored ? log2_cubic_avx2(f) : _mm256_setzero_ps();
        __m256 upper = _mm256_fmadd_ps(_mm256_set1_ps(b->upper[0]), l1, lf);
        upper = _mm256_fmadd_ps(_mm256_set1_ps(b->upper[1]), l2, upper);
        upper = _mm256_fmadd_ps(_mm256_set1_ps(b->upper[2]), l3, upper);
        __m256 lower = _mm256_fmadd_ps(_mm256_set1_ps(b->lower[0]), l1, lf);
        lower = _mm256_fmadd_ps(_mm256_set1_ps(b->lower[1]), l2, lower);
        lower = _mm256_fmadd_ps(_mm256_set1_ps(b->lower[2]), l3, lower);
        upper = _mm256_blendv_ps(_mm256_set1_ps(__builtin_inff()), upper, ok);
        lower = _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), lower, ok);
        *least_upper = _mm256_min_ps(upper, *least_upper); /* a NaN bound gives the second operand */
        _mm256_storeu_ps(scratch->lower + (c + j) * 8, lower);
    }
}

/* As pair_sums_avx512, eight pairs per vector (pair = c*8 + row); AVX2 always divides, as the full pass. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
pair_sums_avx2(const __m256 *t, const __m256 *tw, int64_t run, const struct grid *g, const int32_t *pairs,
               const float *steps, int width, int kind, float *sums) {
    const __m256 norm = _mm256_set1_ps(g->norm);
    __m256 s[WIDTH_AVX2], v[WIDTH_AVX2], err[WIDTH_AVX2], sum[WIDTH_AVX2];
    __m256i pair[WIDTH_AVX2];
    EACH {
        pair[j] = _mm256_loadu_si256((const __m256i *)(pairs + 8 * j));
        s[j] = _mm256_i32gather_ps(steps, pair[j], 4);
        sum[j] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < run; ++k) {
        EACH v[j] = _mm256_permutevar8x32_ps(t[k], pair[j]); /* the low three bits of c*8 + row: the row */
        errors_avx2(v, 1, s, g, norm, width, kind, err);
        if (tw) {
            EACH err[j] = _mm256_mul_ps(err[j], _mm256_permutevar8x32_ps(tw[k], pair[j]));
        }
        EACH sum[j] = _mm256_add_ps(sum[j], err[j]);
    }
    EACH _mm256_storeu_ps(sums + 8 * j, sum[j]);
}

/* As block_pruned_avx512, eight rows. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
block_pruned_avx2(const __m256 *t, const __m256 *tw, int64_t run, __m256 amax, const struct grid *g,
                  const float *factor, int64_t q, const struct prune *b, float floor,
                  const struct prune_scratch *scratch, __m256 *best, __m256i *index) {
    __m256 least_upper = _mm256_set1_ps(__builtin_inff());
    int64_t c = 0;
    for (; c + 4 <= g->count; c += 4)
        block_bounds_avx2(t, tw, run, amax, g, factor, q, c, 4, b, scratch, &least_upper);
    for (; c < g->count; ++c) block_bounds_avx2(t, tw, run, amax, g, factor, q, c, 1, b, scratch, &least_upper);
    const __m256 threshold =
        _mm256_max_ps(_mm256_set1_ps(floor), _mm256_add_ps(least_upper, _mm256_set1_ps(b->slack)));
    int64_t n = 0;
    for (c = 0; c < g->count; ++c) { /* NGT: a NaN lower bound keeps its pair */
        unsigned keep = (unsigned)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(scratch->lower + c * 8), threshold, _CMP_NGT_UQ));
        for (; keep; keep &= keep - 1) scratch->pairs[n++] = (int32_t)(c * 8 + __builtin_ctz(keep));
    }
    for (int64_t i = n; i % 32; ++i) scratch->pairs[i] = scratch->pairs[0]; /* whole groups of four vectors */
    for (int64_t v = 0; v < (n + 31) / 32 * 4; v += 4)
        pair_sums_avx2(t, tw, run, g, scratch->pairs + v * 8, scratch->steps, 4, POWER_ANY, scratch->sums + v * 8);
    float least[8];
    int32_t chosen[8];
    pick_pairs(scratch, n, has_factor(g, factor), 3, least, chosen);
    *best = _mm256_loadu_ps(least);
    *index = _mm256_loadu_si256((const __m256i *)chosen);
}

/* As heaviest_weight_avx512, eight rows. */
__attribute__((target("avx2,fma"), always_inline)) static inline float heaviest_weight_avx2(const __m256 *tw,
                                                                                          int64_t run) {
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), heaviest = _mm256_setzero_ps();
    for (int64_t k = 0; k < run; ++k) {
        const __m256 zero = _mm256_cmp_ps(tw[k], _mm256_setzero_ps(), _CMP_EQ_OQ);
        ok = _mm256_and_ps(ok, _mm256_or_ps(zero, bounded_avx2(tw[k])));
        heaviest = _mm256_max_ps(heaviest, tw[k]);
    }
    if (_mm256_movemask_ps(ok) != 0xFF) return -1.0f;
    float lanes[8], most = 0.0f;
    _mm256_storeu_ps(lanes, heaviest);
    for (int i = 0; i < 8; ++i) most = lanes[i] > most ? lanes[i] : most;
    return most;
}

/* As block_avx512, eight rows. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
block_avx2(const float *x, const float *weight, int64_t run, const struct grid *g, int64_t r0, int64_t groups,
           int kind, const float *factor, float *best_value, int64_t *best_index, float *out,
           const struct prune *bounds, const struct prune_scratch *scratch) {
    __m256 t[32], tw[32];
    const __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)run));
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < run; ++k) {
        const __m256i at = _mm256_add_epi32(rows, _mm256_set1_epi32((int)k));
        t[k] = _mm256_i32gather_ps(x + r0 * run, at, 4);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), t[k]));
        if (weight) tw[k] = _mm256_i32gather_ps(weight + r0 * run, at, 4);
    }
    const __m256 *w = weight ? tw : 0;
    const int64_t q = r0 % groups;
    __m256 best = _mm256_set1_ps(__builtin_inff());
    __m256i index = _mm256_setzero_si256();
    const float heaviest = best_index && bounds && scratch && w ? heaviest_weight_avx2(w, run) : 1.0f;
    if (best_index && bounds && scratch && heaviest >= 0.0f) {
        block_pruned_avx2(t, w, run, amax, g, factor, q, bounds, floor_log2(heaviest), scratch, &best, &index);
    } else {
        __m256i *picks = best_index ? &index : 0;
        float *o = out ? out + r0 : 0;
        int64_t c = 0;
        for (; c + 4 <= g->count; c += 4) block_candidates_avx2(t, w, run, g, factor, q, c, 4, kind, o, &best, picks);
        for (; c < g->count; ++c) block_candidates_avx2(t, w, run, g, factor, q, c, 1, kind, o, &best, picks);
    }
    if (best_index) {
        _mm256_storeu_ps(best_value + r0, best);
        _mm256_storeu_si256((__m256i *)(best_index + r0), _mm256_cvtepi32_epi64(_mm256_castsi256_si128(index)));
        _mm256_storeu_si256((__m256i *)(best_index + r0 + 4), _mm256_cvtepi32_epi64(_mm256_extracti128_si256(index, 1)));
    }
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
    if (run <= 32 && pieces == 1 && groups % 8 == 0 && (rule != RULE_TABLE || step_q == 0 || step_q == 1)) {
        struct prune bounds;
        const int prunable = best_index && prune_of(norm, kind, count, &bounds);
#pragma omp parallel num_threads(threads)
        {
            struct prune_scratch *scratch = prunable ? prune_scratch_new(count) : 0;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < rows / 8; ++b) {
                if (kind == POWER_ONE)
                    block_avx2(x, weight, run, &g, b * 8, groups, POWER_ONE, factor, best_value, best_index, out, 0, 0);
                else if (kind == POWER_TWO)
                    block_avx2(x, weight, run, &g, b * 8, groups, POWER_TWO, factor, best_value, best_index, out, 0, 0);
                else if (kind == POWER_THREE)
                    block_avx2(x, weight, run, &g, b * 8, groups, POWER_THREE, factor, best_value, best_index, out, 0,
                               0);
                else
                    block_avx2(x, weight, run, &g, b * 8, groups, POWER_ANY, factor, best_value, best_index, out,
                               prunable ? &bounds : 0, scratch);
            }
            prune_scratch_free(scratch);
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
