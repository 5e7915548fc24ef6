/* Min and max of each contiguous run of fp32 values, in one read of the data.
 *
 * Eager torch needs two passes for this (amin, then amax: torch.aminmax over a short last dim
 * is not vectorized), so a min-max observer costs about three reads of a weight; this kernel
 * reads it once. Built with -fopenmp and loaded at run time by observers/kernels.py (plain C,
 * no torch headers). libgomp is already loaded by torch under the same soname, so the loop
 * below runs on torch's own OpenMP threads instead of competing with them.
 *
 * The AVX-512 variant takes runs whose length is a multiple of 32 (group sizes 32, 64, 128, ...)
 * sixteen at a time and reduces the sixteen together (fold16), which is what keeps it near one
 * read of the data for group-128 weights that sit in the cache; other runs go one by one.
 *
 * group_min_max_<isa>(x, run, rows, threads, lo, hi): for each run r < rows, lo[r] and hi[r]
 * are the min and max of x[r*run .. r*run + run - 1]; both are NaN when the run holds a NaN or
 * an infinity, so callers detect non-finite data from the (small) results alone.
 * simd_level() (simd_level.h) says which variants this CPU runs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define EXPONENT_BITS 0x7f800000u

static int scalar_tail(const float *p, int64_t from, int64_t to, float *lo, float *hi) {
    int nonfinite = 0;
    for (int64_t i = from; i < to; ++i) {
        float v = p[i];
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        nonfinite |= (bits & EXPONENT_BITS) == EXPONENT_BITS;
        *lo = v < *lo ? v : *lo;
        *hi = v > *hi ? v : *hi;
    }
    return nonfinite;
}

__attribute__((target("avx512f"))) static void one_run_avx512(const float *p, int64_t run, float *lo, float *hi) {
    const __m512i exponent = _mm512_set1_epi32((int)EXPONENT_BITS);
    __m512 low = _mm512_set1_ps(p[0]), high = low;
    __mmask16 nonfinite_lanes = 0;
    int64_t i = 0;
    for (; i + 16 <= run; i += 16) {
        __m512 v = _mm512_loadu_ps(p + i);
        low = _mm512_min_ps(low, v);
        high = _mm512_max_ps(high, v);
        __m512i e = _mm512_and_si512(_mm512_castps_si512(v), exponent);
        nonfinite_lanes |= _mm512_cmpeq_epi32_mask(e, exponent);
    }
    float a = _mm512_reduce_min_ps(low), b = _mm512_reduce_max_ps(high);
    int nonfinite = (nonfinite_lanes != 0) | scalar_tail(p, i, run, &a, &b);
    *lo = nonfinite ? NAN : a;
    *hi = nonfinite ? NAN : b;
}

/* One vector whose lane j is the min (or max) of the 16 lanes of v[j]: a transpose tree, 15
 * lane-wise reductions for 16 runs instead of one horizontal reduction (~8 dependent steps) per run. */
__attribute__((target("avx512f"))) static __m512 fold16(const __m512 v[16], int is_max) {
#define PICK(a, b) (is_max ? _mm512_max_ps((a), (b)) : _mm512_min_ps((a), (b)))
    __m512 halves[8], quarters[4];
    for (int j = 0; j < 8; ++j) { /* 128-bit lanes: v[2j] {0^2, 1^3}, v[2j+1] {0^2, 1^3} */
        __m512 a = v[2 * j], b = v[2 * j + 1];
        halves[j] = PICK(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int j = 0; j < 4; ++j) { /* 128-bit lane k holds the 4 floats left of vector 4j + k */
        __m512 a = halves[2 * j], b = halves[2 * j + 1];
        quarters[j] = PICK(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    }
    __m512 a = PICK(_mm512_unpacklo_ps(quarters[0], quarters[1]), _mm512_unpackhi_ps(quarters[0], quarters[1]));
    __m512 b = PICK(_mm512_unpacklo_ps(quarters[2], quarters[3]), _mm512_unpackhi_ps(quarters[2], quarters[3]));
    __m512 c = PICK(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
#undef PICK
    /* c holds vector 4j + k at position 4k + j */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, c);
}

/* Sixteen consecutive runs whose length is a multiple of 32: two accumulators per run (shorter
 * dependency chains), NaN tracked per run, infinities read off the results (a run holding +inf
 * has max +inf, one holding -inf has min -inf). */
__attribute__((target("avx512f"))) static void sixteen_runs_avx512(const float *x, int64_t run, float *lo, float *hi) {
    __m512 lows[16], highs[16];
    __mmask16 nan_runs = 0;
    for (int k = 0; k < 16; ++k) {
        const float *p = x + k * run;
        __m512 l0 = _mm512_loadu_ps(p), l1 = _mm512_loadu_ps(p + 16), h0 = l0, h1 = l1;
        __mmask16 nan_lanes = _mm512_cmp_ps_mask(l0, l0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(l1, l1, _CMP_UNORD_Q);
        for (int64_t i = 32; i < run; i += 32) {
            __m512 v0 = _mm512_loadu_ps(p + i), v1 = _mm512_loadu_ps(p + i + 16);
            l0 = _mm512_min_ps(l0, v0);
            h0 = _mm512_max_ps(h0, v0);
            l1 = _mm512_min_ps(l1, v1);
            h1 = _mm512_max_ps(h1, v1);
            nan_lanes |= _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        }
        lows[k] = _mm512_min_ps(l0, l1);
        highs[k] = _mm512_max_ps(h0, h1);
        nan_runs |= (__mmask16)((nan_lanes != 0) << k);
    }
    __m512 low = fold16(lows, 0), high = fold16(highs, 1);
    const __m512 inf = _mm512_set1_ps(INFINITY), minus_inf = _mm512_set1_ps(-INFINITY);
    __mmask16 bad = nan_runs | _mm512_cmp_ps_mask(high, inf, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(low, minus_inf, _CMP_EQ_OQ);
    const __m512 nan = _mm512_set1_ps(NAN);
    _mm512_storeu_ps(lo, _mm512_mask_blend_ps(bad, low, nan));
    _mm512_storeu_ps(hi, _mm512_mask_blend_ps(bad, high, nan));
}

__attribute__((target("avx512f"))) void group_min_max_avx512(const float *x, int64_t run, int64_t rows, int threads,
                                                             float *lo, float *hi) {
    const int64_t blocks = run % 32 == 0 ? rows / 16 : 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < blocks; ++b) sixteen_runs_avx512(x + b * 16 * run, run, lo + b * 16, hi + b * 16);
#pragma omp for schedule(static)
        for (int64_t r = blocks * 16; r < rows; ++r) one_run_avx512(x + r * run, run, lo + r, hi + r);
    }
}

__attribute__((target("avx2"))) void group_min_max_avx2(const float *x, int64_t run, int64_t rows, int threads,
                                                        float *lo, float *hi) {
    const __m256i exponent = _mm256_set1_epi32((int)EXPONENT_BITS);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r) {
        const float *p = x + r * run;
        __m256 low = _mm256_set1_ps(p[0]), high = low;
        __m256i nonfinite_lanes = _mm256_setzero_si256();
        int64_t i = 0;
        for (; i + 8 <= run; i += 8) {
            __m256 v = _mm256_loadu_ps(p + i);
            low = _mm256_min_ps(low, v);
            high = _mm256_max_ps(high, v);
            __m256i e = _mm256_and_si256(_mm256_castps_si256(v), exponent);
            nonfinite_lanes = _mm256_or_si256(nonfinite_lanes, _mm256_cmpeq_epi32(e, exponent));
        }
        float lows[8], highs[8];
        _mm256_storeu_ps(lows, low);
        _mm256_storeu_ps(highs, high);
        float a = lows[0], b = highs[0];
        for (int j = 1; j < 8; ++j) {
            a = lows[j] < a ? lows[j] : a;
            b = highs[j] > b ? highs[j] : b;
        }
        int nonfinite = (!_mm256_testz_si256(nonfinite_lanes, nonfinite_lanes)) | scalar_tail(p, i, run, &a, &b);
        lo[r] = nonfinite ? NAN : a;
        hi[r] = nonfinite ? NAN : b;
    }
}

#endif

#include "simd_level.h"
