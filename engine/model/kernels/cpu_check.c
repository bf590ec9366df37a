// Compiled without AVX-512 flags: safe to call on any x86-64 CPU before touching the other objects.
int cm_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
}

// The int8 GEMM (gemm_q8.c, "native-int8" kernels) also needs VNNI.
int cm_cpu_supports_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni");
}
