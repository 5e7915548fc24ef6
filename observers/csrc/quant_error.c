/* Error sums of an integer fake-quantization, in one read of the data and without writing x_hat.
 *
 * The eager path (observers/quantize.py fake_quantize, then observers/metrics.py error_metrics)
 * makes about twenty elementwise passes over a tensor: divide, round, shift, clamp, unshift,
 * rescale, restore, then the error, its square, the reference's and the approximation's squares,
 * a dot product, the clipped mask and the step error. This kernel computes each element's x_hat
 * in registers and folds it into every sum at once. Built with -fopenmp -ffp-contract=off and
 * loaded by observers/kernels.py (plain C, no torch headers; the loop runs on torch's own OpenMP
 * threads).
 *
 * quant_error_<isa>(x, rows, run, groups, scale, zero_point, qmin, qmax, clip_low, clip_high,
 *                   threads, out):
 *   x holds `rows` contiguous runs of `run` fp32 values; run r belongs to group q = r % groups
 *   (the (N, Q, K) layout of observers/granularity.py read as N*Q runs). With s = scale[q] and
 *   zp = zero_point[q] (fp32), every element is quantized with the operations and order of
 *   element_codes + fake_quantize, so x_hat is bit-identical to theirs:
 *     x_hat = (clamp(rint(x / s) + zp, qmin, qmax) - zp) * s    (true division, half to even)
 *   and, with err = x_hat - x, the kernel writes
 *     out[0] = sum err^2        out[1] = sum x^2          out[2] = sum x_hat^2
 *     out[3] = sum x * x_hat    out[4] = clipped count    out[5] = sum (err / s)^2
 *     out[6] = max |err|  (NaN when an err is NaN, as torch's max; an err^2 sum is NaN exactly then)
 *   where an element is clipped when x / s + zp > clip_high or < clip_low (fp32 compares, the
 *   rule of _clip_and_step_sums). Sums are fp32 per vector lane (fused multiply-adds) over at
 *   most FLUSH values of one thread (64 terms per AVX-512 lane, 128 per AVX2 lane), then fp64:
 *   the terms are the eager terms, the order is not, so the sums differ from torch's fp32 sums
 *   by a few ulps; the count and the max are exact.
 *   Work: each run is cut into even pieces of at most PIECE values, thread t takes a contiguous
 *   share of the pieces (so both many short runs and a few long ones spread over the threads),
 *   and the per-thread totals are added in thread order (deterministic for a thread count).
 * simd_level() (simd_level.h) says which variants this CPU runs.
 */
#include <math.h>
#include <stdint.h>

#define PIECE 1024 /* longest piece of a run that is one unit of work */
#define FLUSH 1024 /* most values summed in fp32 lanes before the lanes are added into fp64 */

/* One thread's totals; also the kernel's result before it is written to out. */
struct totals {
    double err2, x2, xh2, dot, step2;
    int64_t clipped;
    float max_err;
};

/* What every piece of one call shares. */
struct layout {
    const float *x, *scale, *zero_point;
    int64_t run, groups, piece, pieces;
    float qmin, qmax, clip_low, clip_high;
};

static struct layout make_layout(const float *x, int64_t run, int64_t groups, const float *scale,
                                 const float *zero_point, float qmin, float qmax, float clip_low, float clip_high) {
    const int64_t cuts = (run + PIECE - 1) / PIECE;
    const int64_t piece = ((run + cuts - 1) / cuts + 15) / 16 * 16; /* even pieces, whole vectors */
    const struct layout l = {x, scale, zero_point, run, groups, piece, (run + piece - 1) / piece,
                             qmin, qmax, clip_low, clip_high};
    return l;
}

/* Add the threads' totals in thread order and write out[0..6]. */
static void finish(const struct totals *parts, int threads, double *out) {
    struct totals t = {0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0f};
    for (int i = 0; i < threads; ++i) {
        t.err2 += parts[i].err2;
        t.x2 += parts[i].x2;
        t.xh2 += parts[i].xh2;
        t.dot += parts[i].dot;
        t.step2 += parts[i].step2;
        t.clipped += parts[i].clipped;
        t.max_err = parts[i].max_err > t.max_err ? parts[i].max_err : t.max_err;
    }
    out[0] = t.err2;
    out[1] = t.x2;
    out[2] = t.xh2;
    out[3] = t.dot;
    out[4] = (double)t.clipped;
    out[5] = t.step2;
    out[6] = isnan(t.err2) ? NAN : t.max_err;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* ---------------------------------------------------------------- AVX-512 */

struct lanes_avx512 {
    __m512 err2, x2, xh2, dot, step2, max_err;
};

__attribute__((target("avx512f"), always_inline)) static inline void
element_avx512(struct lanes_avx512 *a, int64_t *clipped, __m512 v, __mmask16 keep, __m512 s, __m512 zp, __m512 qmin,
               __m512 qmax, __m512 clip_low, __m512 clip_high) {
    const __m512 scaled = _mm512_div_ps(v, s);
    const __m512 shifted = _mm512_add_ps(scaled, zp);
    const __mmask16 out_of_range =
        _mm512_cmp_ps_mask(shifted, clip_high, _CMP_GT_OQ) | _mm512_cmp_ps_mask(shifted, clip_low, _CMP_LT_OQ);
    *clipped += __builtin_popcount((unsigned)(out_of_range & keep));
    __m512 code = _mm512_add_ps(_mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
    code = _mm512_min_ps(qmax, _mm512_max_ps(qmin, code)); /* second operands: NaN propagates, as clamp_ */
    const __m512 x_hat = _mm512_maskz_mov_ps(keep, _mm512_mul_ps(_mm512_sub_ps(code, zp), s));
    const __m512 err = _mm512_sub_ps(x_hat, v);
    const __m512 step = _mm512_maskz_div_ps(keep, err, s);
    a->max_err = _mm512_max_ps(a->max_err, _mm512_abs_ps(err));
    a->err2 = _mm512_fmadd_ps(err, err, a->err2);
    a->x2 = _mm512_fmadd_ps(v, v, a->x2);
    a->xh2 = _mm512_fmadd_ps(x_hat, x_hat, a->xh2);
    a->dot = _mm512_fmadd_ps(v, x_hat, a->dot);
    a->step2 = _mm512_fmadd_ps(step, step, a->step2);
}

__attribute__((target("avx512f"))) static double widen_sum_avx512(__m512 v) {
    const __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return _mm512_reduce_add_pd(_mm512_add_pd(low, high));
}

__attribute__((target("avx512f"))) static void flush_avx512(struct lanes_avx512 *a, struct totals *t) {
    t->err2 += widen_sum_avx512(a->err2);
    t->x2 += widen_sum_avx512(a->x2);
    t->xh2 += widen_sum_avx512(a->xh2);
    t->dot += widen_sum_avx512(a->dot);
    t->step2 += widen_sum_avx512(a->step2);
    const float m = _mm512_reduce_max_ps(a->max_err);
    t->max_err = m > t->max_err ? m : t->max_err;
    a->err2 = a->x2 = a->xh2 = a->dot = a->step2 = a->max_err = _mm512_setzero_ps();
}

/* Pieces [first, last) of the call into *t. */
__attribute__((target("avx512f"))) static void pieces_avx512(const struct layout *l, int64_t first, int64_t last,
                                                             struct totals *t) {
    const __m512 qmin = _mm512_set1_ps(l->qmin), qmax = _mm512_set1_ps(l->qmax);
    const __m512 clip_low = _mm512_set1_ps(l->clip_low), clip_high = _mm512_set1_ps(l->clip_high);
    struct lanes_avx512 a;
    a.err2 = a.x2 = a.xh2 = a.dot = a.step2 = a.max_err = _mm512_setzero_ps();
    int64_t pending = 0;
    for (int64_t u = first; u < last; ++u) {
        const int64_t r = u / l->pieces, start = (u % l->pieces) * l->piece;
        const int64_t length = l->run - start < l->piece ? l->run - start : l->piece;
        const float *p = l->x + r * l->run + start;
        if (pending + length > FLUSH) {
            flush_avx512(&a, t);
            pending = 0;
        }
        const __m512 s = _mm512_set1_ps(l->scale[r % l->groups]), zp = _mm512_set1_ps(l->zero_point[r % l->groups]);
        int64_t i = 0;
        for (; i + 16 <= length; i += 16)
            element_avx512(&a, &t->clipped, _mm512_loadu_ps(p + i), 0xFFFF, s, zp, qmin, qmax, clip_low, clip_high);
        if (i < length) {
            const __mmask16 tail = (__mmask16)((1u << (length - i)) - 1u);
            element_avx512(&a, &t->clipped, _mm512_maskz_loadu_ps(tail, p + i), tail, s, zp, qmin, qmax, clip_low,
                           clip_high);
        }
        pending += length;
    }
    flush_avx512(&a, t);
}

/* The pieces of the work split over the threads, each thread's totals kept apart and added in
 * thread order (deterministic for a thread count); `pieces` is the ISA's loop over pieces. */
typedef void (*pieces_fn)(const struct layout *, int64_t, int64_t, struct totals *);

static void split_over_threads(pieces_fn pieces, const struct layout *l, int64_t rows, int threads, double *out) {
    const int64_t units = rows * l->pieces;
    struct totals parts[threads];
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < threads; ++t) {
        const struct totals zero = {0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0f};
        parts[t] = zero;
        pieces(l, units * t / threads, units * (t + 1) / threads, &parts[t]);
    }
    finish(parts, threads, out);
}

__attribute__((target("avx512f"))) void quant_error_avx512(const float *x, int64_t rows, int64_t run, int64_t groups,
                                                           const float *scale, const float *zero_point, float qmin,
                                                           float qmax, float clip_low, float clip_high, int threads,
                                                           double *out) {
    const struct layout l = make_layout(x, run, groups, scale, zero_point, qmin, qmax, clip_low, clip_high);
    split_over_threads(pieces_avx512, &l, rows, threads, out);
}

/* ---------------------------------------------------------------- AVX2 */

struct lanes_avx2 {
    __m256 err2, x2, xh2, dot, step2, max_err;
};

__attribute__((target("avx2,fma"), always_inline)) static inline void
element_avx2(struct lanes_avx2 *a, int64_t *clipped, __m256 v, __m256 keep, __m256 s, __m256 zp, __m256 qmin,
             __m256 qmax, __m256 clip_low, __m256 clip_high) {
    const __m256 scaled = _mm256_div_ps(v, s);
    const __m256 shifted = _mm256_add_ps(scaled, zp);
    const __m256 out_of_range =
        _mm256_or_ps(_mm256_cmp_ps(shifted, clip_high, _CMP_GT_OQ), _mm256_cmp_ps(shifted, clip_low, _CMP_LT_OQ));
    *clipped += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_and_ps(out_of_range, keep)));
    __m256 code = _mm256_add_ps(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
    code = _mm256_min_ps(qmax, _mm256_max_ps(qmin, code)); /* second operands: NaN propagates, as clamp_ */
    const __m256 x_hat = _mm256_and_ps(keep, _mm256_mul_ps(_mm256_sub_ps(code, zp), s));
    const __m256 err = _mm256_sub_ps(x_hat, v);
    const __m256 step = _mm256_and_ps(keep, _mm256_div_ps(err, s));
    a->max_err = _mm256_max_ps(a->max_err, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), err));
    a->err2 = _mm256_fmadd_ps(err, err, a->err2);
    a->x2 = _mm256_fmadd_ps(v, v, a->x2);
    a->xh2 = _mm256_fmadd_ps(x_hat, x_hat, a->xh2);
    a->dot = _mm256_fmadd_ps(v, x_hat, a->dot);
    a->step2 = _mm256_fmadd_ps(step, step, a->step2);
}

__attribute__((target("avx2,fma"))) static double widen_sum_avx2(__m256 v) {
    const __m256d both = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    const __m128d half = _mm_add_pd(_mm256_castpd256_pd128(both), _mm256_extractf128_pd(both, 1));
    return _mm_cvtsd_f64(_mm_add_sd(half, _mm_unpackhi_pd(half, half)));
}

__attribute__((target("avx2,fma"))) static void flush_avx2(struct lanes_avx2 *a, struct totals *t) {
    t->err2 += widen_sum_avx2(a->err2);
    t->x2 += widen_sum_avx2(a->x2);
    t->xh2 += widen_sum_avx2(a->xh2);
    t->dot += widen_sum_avx2(a->dot);
    t->step2 += widen_sum_avx2(a->step2);
    float lanes[8];
    _mm256_storeu_ps(lanes, a->max_err);
    for (int j = 0; j < 8; ++j) t->max_err = lanes[j] > t->max_err ? lanes[j] : t->max_err;
    a->err2 = a->x2 = a->xh2 = a->dot = a->step2 = a->max_err = _mm256_setzero_ps();
}

__attribute__((target("avx2,fma"))) static void pieces_avx2(const struct layout *l, int64_t first, int64_t last,
                                                           struct totals *t) {
    const __m256 qmin = _mm256_set1_ps(l->qmin), qmax = _mm256_set1_ps(l->qmax);
    const __m256 clip_low = _mm256_set1_ps(l->clip_low), clip_high = _mm256_set1_ps(l->clip_high);
    const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    struct lanes_avx2 a;
    a.err2 = a.x2 = a.xh2 = a.dot = a.step2 = a.max_err = _mm256_setzero_ps();
    int64_t pending = 0;
    for (int64_t u = first; u < last; ++u) {
        const int64_t r = u / l->pieces, start = (u % l->pieces) * l->piece;
        const int64_t length = l->run - start < l->piece ? l->run - start : l->piece;
        const float *p = l->x + r * l->run + start;
        if (pending + length > FLUSH) {
            flush_avx2(&a, t);
            pending = 0;
        }
        const __m256 s = _mm256_set1_ps(l->scale[r % l->groups]), zp = _mm256_set1_ps(l->zero_point[r % l->groups]);
        int64_t i = 0;
        for (; i + 8 <= length; i += 8)
            element_avx2(&a, &t->clipped, _mm256_loadu_ps(p + i), all, s, zp, qmin, qmax, clip_low, clip_high);
        if (i < length) {
            const __m256i tail =
                _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(length - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            element_avx2(&a, &t->clipped, _mm256_maskload_ps(p + i, tail), _mm256_castsi256_ps(tail), s, zp, qmin,
                         qmax, clip_low, clip_high);
        }
        pending += length;
    }
    flush_avx2(&a, t);
}

__attribute__((target("avx2,fma"))) void quant_error_avx2(const float *x, int64_t rows, int64_t run, int64_t groups,
                                                         const float *scale, const float *zero_point, float qmin,
                                                         float qmax, float clip_low, float clip_high, int threads,
                                                         double *out) {
    const struct layout l = make_layout(x, run, groups, scale, zero_point, qmin, qmax, clip_low, clip_high);
    split_over_threads(pieces_avx2, &l, rows, threads, out);
}

#endif

#include "simd_level.h"
