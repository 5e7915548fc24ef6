/* What the candidate-error kernels (group_mse_grid.c, group_float_grid.c) share: the tables and
 * polynomials of their vectorized |e|^norm = 2^(norm*log2|e|), which norms have an exact form, and two
 * AVX2 helpers. Included inside their x86 section, after <immintrin.h>. */
#ifndef OBSERVERS_SIMD_POWER_H
#define OBSERVERS_SIMD_POWER_H

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

static int power_kind(double norm, int direct) {
    if (norm == 1.0) return POWER_ONE;
    if (norm == 2.0) return POWER_TWO;
    return direct && norm == 3.0 ? POWER_THREE : POWER_ANY;
}

/* 2^n for integer n in [-126, 127]. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 pow2_avx2(__m256i n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

__attribute__((target("avx2,fma"), always_inline)) static inline float sum_avx2(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

#define WIDTH_AVX512 8
#define WIDTH_AVX2 4
#define EACH _Pragma("GCC unroll 8") for (int j = 0; j < width; ++j)

/* What power_avx512 reads besides norm: norm*L[i] for the 32 slices, then norm*B1, norm*B2, norm*B3,
 * so that norm*log2(m) comes out of the polynomial itself and t takes one fused multiply-add. */
enum { POWER_LOG_TABLE = 35 };

static inline void power_log_table(float norm, float *table) {
    for (int i = 0; i < 32; ++i) table[i] = norm * LOG2_L32[i];
    table[32] = norm * B1;
    table[33] = norm * B2;
    table[34] = norm * B3;
}

/* err[j] <- err[j]^norm for the `width` vectors of |e| (kind: power_kind's); exact for norms 1, 2
 * (and 3), else 2^(norm*log2 e) as the kernels' headers describe, 0^norm = 0, +inf/NaN kept;
 * log_table from power_log_table(norm). */
__attribute__((target("avx512f"), always_inline)) static inline void power_avx512(__m512 *err, __m512 norm, int width,
                                                                                 int kind, const float *log_table) {
    const __m512 table_magic = _mm512_set1_ps(0x1.8p19f);
    __m512 scaled[WIDTH_AVX512], a[WIDTH_AVX512], b[WIDTH_AVX512];
    __m512i slice[WIDTH_AVX512];
    if (kind == POWER_ONE) return;
    if (kind == POWER_TWO || kind == POWER_THREE) {
        EACH a[j] = _mm512_mul_ps(err[j], err[j]);
        EACH err[j] = kind == POWER_TWO ? a[j] : _mm512_mul_ps(a[j], err[j]);
        return;
    }
    /* norm*log2 e = norm*exponent + norm*L[i] + norm*log2(1 + f), f = mantissa * R[i] - 1 */
    const __m512 r_low = _mm512_loadu_ps(LOG2_R32), r_high = _mm512_loadu_ps(LOG2_R32 + 16);
    const __m512 l_low = _mm512_loadu_ps(log_table), l_high = _mm512_loadu_ps(log_table + 16);
    EACH a[j] = _mm512_getmant_ps(err[j], _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
    EACH slice[j] = _mm512_srli_epi32(_mm512_castps_si512(a[j]), 18); /* low 5 bits: top mantissa bits */
    EACH a[j] = _mm512_fmsub_ps(a[j], _mm512_permutex2var_ps(r_low, slice[j], r_high), _mm512_set1_ps(1.0f));
    EACH b[j] = _mm512_fmadd_ps(_mm512_set1_ps(log_table[34]), a[j], _mm512_set1_ps(log_table[33]));
    EACH b[j] = _mm512_fmadd_ps(b[j], a[j], _mm512_set1_ps(log_table[32]));
    EACH b[j] = _mm512_fmadd_ps(a[j], b[j], _mm512_permutex2var_ps(l_low, slice[j], l_high));
    /* t = norm*exponent + norm*fraction, rounded once: as exact as one fp32 rounding allows */
    EACH b[j] = _mm512_fmadd_ps(norm, _mm512_getexp_ps(err[j]), b[j]);
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

/* As power_avx512 with AVX2's instructions. */
__attribute__((target("avx2,fma"), always_inline)) static inline void power_avx2(__m256 *err, __m256 norm, int width,
                                                                                int kind) {
    __m256 scaled[WIDTH_AVX2], a[WIDTH_AVX2], b[WIDTH_AVX2], tiny[WIDTH_AVX2];
    __m256i bits[WIDTH_AVX2], slice[WIDTH_AVX2];
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

#endif
