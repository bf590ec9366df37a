// Compiled without ISA flags: safe to call on any x86-64 CPU, before any code of a build has run. Linked
// alone as the probe that picks a build (build.py), and into each build.

// 2: the AVX-512 build runs here (F, BW, VL, DQ, with FMA and F16C); 1: the AVX2 build (AVX2, FMA,
// F16C); 0: neither.
int cm_cpu_level(void) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return avx512 ? 2 : avx2 ? 1 : 0;
}

// The int8 GEMM (gemm_q8.c, "native-int8" kernels, in the AVX-512 build) also needs VNNI.
int cm_cpu_supports_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni");
}
