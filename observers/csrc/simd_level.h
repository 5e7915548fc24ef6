/* simd_level(), exported by every kernel library: which of its variants this CPU runs.
 * 2 = AVX-512 (and AVX2), 1 = AVX2, 0 = none. FMA is required for both (the AVX2 variants are
 * built with target("avx2,fma"), and some kernels fuse a multiply-add to round as torch does);
 * every CPU with AVX2 so far has it. Included at the end of each csrc/<name>.c;
 * observers/kernels.py hashes this header with the source, so a change rebuilds every kernel. */
#if defined(__x86_64__) || defined(__i386__)
int simd_level(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
}
#else
int simd_level(void) { return 0; }
#endif
