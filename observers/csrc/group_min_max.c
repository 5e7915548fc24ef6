/* Min and max of each contiguous run of fp32 values, in one read of the data.
 *
 * Eager torch needs two passes for this (amin, then amax: torch.aminmax over a short last dim
 * is not vectorized), so a min-max observer costs about three reads of a weight; this kernel
 * reads it once. Built with -fopenmp and loaded at run time by observers/kernels.py (plain C,
 * no torch headers). libgomp is already loaded by torch under the same soname, so the loop
 * below runs on torch's own OpenMP threads instead of competing with them.
 *
 * group_min_max_<isa>(x, run, rows, threads, lo, hi): for each run r < rows, lo[r] and hi[r]
 * are the min and max of x[r*run .. r*run + run - 1]; both are NaN when the run holds a NaN or
 * an infinity, so callers detect non-finite data from the (small) results alone.
 * simd_level() says which variants this CPU runs: 2 = AVX-512 and AVX2, 1 = AVX2, 0 = none.
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

__attribute__((target("avx512f"))) void group_min_max_avx512(const float *x, int64_t run, int64_t rows, int threads,
                                                             float *lo, float *hi) {
    const __m512i exponent = _mm512_set1_epi32((int)EXPONENT_BITS);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r) {
        const float *p = x + r * run;
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
        lo[r] = nonfinite ? NAN : a;
        hi[r] = nonfinite ? NAN : b;
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

int simd_level(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2")) return 2;
    if (__builtin_cpu_supports("avx2")) return 1;
    return 0;
}
#else
int simd_level(void) { return 0; }
#endif
