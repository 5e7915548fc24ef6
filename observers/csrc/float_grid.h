/* The float grid rounding of observers/formats.py (round_to_float_grid_), bit for bit, for the kernels that
 * round onto an E<exp_bits>M<man_bits> element grid (FP4 E2M1, FP6, FP8, and E4M3 block scales): clamp to
 * +-max_value, then round to a multiple of the binade's step 2^(e - man_bits) (at least the subnormal
 * binade's), half to even. The rounding is one add and one subtract of M = 1.5 * 2^(23 + e - man_bits),
 * whose ulp is the step: |a| < 2^(e + 1) keeps a + M in M's binade, so the sum is rounded to a multiple of
 * the step, to the even one on a tie (M / step is even), and subtracting M back is exact. That equals
 * eager's round(a * 2^(man - e)) / 2^(man - e) (both exact scalings by powers of two) except that a value
 * rounding to zero gives +0 where eager keeps its sign, which no error or dequantized value can tell
 * (0 * s - v = -v either way). M's bits come from a's exponent field by one integer add, so on x86 the
 * rounding costs two float operations where the multiply, round and multiply back cost four micro-ops.
 * Also the correctly rounded quotient v/s without a divide, which the grid rounding needs first
 * (fake_quantize divides). Scalar, AVX-512 and AVX2 forms of one value or vector, inlined where used;
 * the constants of a grid come from float_grid_of. Included inside the x86 section of a kernel, after
 * <stdint.h> and <immintrin.h>; observers/kernels.py hashes it with every kernel's source. */
#ifndef OBSERVERS_FLOAT_GRID_H
#define OBSERVERS_FLOAT_GRID_H

/* A grid's constants: max_value, the smallest exponent field (the subnormal binade's), and what turns an
 * exponent field into the bits of M = 1.5 * 2^(e - man_bits + 23) (field + magic_shift). */
struct float_grid {
    float max_value;
    int32_t min_field, magic_shift;
};

static inline struct float_grid float_grid_of(int exp_bits, int man_bits, double max_value) {
    struct float_grid g;
    g.max_value = (float)max_value;
    g.min_field = (int32_t)((uint32_t)(2 - (1 << (exp_bits - 1)) + 127) << 23);
    g.magic_shift = (int32_t)(((uint32_t)(23 - man_bits) << 23) | 0x400000u);
    return g;
}

static inline float bits_float(uint32_t u) {
    union {
        uint32_t u;
        float f;
    } b = {u};
    return b.f;
}

static inline uint32_t float_bits(float f) {
    union {
        float f;
        uint32_t u;
    } b = {f};
    return b.u;
}

/* grid(v) of one value: the clamp keeps a NaN (both comparisons false), as torch's clamp does. */
static inline float float_grid_round(float v, const struct float_grid *g) {
    v = v < -g->max_value ? -g->max_value : (v > g->max_value ? g->max_value : v);
    int32_t field = (int32_t)(float_bits(v) & 0x7F800000u);
    if (field < g->min_field) field = g->min_field;
    const float magic = bits_float((uint32_t)field + (uint32_t)g->magic_shift);
    return (v + magic) - magic;
}

/* Whether v*r (r = 1/s rounded) corrected by one fma is the correctly rounded v/s for every |v| <= amax:
 * s within [2^-125, 2^125], where r is a normal number and the first quotient is within an ulp (Markstein's
 * theorem; group_float_grid.c checked it against the divide on 6.4e8 random pairs), and no quotient
 * reaching 2^126, where v*r could overflow to inf and the correction make it NaN (the divide gives inf,
 * which the grid clamps). A quotient below 2^-126 may be an ulp off, which no grid resolves: it rounds to a
 * zero code of the right sign either way. A NaN amax (or s) says no; the callers then divide. */
static inline int float_grid_fast_quotient(float s, float r, float amax) {
    const float size = s < 0.0f ? -s : s;
    return size >= 0x1p-125f && size <= 0x1p125f && amax * r < 0x1p126f;
}

/* ---------------------------------------------------------------- AVX-512 */

/* grid(a) of values a >= -max_value (or NaN): the upper clamp (second operand, so a NaN propagates), M
 * from the exponent field, the add and subtract of M. Magnitudes need no lower clamp: the rounding is
 * symmetric (half to even about 0), so grid(|v|) = |grid(v)|. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 float_grid_round_magnitude_avx512(
    __m512 a, const struct float_grid *g) {
    a = _mm512_min_ps(_mm512_set1_ps(g->max_value), a);
    const __m512i field = _mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7F800000)),
                                           _mm512_set1_epi32(g->min_field));
    const __m512 magic = _mm512_castsi512_ps(_mm512_add_epi32(field, _mm512_set1_epi32(g->magic_shift)));
    return _mm512_sub_ps(_mm512_add_ps(a, magic), magic);
}

/* grid(v), lane by lane: the lower clamp (second operand, so a NaN propagates), then the rest. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 float_grid_round_avx512(
    __m512 v, const struct float_grid *g) {
    return float_grid_round_magnitude_avx512(_mm512_max_ps(_mm512_set1_ps(-g->max_value), v), g);
}

/* v/s correctly rounded from r = 1/s where float_grid_fast_quotient allows: q = v*r, q + (v - q*s)*r. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 float_grid_quotient_avx512(__m512 v, __m512 s,
                                                                                                 __m512 r) {
    const __m512 q = _mm512_mul_ps(v, r);
    return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, s, v), r, q);
}

/* ---------------------------------------------------------------- AVX2 */

/* As float_grid_round_magnitude_avx512 with AVX2's instructions. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 float_grid_round_magnitude_avx2(
    __m256 a, const struct float_grid *g) {
    a = _mm256_min_ps(_mm256_set1_ps(g->max_value), a);
    const __m256i field = _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7F800000)),
                                           _mm256_set1_epi32(g->min_field));
    const __m256 magic = _mm256_castsi256_ps(_mm256_add_epi32(field, _mm256_set1_epi32(g->magic_shift)));
    return _mm256_sub_ps(_mm256_add_ps(a, magic), magic);
}

/* As float_grid_round_avx512. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 float_grid_round_avx2(
    __m256 v, const struct float_grid *g) {
    return float_grid_round_magnitude_avx2(_mm256_max_ps(_mm256_set1_ps(-g->max_value), v), g);
}

/* As float_grid_quotient_avx512. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 float_grid_quotient_avx2(__m256 v, __m256 s,
                                                                                               __m256 r) {
    const __m256 q = _mm256_mul_ps(v, r);
    return _mm256_fmadd_ps(_mm256_fnmadd_ps(q, s, v), r, q);
}

#endif
