/* AWQ's candidates' effective weights Q(W·s)/s in one read of W and one write per candidate.
 *
 * The eager path (lab/awq/candidates.py: smoothed, then observers/quantize.py fake_quantize, then
 * effective) makes about ten elementwise passes over a weight-sized buffer per candidate, two of
 * them in float64 (the product W·s and the quotient Q/s, as llm-compressor computes them): at a
 * 7B block's width a gate/up candidate is 90M elements and those passes cost about 0.8 s, more
 * than a tenth of an AWQ search. This kernel computes each element in registers with the eager
 * operations in the eager order, so every output is bit-identical to the eager path's. Built with
 * -fopenmp -ffp-contract=off and loaded by observers/kernels.py (plain C, no torch headers; the
 * loop runs on torch's own OpenMP threads).
 *
 * smoothed_quant_<isa>(w, rows, columns, n, scales, step, zero_point, group, qmin, qmax, threads, out):
 *   w is the (rows, columns) fp32 weight; for candidate i (of n) scales[i] holds its (columns,)
 *   fp64 smoothing scales, step[i] and zero_point[i] its (rows, columns/group) fp32 grid; out is
 *   (n, rows, columns) fp32. For row r, column c, group q = c / group:
 *     sm   = (float)((double)w[r][c] * scales[i][c])              the product cast, as W·s is
 *     code = clamp(rint(sm / step) + zp, qmin, qmax)              true division, half to even
 *     q    = (code - zp) * step                                    fake_quantize's dequantize
 *     out[i][r][c] = (float)((double)q / scales[i][c])             the quotient cast, as Q/s is
 *   group is a multiple of 16 and divides columns (observers/smoothed_quant_kernel.py checks).
 *   Work: the n·rows rows are split evenly over the threads.
 * simd_level() (simd_level.h) says which variants this CPU runs.
 */
#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* ---------------------------------------------------------------- AVX-512 */

/* Eight fp32 lanes times eight fp64 scales, cast back to fp32. */
__attribute__((target("avx512f"), always_inline)) static inline __m256 product_avx512(__m256 w, __m512d s) {
    return _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(w), s));
}

__attribute__((target("avx512f"), always_inline)) static inline __m256 quotient_avx512(__m256 q, __m512d s) {
    return _mm512_cvtpd_ps(_mm512_div_pd(_mm512_cvtps_pd(q), s));
}

__attribute__((target("avx512f"))) static void rows_avx512(const float *w, int64_t rows, int64_t columns,
                                                          const double *scales, const float *step,
                                                          const float *zero_point, int64_t group, float qmin_value,
                                                          float qmax_value, int64_t first, int64_t last, float *out) {
    const __m512 qmin = _mm512_set1_ps(qmin_value), qmax = _mm512_set1_ps(qmax_value);
    const int64_t groups = columns / group;
    for (int64_t u = first; u < last; ++u) { /* u = i * rows + r */
        const int64_t i = u / rows, r = u % rows;
        const float *wr = w + r * columns;
        const double *s = scales + i * columns;
        float *o = out + u * columns;
        for (int64_t q = 0; q < groups; ++q) {
            const __m512 d = _mm512_set1_ps(step[u * groups + q]), zp = _mm512_set1_ps(zero_point[u * groups + q]);
            for (int64_t c = q * group; c < (q + 1) * group; c += 16) {
                const __m512 v = _mm512_loadu_ps(wr + c);
                const __m512d s_low = _mm512_loadu_pd(s + c), s_high = _mm512_loadu_pd(s + c + 8);
                const __m256 low = product_avx512(_mm512_castps512_ps256(v), s_low);
                const __m256 high =
                    product_avx512(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), s_high);
                const __m512 sm = _mm512_castpd_ps(
                    _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(low)), _mm256_castps_pd(high), 1));
                __m512 code =
                    _mm512_add_ps(_mm512_roundscale_ps(_mm512_div_ps(sm, d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
                code = _mm512_min_ps(qmax, _mm512_max_ps(qmin, code)); /* second operands: NaN propagates, as clamp_ */
                const __m512 dq = _mm512_mul_ps(_mm512_sub_ps(code, zp), d);
                _mm256_storeu_ps(o + c, quotient_avx512(_mm512_castps512_ps256(dq), s_low));
                _mm256_storeu_ps(o + c + 8,
                                 quotient_avx512(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dq), 1)), s_high));
            }
        }
    }
}

/* ---------------------------------------------------------------- AVX2 */

__attribute__((target("avx2,fma"), always_inline)) static inline __m128 product_avx2(__m128 w, __m256d s) {
    return _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(w), s));
}

__attribute__((target("avx2,fma"), always_inline)) static inline __m128 quotient_avx2(__m128 q, __m256d s) {
    return _mm256_cvtpd_ps(_mm256_div_pd(_mm256_cvtps_pd(q), s));
}

__attribute__((target("avx2,fma"))) static void rows_avx2(const float *w, int64_t rows, int64_t columns,
                                                         const double *scales, const float *step,
                                                         const float *zero_point, int64_t group, float qmin_value,
                                                         float qmax_value, int64_t first, int64_t last, float *out) {
    const __m256 qmin = _mm256_set1_ps(qmin_value), qmax = _mm256_set1_ps(qmax_value);
    const int64_t groups = columns / group;
    for (int64_t u = first; u < last; ++u) {
        const int64_t i = u / rows, r = u % rows;
        const float *wr = w + r * columns;
        const double *s = scales + i * columns;
        float *o = out + u * columns;
        for (int64_t q = 0; q < groups; ++q) {
            const __m256 d = _mm256_set1_ps(step[u * groups + q]), zp = _mm256_set1_ps(zero_point[u * groups + q]);
            for (int64_t c = q * group; c < (q + 1) * group; c += 8) {
                const __m256 v = _mm256_loadu_ps(wr + c);
                const __m256d s_low = _mm256_loadu_pd(s + c), s_high = _mm256_loadu_pd(s + c + 4);
                const __m128 low = product_avx2(_mm256_castps256_ps128(v), s_low);
                const __m128 high = product_avx2(_mm256_extractf128_ps(v, 1), s_high);
                const __m256 sm = _mm256_insertf128_ps(_mm256_castps128_ps256(low), high, 1);
                __m256 code =
                    _mm256_add_ps(_mm256_round_ps(_mm256_div_ps(sm, d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
                code = _mm256_min_ps(qmax, _mm256_max_ps(qmin, code)); /* second operands: NaN propagates, as clamp_ */
                const __m256 dq = _mm256_mul_ps(_mm256_sub_ps(code, zp), d);
                _mm_storeu_ps(o + c, quotient_avx2(_mm256_castps256_ps128(dq), s_low));
                _mm_storeu_ps(o + c + 4, quotient_avx2(_mm256_extractf128_ps(dq, 1), s_high));
            }
        }
    }
}

/* The n·rows rows split evenly over the threads. */
typedef void (*rows_fn)(const float *, int64_t, int64_t, const double *, const float *, const float *, int64_t, float,
                        float, int64_t, int64_t, float *);

static void split_over_threads(rows_fn each, const float *w, int64_t rows, int64_t columns, int64_t n,
                               const double *scales, const float *step, const float *zero_point, int64_t group,
                               float qmin, float qmax, int threads, float *out) {
    const int64_t units = n * rows;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < threads; ++t)
        each(w, rows, columns, scales, step, zero_point, group, qmin, qmax, units * t / threads,
             units * (t + 1) / threads, out);
}

__attribute__((target("avx512f"))) void smoothed_quant_avx512(const float *w, int64_t rows, int64_t columns, int64_t n,
                                                              const double *scales, const float *step,
                                                              const float *zero_point, int64_t group, float qmin,
                                                              float qmax, int threads, float *out) {
    split_over_threads(rows_avx512, w, rows, columns, n, scales, step, zero_point, group, qmin, qmax, threads, out);
}

__attribute__((target("avx2,fma"))) void smoothed_quant_avx2(const float *w, int64_t rows, int64_t columns, int64_t n,
                                                            const double *scales, const float *step,
                                                            const float *zero_point, int64_t group, float qmin,
                                                            float qmax, int threads, float *out) {
    split_over_threads(rows_avx2, w, rows, columns, n, scales, step, zero_point, group, qmin, qmax, threads, out);
}

#endif

#include "simd_level.h"
