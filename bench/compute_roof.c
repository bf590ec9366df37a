// This machine's compute roof, measured: every thread issues independent AVX-512 instructions with no
// memory traffic, float32 FMAs (2 flops per lane) and then int8 VPDPBUSD (64 multiply-adds, 128 ops,
// per instruction). And its memory roof: the threads read disjoint halves of a 256 MiB buffer (far beyond
// the caches) with vector loads, the best of 10 passes (short passes: on a shared box the best is the least disturbed). bench_engine.py compiles it with gcc and reports
// its kernels' share of these (a one-stream decode step reads every weight once: bandwidth-bound).
//
//   gcc -O3 -mavx512f -mavx512vnni -pthread bench/compute_roof.c -o roof && ./roof THREADS
// prints: {"float32_gflops": ..., "int8_gops": ..., "read_gbps": ...}

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

enum { READ_BYTES = 1 << 28, READ_PASSES = 10 };
static float *read_buffer;
static int read_threads;
static volatile float read_sink;

static void *read_loop(void *arg) {
    const long share = READ_BYTES / sizeof(float) / read_threads, first = (long)arg * share;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (long i = first; i < first + share; i += 64)
        for (int c = 0; c < 4; c++) acc[c] = _mm512_add_ps(acc[c], _mm512_load_ps(read_buffer + i + 16 * c));
    read_sink = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    return NULL;
}

// Bytes per second read by `threads` threads, the best pass.
static double read_rate(int threads) {
    read_threads = threads;
    read_buffer = aligned_alloc(64, READ_BYTES);
    for (long i = 0; i < READ_BYTES / (long)sizeof(float); i++) read_buffer[i] = 1.0f;  // resident
    double best = 0.0;
    for (int pass = 0; pass < READ_PASSES; pass++) {
        pthread_t ids[64];
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (long t = 0; t < threads; t++) pthread_create(&ids[t], NULL, read_loop, (void *)t);
        for (int t = 0; t < threads; t++) pthread_join(ids[t], NULL);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const double seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        if (READ_BYTES / seconds > best) best = READ_BYTES / seconds;
    }
    free(read_buffer);
    return best;
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
    const double bytes = read_rate(threads);
    printf("{\"float32_gflops\": %.1f, \"int8_gops\": %.1f, \"read_gbps\": %.1f}\n", flops / 1e9, int_ops / 1e9,
           bytes / 1e9);
    return 0;
}
