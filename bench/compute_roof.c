// This machine's compute roof, measured: every thread issues independent AVX-512 instructions with no
// memory traffic, float32 FMAs (2 flops per lane) and then int8 VPDPBUSD (64 multiply-adds, 128 ops,
// per instruction). bench_engine.py compiles it with gcc and reports its kernels' share of these.
//
//   gcc -O3 -mavx512f -mavx512vnni -pthread bench/compute_roof.c -o roof && ./roof THREADS
// prints: {"float32_gflops": ..., "int8_gops": ...}

#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

// 12 independent chains cover the FMA latency on two pipes; -O3 keeps them in registers (at -O2 gcc left
// them in memory and measured the store-to-load latency instead).
enum { CHAINS = 12, ITERATIONS = 100 * 1000 * 1000 };

static volatile float float_sink;
static volatile int int_sink;

static void *fma_loop(void *arg) {
    (void)arg;
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
    for (long i = 0; i < ITERATIONS; i++)
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    for (int c = 1; c < CHAINS; c++) acc[0] = _mm512_add_ps(acc[0], acc[c]);
    float_sink = _mm512_reduce_add_ps(acc[0]);
    return NULL;
}

static void *dpbusd_loop(void *arg) {
    (void)arg;
    __m512i acc[CHAINS];
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
    for (long i = 0; i < ITERATIONS; i++)
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
    for (int c = 1; c < CHAINS; c++) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
    int_sink = _mm512_reduce_add_epi32(acc[0]);
    return NULL;
}

// Operations per second with `threads` threads each running `loop` once.
static double rate(void *(*loop)(void *), int threads, double ops_per_instruction) {
    pthread_t ids[64];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int t = 0; t < threads; t++) pthread_create(&ids[t], NULL, loop, NULL);
    for (int t = 0; t < threads; t++) pthread_join(ids[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return threads * (double)ITERATIONS * CHAINS * ops_per_instruction / seconds;
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (threads < 1 || threads > 64) return 2;
    rate(fma_loop, threads, 32.0);  // warm-up: clocks settle
    const double flops = rate(fma_loop, threads, 32.0);
    const double int_ops = rate(dpbusd_loop, threads, 128.0);
    printf("{\"float32_gflops\": %.1f, \"int8_gops\": %.1f}\n", flops / 1e9, int_ops / 1e9);
    return 0;
}
