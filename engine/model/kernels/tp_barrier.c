// A barrier for tensor-parallel ranks (processes) over one shared-memory word pair.
//
// cm_tp_arrive() counts this rank in and returns the generation to wait out; the last rank to arrive
// resets the count and bumps the generation (sense reversal: a rank can never arrive at the next barrier
// before everyone has left this one). cm_tp_wait() spins briefly — ranks usually arrive within
// microseconds of each other — and then sleeps on a futex, so a rank waiting on a descheduled peer on a
// shared machine gives its core away instead of burning it. The wait returns after timeout_ms so the
// caller can check that its peers are still alive and wait again: a dead rank never hangs the others.
//
// The futex is not FUTEX_PRIVATE: the word lives in memory shared between processes.

#define _GNU_SOURCE
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    _Atomic uint32_t arrived;
    char pad0[60];
    _Atomic uint32_t generation;
    _Atomic uint32_t sleepers;
    char pad1[56];
} tp_barrier;

enum { SPIN_NS = 100 * 1000 };

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

uint32_t cm_tp_arrive(void *shared, int world) {
    tp_barrier *b = shared;
    const uint32_t gen = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) + 1 == (uint32_t)world) {
        atomic_store(&b->arrived, 0);
        atomic_store(&b->generation, gen + 1);
        if (atomic_load(&b->sleepers))
            syscall(SYS_futex, &b->generation, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
    return gen;
}

// 0 once the generation moved past gen; 1 if timeout_ms passed first.
int cm_tp_wait(void *shared, uint32_t gen, int timeout_ms) {
    tp_barrier *b = shared;
    const long start = now_ns();
    while (now_ns() - start < SPIN_NS) {
        for (int i = 0; i < 64; i++) {
            if (atomic_load(&b->generation) != gen) return 0;
            _mm_pause();
        }
    }
    const long deadline = start + (long)timeout_ms * 1000000L;
    while (atomic_load(&b->generation) == gen) {
        const long left = deadline - now_ns();
        if (left <= 0) return 1;
        struct timespec ts = {.tv_sec = left / 1000000000L, .tv_nsec = left % 1000000000L};
        // Counted as a sleeper before the futex re-checks the word: the last arriver either sees the
        // count and wakes us, or bumped the generation first and the futex returns at once.
        atomic_fetch_add(&b->sleepers, 1);
        syscall(SYS_futex, &b->generation, FUTEX_WAIT, gen, &ts, NULL, 0);
        atomic_fetch_sub(&b->sleepers, 1);
    }
    return 0;
}
