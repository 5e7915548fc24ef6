/* Per-row histograms of fp32 values in one read: the binning step of the histogram observers.
 *
 * Eager torch bins a batch chunk by chunk as |x|, addcmul, clamp, a cast and bincount over an
 * int32 index buffer: five passes, the bincount single-threaded. This kernel reads each value once,
 * computes 16 (AVX-512) or 8 (AVX2) bin indices at a time and counts them with scalar adds. Built
 * with -fopenmp and loaded at run time by observers/hist_kernel.py (plain C, no torch headers);
 * the loops run on torch's own OpenMP threads (libgomp is already loaded by torch).
 *
 * row_histogram_<isa>(x, rows, n, bins, scale, shift, absolute, threads, counts): for each row
 * r < rows and each value v of x[r*n .. r*n + n - 1] (|v| when absolute), adds one to
 * counts[r*bins + b] with b = (int32) min(max(fma(v, scale[r], shift[r]), 0), bins - 1): what the
 * eager path's addcmul (it rounds once, like fma; the library is built with -ffp-contract=off, so
 * only the explicit fma fuses), clamp and cast compute, so both give the same counts. Returns 0,
 * or -1 when a thread's scratch histogram cannot be allocated (the counts are then incomplete and
 * the caller must bin eagerly). MAX_COPIES * (bins + 48) must fit in an int32 (the caller checks).
 * simd_level() (simd_level.h) says which variants this CPU runs.
 *
 * Work split: with at least as many rows as threads each thread takes whole rows (each row its
 * own counts); with fewer rows every row is cut into PIECES_PER_THREAD pieces per thread. Pieces
 * are handed out as threads free up (schedule dynamic), so a thread whose core another process
 * holds delays the call by one piece, not by its fixed share. A thread counts into uint32 scratch
 * histograms, `copies` of them interleaved lane by lane, so a run of equal indices (a spike of
 * zeros, or most values in a few central bins) does not wait on the previous increment of the
 * same counter (measured with 4 copies instead of 1: 40 % less time on a batch of 50 % zeros,
 * 55 % less on the growing benchmark's last batch, 90 % of it in one bin; 8 copies gained
 * nothing more). The copies are summed into the row's int64 counts when the thread moves to
 * another row and at the end (atomically when other threads count pieces of the same row: bins
 * adds per thread).
 *
 * Prefetch: the slice loops ask for the values PREFETCH_AHEAD floats (4 KiB) ahead. The counting
 * (about 40 instructions per 16 values, most of them scalar) fills the out-of-order window, so the
 * loads of the next values were issued late and reading and counting took turns instead of
 * overlapping. Measured on a Xeon (AVX-512), the growing benchmark's 8 batches of 4M values, each
 * read once just before as the observer's min/max pass does: one thread 28.3 -> 22.3 ms, two
 * threads 14.5 -> 11.5 ms (medians of 9; the AVX2 variant alike, the same counts), where reading
 * them and computing the bins alone takes 12.5 ms and counting an index buffer held in L1 12 ms.
 * 512 to 2048 floats ahead measured alike; 8 copies instead of 4 gained nothing. Counting the row's
 * most frequent bin in a vector register (the others compressed into a buffer) made the batches
 * with one dominant bin 30-40 % quicker but the 8 batches only 5-12 % (2-5 % of the observer's
 * time), so it is not done.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define MAX_COPIES 4
#define SCRATCH_BYTES (128 * 1024) /* more copies only while they fit in half of this (4 of 4200 bins: 66 KiB) */
#define MAX_SLICE ((int64_t)1 << 30) /* values counted between flushes: a uint32 counter cannot overflow */
#define PIECES_PER_THREAD 4 /* rows split over threads are cut this much finer and taken as threads free up */
#define PREFETCH_AHEAD 1024 /* floats: how far ahead of the counting the values are asked for (see above) */

/* The row's map to bin positions, the last bin as a float, the |v| mask (all ones when signed)
 * and the scratch layout: what a slice function needs besides the values. */
typedef struct {
    float scale, shift, top;
    int32_t sign_mask, copies, stride;
} binning;

typedef void (*bin_fn)(const float *, int64_t, const binning *, uint32_t *);

/* Copies for `count` values counted between flushes: each copy costs a zeroing and a summing of
 * its counters per flush, so short rows (per-channel statistics) take fewer. */
static int copies_for(int64_t count, int64_t stride) {
    int copies = 1;
    while (copies < MAX_COPIES && copies * 2 * stride * 4 <= SCRATCH_BYTES && count >= copies * 16 * stride) copies *= 2;
    return copies;
}

/* Counters from one copy to the next: at least bins, padded so that the same bin of two copies
 * never sits at the same offset within 4 KiB (a load then waits behind the other copy's store:
 * "4K aliasing", which measured 1.6x slower when most values fall in one bin). */
static int64_t copy_stride(int64_t bins) {
    int64_t stride = (bins + 15) / 16 * 16 + 16;
    return stride % 512 == 0 ? stride + 16 : stride;
}

/* counts[b] += the copies' counters of bin b, zeroing them for the next row; atomically when
 * other threads add pieces of the same row. */
static void flush(uint32_t *scratch, int copies, int64_t stride, int64_t bins, int64_t *counts, int shared) {
    for (int64_t b = 0; b < bins; ++b) {
        int64_t total = 0;
        for (int c = 0; c < copies; ++c) {
            total += scratch[c * stride + b];
            scratch[c * stride + b] = 0;
        }
        if (total == 0) continue;
        if (shared) {
#pragma omp atomic
            counts[b] += total;
        } else {
            counts[b] += total;
        }
    }
}

/* Ask for the cache line PREFETCH_AHEAD floats after p. A prefetch never faults, so near the end
 * of the values it may name memory past them; the address is formed as an integer, not as a
 * pointer beyond the array. */
static inline void prefetch_ahead(const float *p) {
    _mm_prefetch((const char *)((uintptr_t)p + PREFETCH_AHEAD * sizeof(float)), _MM_HINT_T0);
}

/* Two bin indices packed in 64 bits (the lower lane in the low half) count once each. The
 * indices leave the vector register through 64-bit moves: storing the vector and reloading the
 * lanes measured 2-3x slower (each reload waits behind the counter stores). */
static inline void count_pair(uint64_t pair, uint32_t *scratch) {
    scratch[(uint32_t)pair]++;
    scratch[pair >> 32]++;
}

__attribute__((target("avx512f"))) static inline void count_quarter(__m128i q, uint32_t *scratch) {
    count_pair((uint64_t)_mm_cvtsi128_si64(q), scratch);
    count_pair((uint64_t)_mm_extract_epi64(q, 1), scratch);
}

__attribute__((target("avx512f"))) static inline void count16(__m512i index, uint32_t *scratch) {
    count_quarter(_mm512_castsi512_si128(index), scratch);
    count_quarter(_mm512_extracti32x4_epi32(index, 1), scratch);
    count_quarter(_mm512_extracti32x4_epi32(index, 2), scratch);
    count_quarter(_mm512_extracti32x4_epi32(index, 3), scratch);
}

/* Scratch index of 16 values: the bin plus (lane % copies) * stride. */
__attribute__((target("avx512f"))) static inline __m512i index16(__m512 v, const binning *how, __m512i copy_offset) {
    v = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(how->sign_mask)));
    __m512 position = _mm512_fmadd_ps(v, _mm512_set1_ps(how->scale), _mm512_set1_ps(how->shift));
    position = _mm512_min_ps(_mm512_max_ps(position, _mm512_setzero_ps()), _mm512_set1_ps(how->top));
    return _mm512_add_epi32(_mm512_cvttps_epi32(position), copy_offset);
}

__attribute__((target("avx512f"))) static void bin_slice_avx512(const float *p, int64_t count, const binning *how,
                                                                uint32_t *scratch) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i copy_offset =
        _mm512_mullo_epi32(_mm512_and_si512(lanes, _mm512_set1_epi32(how->copies - 1)), _mm512_set1_epi32(how->stride));
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {
        prefetch_ahead(p + i);
        prefetch_ahead(p + i + 16);
        __m512i first = index16(_mm512_loadu_ps(p + i), how, copy_offset);
        __m512i second = index16(_mm512_loadu_ps(p + i + 16), how, copy_offset);
        count16(first, scratch);
        count16(second, scratch);
    }
    for (; i < count; i += 16) {
        int64_t left = count - i < 16 ? count - i : 16;
        __m512 v = _mm512_maskz_loadu_ps((__mmask16)((1u << left) - 1), p + i);
        int32_t tail[16];
        _mm512_storeu_si512((void *)tail, index16(v, how, copy_offset));
        for (int64_t j = 0; j < left; ++j) scratch[tail[j]]++;
    }
}

__attribute__((target("avx2,fma"))) static inline void count8(__m256i index, uint32_t *scratch) {
    __m128i low = _mm256_castsi256_si128(index), high = _mm256_extracti128_si256(index, 1);
    count_pair((uint64_t)_mm_cvtsi128_si64(low), scratch);
    count_pair((uint64_t)_mm_extract_epi64(low, 1), scratch);
    count_pair((uint64_t)_mm_cvtsi128_si64(high), scratch);
    count_pair((uint64_t)_mm_extract_epi64(high, 1), scratch);
}

__attribute__((target("avx2,fma"))) static inline __m256i index8(__m256 v, const binning *how, __m256i copy_offset) {
    v = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(how->sign_mask)));
    __m256 position = _mm256_fmadd_ps(v, _mm256_set1_ps(how->scale), _mm256_set1_ps(how->shift));
    position = _mm256_min_ps(_mm256_max_ps(position, _mm256_setzero_ps()), _mm256_set1_ps(how->top));
    return _mm256_add_epi32(_mm256_cvttps_epi32(position), copy_offset);
}

__attribute__((target("avx2,fma"))) static void bin_slice_avx2(const float *p, int64_t count, const binning *how,
                                                              uint32_t *scratch) {
    const __m256i lanes = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const __m256i copy_offset =
        _mm256_mullo_epi32(_mm256_and_si256(lanes, _mm256_set1_epi32(how->copies - 1)), _mm256_set1_epi32(how->stride));
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
        prefetch_ahead(p + i);
        __m256i first = index8(_mm256_loadu_ps(p + i), how, copy_offset);
        __m256i second = index8(_mm256_loadu_ps(p + i + 8), how, copy_offset);
        count8(first, scratch);
        count8(second, scratch);
    }
    for (; i < count; i += 8) {
        int64_t left = count - i < 8 ? count - i : 8;
        __m256 v = _mm256_maskload_ps(p + i, _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)left), lanes));
        int32_t tail[8];
        _mm256_storeu_si256((__m256i *)tail, index8(v, how, copy_offset));
        for (int64_t j = 0; j < left; ++j) scratch[tail[j]]++;
    }
}

static int row_histogram(bin_fn bin_slice, const float *x, int64_t rows, int64_t n, int64_t bins,
                         const float *scale, const float *shift, int absolute, int threads, int64_t *counts) {
    const int64_t wanted = rows >= threads ? 1 : (int64_t)threads * PIECES_PER_THREAD;
    int64_t per_piece = (n + wanted - 1) / wanted;
    per_piece = per_piece < 1 ? 1 : per_piece < MAX_SLICE ? per_piece : MAX_SLICE;
    const int64_t pieces = (n + per_piece - 1) / per_piece, items = rows * pieces;
    const int64_t stride = copy_stride(bins);
    const int copies = copies_for(rows >= threads ? n : rows * n / threads, stride);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        uint32_t *scratch = calloc((size_t)(copies * stride), sizeof *scratch);
        int64_t held_row = -1, held = 0; /* the row the scratch counts, and how many values */
        failed = scratch == NULL;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t item = 0; item < items; ++item) {
            if (scratch == NULL) continue;
            const int64_t r = item / pieces, first = (item % pieces) * per_piece;
            const int64_t count = first + per_piece < n ? per_piece : n - first;
            if (r != held_row || held + count > MAX_SLICE) {
                if (held_row >= 0) flush(scratch, copies, stride, bins, counts + held_row * bins, pieces > 1);
                held_row = r;
                held = 0;
            }
            const binning how = {scale[r], shift[r], (float)(bins - 1), absolute ? 0x7fffffff : -1, copies, (int32_t)stride};
            bin_slice(x + r * n + first, count, &how, scratch);
            held += count;
        }
        if (held_row >= 0) flush(scratch, copies, stride, bins, counts + held_row * bins, pieces > 1);
        free(scratch);
    }
    return failed ? -1 : 0;
}

int row_histogram_avx512(const float *x, int64_t rows, int64_t n, int64_t bins, const float *scale,
                         const float *shift, int absolute, int threads, int64_t *counts) {
    return row_histogram(bin_slice_avx512, x, rows, n, bins, scale, shift, absolute, threads, counts);
}

int row_histogram_avx2(const float *x, int64_t rows, int64_t n, int64_t bins, const float *scale,
                       const float *shift, int absolute, int threads, int64_t *counts) {
    return row_histogram(bin_slice_avx2, x, rows, n, bins, scale, shift, absolute, threads, counts);
}

#endif

#include "simd_level.h"
