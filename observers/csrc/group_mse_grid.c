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

/* log2 m = L[i] + log2(m * R[i]) for m in [1, 2), i its top 5 (AVX2: 3) mantissa bits: R[i] =
 * fp32(1/c) for c the middle of the i-th slice of [1, 2), L[i] = -log2(R[i]) rounded; f = m*R[i] - 1
 * is within 1/65 (AVX2: 1/17) of 0, where a short polynomial gives log2(1 + f). */
static const float LOG2_R32[32] = {
    0x1.f81f82p-1f, 0x1.e9131ap-1f, 0x1.dae608p-1f, 0x1.cd8568p-1f, 0x1.c0e07p-1f,  0x1.b4e81cp-1f, 0x1.a98ef6p-1f,
    0x1.9ec8eap-1f, 0x1.948b1p-1f,  0x1.8acb9p-1f,  0x1.818182p-1f, 0x1.78a4c8p-1f, 0x1.702e06p-1f, 0x1.681682p-1f,
    0x1.605816p-1f, 0x1.58ed24p-1f, 0x1.51d07ep-1f, 0x1.4afd6ap-1f, 0x1.446f86p-1f, 0x1.3e22ccp-1f, 0x1.381382p-1f,
    0x1.323e34p-1f, 0x1.2c9fb4p-1f, 0x1.27350cp-1f, 0x1.21fb78p-1f, 0x1.1cf06ap-1f, 0x1.181182p-1f, 0x1.135c82p-1f,
    0x1.0ecf56p-1f, 0x1.0a681p-1f,  0x1.0624dep-1f, 0x1.020408p-1f};
static const float LOG2_L32[32] = {
    0x1.6e7966p-6f, 0x1.0eb392p-4f, 0x1.bc841cp-4f, 0x1.32aea2p-3f, 0x1.84c2bep-3f, 0x1.d49eep-3f,  0x1.11307ep-2f,
    0x1.37124ap-2f, 0x1.5c01a2p-2f, 0x1.800a5ap-2f, 0x1.a3375ep-2f, 0x1.c592fcp-2f, 0x1.e726aap-2f, 0x1.03fda8p-1f,
    0x1.140cap-1f,  0x1.23c41cp-1f, 0x1.3327c8p-1f, 0x1.423b08p-1f, 0x1.51011ap-1f, 0x1.5f7cfep-1f, 0x1.6db194p-1f,
    0x1.7ba192p-1f, 0x1.894f76p-1f, 0x1.96bdacp-1f, 0x1.a3ee8p-1f,  0x1.b0e414p-1f, 0x1.bda07p-1f,  0x1.ca258cp-1f,
    0x1.d6754p-1f,  0x1.e29144p-1f, 0x1.ee7b44p-1f, 0x1.fa34e2p-1f};
/* 2^(j/16), j < 16, rounded. */
static const float EXP2_T16[16] = {0x1p+0f,        0x1.0b5586p+0f, 0x1.172b84p+0f, 0x1.2387a6p+0f,
                                   0x1.306fep+0f,  0x1.3dea64p+0f, 0x1.4bfdaep+0f, 0x1.5ab07ep+0f,
                                   0x1.6a09e6p+0f, 0x1.7a1148p+0f, 0x1.8ace54p+0f, 0x1.9c4918p+0f,
                                   0x1.ae89fap+0f, 0x1.c199bep+0f, 0x1.d5818ep+0f, 0x1.ea4afap+0f};
static const float LOG2_R8[8] = {0x1.e1e1e2p-1f, 0x1.af286cp-1f, 0x1.861862p-1f, 0x1.642c86p-1f,
                                 0x1.47ae14p-1f, 0x1.2f684cp-1f, 0x1.1a7b96p-1f, 0x1.08421p-1f};
static const float LOG2_L8[8] = {0x1.663f6ep-4f, 0x1.fbc16ap-3f, 0x1.91bba6p-2f, 0x1.0c105p-1f,
                                 0x1.49a786p-1f, 0x1.82809cp-1f, 0x1.b7494ap-1f, 0x1.e88c6cp-1f};
/* |f| <= 1/65: log2(1 + f) = f * (B1 + f*(B2 + f*B3)), abs error 3.7e-9 (minimax fit).
 * |f| <= 1/17: log2(1 + f) = f * (A1 + f*(A2 + ... + f*A5)), Taylor: 1/(k ln 2), alternating. */
#define B1 0x1.715476p+0f
#define B2 -0x1.715dbcp-1f
#define B3 0x1.ec89fp-2f
#define A1 1.44269504f
#define A2 -0.721347520f
#define A3 0.480898347f
#define A4 -0.360673760f
#define A5 0.288539008f
/* 2^x = 1 + x*(D1 + x*(D2 + x*D3)) on [-1/32, 1/32], relative error 1.6e-9 (minimax fit). */
#define D1 0x1.62e43p-1f
#define D2 0x1.ebfff4p-3f
#define D3 0x1.c6ac6ap-5f
/* 2^x = 1 + x*(E1 + x*(E2 + ... + x*E6)) on [-1/2, 1/2], relative error 1.6e-8 (minimax fit). */
#define E1 0.693147182f
#define E2 0.240226477f
#define E3 0.0555033237f
#define E4 0.00961843785f
#define E5 0.00133988750f
#define E6 0.000153532892f

enum { POWER_ANY = 0, POWER_ONE = 1, POWER_TWO = 2, POWER_THREE = 3 };

/* What the exported functions share with the per-unit loops; out is (count, units). */
struct grid {
    const float *step, *low, *high;
    int64_t groups, count, bound_c, bound_q, units;
    float norm;
    int direct;
};

/* The powers computed exactly, as the eager paths do: _power_ (steps) squares for norm 2;
 * torch.pow (direct errors) also cubes for norm 3, as (e*e)*e. */
static int power_kind(double norm, int direct) {
    if (norm == 1.0) return POWER_ONE;
    if (norm == 2.0) return POWER_TWO;
    return direct && norm == 3.0 ? POWER_THREE : POWER_ANY;
}

/* ---------------------------------------------------------------- AVX-512 */

#define WIDTH_AVX512 8
#define EACH _Pragma("GCC unroll 8") for (int j = 0; j < width; ++j)

/* err[j] = |clamp(rint(v/s[j]), lo[j], hi[j]) - v/s[j]|^norm for the `width` candidates j (with
 * `direct`, |clamp(...)*s[j] - v|^norm).
 * Written stage by stage across the candidates, so the out-of-order core always has `width`
 * independent operations at hand: one candidate's chain (divide, round, log2, exp2) is about
 * 100 cycles long, more than its scheduler covers from a few chains. The code is rounded after
 * the clamp (the same value: the bounds are integers) with the 1.5*2^23 trick, exact for |v| <=
 * 2^22, which the clamp ensures. |e|^norm: exact for norm 1 and 2, else 2^(norm*log2 e), 0 -> 0. */
__attribute__((target("avx512f"), always_inline)) static inline void
errors_avx512(__m512 v, const __m512 *s, const __m512 *lo, const __m512 *hi, __m512 norm, int direct, int width,
              int kind, __m512 *err) {
    const __m512 round_magic = _mm512_set1_ps(0x1.8p23f), table_magic = _mm512_set1_ps(0x1.8p19f);
    __m512 scaled[WIDTH_AVX512], a[WIDTH_AVX512], b[WIDTH_AVX512];
    __m512i slice[WIDTH_AVX512];
    EACH scaled[j] = _mm512_div_ps(v, s[j]);
    EACH a[j] = _mm512_min_ps(hi[j], _mm512_max_ps(lo[j], scaled[j])); /* second operands: NaN propagates */
    EACH a[j] = _mm512_sub_ps(_mm512_add_ps(a[j], round_magic), round_magic);
    if (direct) { /* |code*s - v| = |fake_quant(v) - v|, rounded as the eager dequantization */
        EACH err[j] = _mm512_abs_ps(_mm512_sub_ps(_mm512_mul_ps(a[j], s[j]), v));
    } else {
        EACH err[j] = _mm512_abs_ps(_mm512_sub_ps(a[j], scaled[j]));
    }
    if (kind == POWER_ONE) return;
    if (kind == POWER_TWO || kind == POWER_THREE) {
        EACH a[j] = _mm512_mul_ps(err[j], err[j]);
        EACH err[j] = kind == POWER_TWO ? a[j] : _mm512_mul_ps(a[j], err[j]);
        return;
    }
    /* log2 e = exponent + L[i] + log2(1 + f), f = mantissa * R[i] - 1 */
    const __m512 r_low = _mm512_loadu_ps(LOG2_R32), r_high = _mm512_loadu_ps(LOG2_R32 + 16);
    const __m512 l_low = _mm512_loadu_ps(LOG2_L32), l_high = _mm512_loadu_ps(LOG2_L32 + 16);
    EACH a[j] = _mm512_getmant_ps(err[j], _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
    EACH slice[j] = _mm512_srli_epi32(_mm512_castps_si512(a[j]), 18); /* low 5 bits: top mantissa bits */
    EACH a[j] = _mm512_fmsub_ps(a[j], _mm512_permutex2var_ps(r_low, slice[j], r_high), _mm512_set1_ps(1.0f));
    EACH b[j] = _mm512_fmadd_ps(_mm512_set1_ps(B3), a[j], _mm512_set1_ps(B2));
    EACH b[j] = _mm512_fmadd_ps(b[j], a[j], _mm512_set1_ps(B1));
    EACH b[j] = _mm512_fmadd_ps(a[j], b[j], _mm512_permutex2var_ps(l_low, slice[j], l_high));
    /* t = norm*exponent + norm*fraction, rounded once: as exact as one fp32 rounding allows */
    EACH b[j] = _mm512_fmadd_ps(norm, _mm512_getexp_ps(err[j]), _mm512_mul_ps(norm, b[j]));
    /* within [-1000, 200] (2^t is 0 or +inf beyond): the table trick needs |t| < 2^18; second
     * operands, so a NaN stays NaN */
    EACH b[j] = _mm512_max_ps(_mm512_set1_ps(-1000.0f), _mm512_min_ps(_mm512_set1_ps(200.0f), b[j]));
    /* 2^t = 2^floor(k/16) * T[k mod 16] * 2^x, k = rint(16 t), x = t - k/16 in [-1/32, 1/32]: t + 1.5*2^19
     * holds k in its low mantissa bits, and scalef multiplies by 2^floor of its second operand. */
    const __m512 t_table = _mm512_loadu_ps(EXP2_T16);
    EACH a[j] = _mm512_add_ps(b[j], table_magic);
    EACH slice[j] = _mm512_castps_si512(a[j]);
    EACH a[j] = _mm512_sub_ps(a[j], table_magic);
    EACH b[j] = _mm512_sub_ps(b[j], a[j]);
    EACH scaled[j] = _mm512_permutexvar_ps(slice[j], t_table);
    EACH b[j] = _mm512_mul_ps(b[j], _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(D3), b[j], _mm512_set1_ps(D2)), b[j],
                                                    _mm512_set1_ps(D1)));
    EACH b[j] = _mm512_fmadd_ps(scaled[j], b[j], scaled[j]);
    EACH err[j] = _mm512_scalef_ps(b[j], a[j]); /* e = 0: t = -inf, clamped to -1000, gives 0 */
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
        errors_avx512(_mm512_loadu_ps(x + i), s, lo, hi, norm, g->direct, width, kind, err);
        if (w) {
            EACH err[j] = _mm512_mul_ps(err[j], _mm512_loadu_ps(w + i));
        }
        EACH sum[j] = _mm512_add_ps(sum[j], err[j]);
    }
    if (i < length) {
        const __mmask16 tail = (__mmask16)((1u << (length - i)) - 1u);
        errors_avx512(_mm512_maskz_loadu_ps(tail, x + i), s, lo, hi, norm, g->direct, width, kind, err);
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
    const struct grid g = {step, low, high, groups, count, bound_c, bound_q, rows * pieces, (float)norm, direct};
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

#define WIDTH_AVX2 4

/* 2^n for integer n in [-126, 127]. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 pow2_avx2(__m256i n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

/* As errors_avx512 with AVX2's instructions: the exponent and mantissa come from the bits
 * (denormals scaled by 2^23 first), log2 from an 8-entry table and a degree-5 series, 2^n is
 * applied in two halves (gradual underflow), and +inf/NaN errors pass through unchanged. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
errors_avx2(__m256 v, const __m256 *s, const __m256 *lo, const __m256 *hi, __m256 norm, int direct, int width,
            int kind, __m256 *err) {
    const __m256 round_magic = _mm256_set1_ps(0x1.8p23f);
    __m256 scaled[WIDTH_AVX2], a[WIDTH_AVX2], b[WIDTH_AVX2], tiny[WIDTH_AVX2];
    __m256i bits[WIDTH_AVX2], slice[WIDTH_AVX2];
    EACH scaled[j] = _mm256_div_ps(v, s[j]);
    EACH a[j] = _mm256_min_ps(hi[j], _mm256_max_ps(lo[j], scaled[j])); /* second operands: NaN propagates */
    EACH a[j] = _mm256_sub_ps(_mm256_add_ps(a[j], round_magic), round_magic);
    if (direct) {
        EACH a[j] = _mm256_sub_ps(_mm256_mul_ps(a[j], s[j]), v);
    } else {
        EACH a[j] = _mm256_sub_ps(a[j], scaled[j]);
    }
    EACH err[j] = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a[j]);
    if (kind == POWER_ONE) return;
    if (kind == POWER_TWO || kind == POWER_THREE) {
        EACH a[j] = _mm256_mul_ps(err[j], err[j]);
        EACH err[j] = kind == POWER_TWO ? a[j] : _mm256_mul_ps(a[j], err[j]);
        return;
    }
    const __m256 r_table = _mm256_loadu_ps(LOG2_R8), l_table = _mm256_loadu_ps(LOG2_L8);
    EACH tiny[j] = _mm256_cmp_ps(err[j], _mm256_set1_ps(0x1p-126f), _CMP_LT_OQ);
    EACH bits[j] = _mm256_castps_si256(_mm256_blendv_ps(err[j], _mm256_mul_ps(err[j], _mm256_set1_ps(0x1p23f)), tiny[j]));
    EACH b[j] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits[j], 23), _mm256_set1_epi32(127)));
    EACH b[j] = _mm256_sub_ps(b[j], _mm256_and_ps(tiny[j], _mm256_set1_ps(23.0f))); /* the exponent */
    EACH bits[j] = _mm256_or_si256(_mm256_and_si256(bits[j], _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000));
    EACH slice[j] = _mm256_srli_epi32(bits[j], 20); /* low 3 bits: top mantissa bits */
    EACH a[j] = _mm256_fmsub_ps(_mm256_castsi256_ps(bits[j]), _mm256_permutevar8x32_ps(r_table, slice[j]),
                                _mm256_set1_ps(1.0f));
    EACH scaled[j] = _mm256_fmadd_ps(_mm256_set1_ps(A5), a[j], _mm256_set1_ps(A4));
    EACH scaled[j] = _mm256_fmadd_ps(scaled[j], a[j], _mm256_set1_ps(A3));
    EACH scaled[j] = _mm256_fmadd_ps(scaled[j], a[j], _mm256_set1_ps(A2));
    EACH scaled[j] = _mm256_fmadd_ps(scaled[j], a[j], _mm256_set1_ps(A1));
    EACH a[j] = _mm256_fmadd_ps(a[j], scaled[j], _mm256_permutevar8x32_ps(l_table, slice[j]));
    EACH b[j] = _mm256_fmadd_ps(norm, b[j], _mm256_mul_ps(norm, a[j])); /* t, rounded once */
    EACH b[j] = _mm256_max_ps(_mm256_min_ps(b[j], _mm256_set1_ps(250.0f)), _mm256_set1_ps(-250.0f));
    EACH tiny[j] = _mm256_round_ps(b[j], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); /* n */
    EACH b[j] = _mm256_sub_ps(b[j], tiny[j]);
    EACH a[j] = _mm256_fmadd_ps(_mm256_set1_ps(E6), b[j], _mm256_set1_ps(E5));
    EACH a[j] = _mm256_fmadd_ps(a[j], b[j], _mm256_set1_ps(E4));
    EACH a[j] = _mm256_fmadd_ps(a[j], b[j], _mm256_set1_ps(E3));
    EACH a[j] = _mm256_fmadd_ps(a[j], b[j], _mm256_set1_ps(E2));
    EACH a[j] = _mm256_fmadd_ps(a[j], b[j], _mm256_set1_ps(E1));
    EACH a[j] = _mm256_fmadd_ps(a[j], b[j], _mm256_set1_ps(1.0f));
    EACH bits[j] = _mm256_cvtps_epi32(tiny[j]);
    EACH slice[j] = _mm256_srai_epi32(bits[j], 1);
    EACH a[j] = _mm256_mul_ps(_mm256_mul_ps(a[j], pow2_avx2(slice[j])), pow2_avx2(_mm256_sub_epi32(bits[j], slice[j])));
    EACH a[j] = _mm256_blendv_ps(a[j], err[j], _mm256_cmp_ps(err[j], _mm256_set1_ps(0x1.fffffep127f), _CMP_NLE_UQ));
    EACH err[j] = _mm256_and_ps(a[j], _mm256_cmp_ps(err[j], _mm256_setzero_ps(), _CMP_NEQ_UQ));
}

__attribute__((target("avx2,fma"), always_inline)) static inline float sum_avx2(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
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
    const struct grid g = {step, low, high, groups, count, bound_c, bound_q, rows * pieces, (float)norm, direct};
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
