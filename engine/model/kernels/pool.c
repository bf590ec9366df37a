// A thread pool that never waits for a thread that has not started.
//
// cm_parallel_for(n, fn, ctx) publishes a job of n tasks; the calling thread and any worker that is
// running claim tasks one at a time and the caller returns once every task is done. A worker that is
// descheduled (a shared machine, a CPU quota) simply claims nothing: the others do its share. OpenMP's
// fork/join instead waits at every barrier for every thread, which on an oversubscribed machine cost
// us a scheduler time slice per kernel call (20x slower decode measured with 2 threads on 2 busy cores).
//
// Claiming is one compare-and-swap on a 64-bit word holding (job generation, next task), so a worker
// that wakes late can never run a task of a job that has already been replaced. Idle workers spin
// briefly (steps launch kernels back to back) and then sleep on a futex.

#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef void (*task_fn)(void *ctx, long task);

enum { MAX_THREADS = 64, SPIN_ITERATIONS = 20000 };

static struct {
    _Atomic uint64_t state;  // generation << 32 | next task to claim
    _Atomic uint32_t futex_word;  // bumped on publish, for sleeping workers
    _Atomic long done;
    _Atomic int sleepers;
    task_fn fn;
    void *ctx;
    long n;
    int threads;  // workers + the caller
    pthread_t workers[MAX_THREADS];
} pool = {.threads = 1};

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;  // one job at a time, one resize at a time

static void run_tasks(uint64_t seen) {
    for (;;) {
        const uint32_t gen = (uint32_t)(seen >> 32);
        const long task = (long)(uint32_t)seen;
        task_fn fn = pool.fn;
        void *ctx = pool.ctx;
        const long n = pool.n;
        if (task >= n) return;
        if (atomic_compare_exchange_weak(&pool.state, &seen, ((uint64_t)gen << 32) | (uint64_t)(task + 1))) {
            fn(ctx, task);
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
            seen = atomic_load(&pool.state);
        }
        if ((uint32_t)(seen >> 32) != gen) return;  // a new job: go back and look at it afresh
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint32_t last_gen = (uint32_t)(atomic_load(&pool.state) >> 32);
    for (;;) {
        uint64_t s = atomic_load(&pool.state);
        for (int i = 0; i < SPIN_ITERATIONS && (uint32_t)(s >> 32) == last_gen; i++) {
            _mm_pause();
            s = atomic_load(&pool.state);
        }
        if ((uint32_t)(s >> 32) == last_gen) {
            const uint32_t word = atomic_load(&pool.futex_word);
            atomic_fetch_add(&pool.sleepers, 1);
            if ((uint32_t)(atomic_load(&pool.state) >> 32) == last_gen)
                syscall(SYS_futex, &pool.futex_word, FUTEX_WAIT_PRIVATE, word, NULL, NULL, 0);
            atomic_fetch_sub(&pool.sleepers, 1);
            continue;
        }
        last_gen = (uint32_t)(s >> 32);
        run_tasks(s);
    }
    return NULL;
}

// Grows the pool to n threads in all (the caller counts as one). Workers are never stopped: the pool
// lives as long as the process, like OpenMP's.
void cm_set_threads(int n) {
    pthread_mutex_lock(&pool_lock);
    if (n > MAX_THREADS) n = MAX_THREADS;
    for (; pool.threads < n; pool.threads++)
        pthread_create(&pool.workers[pool.threads - 1], NULL, worker_main, NULL);
    pthread_mutex_unlock(&pool_lock);
}

int cm_get_threads(void) { return pool.threads; }

void cm_parallel_for(long n, task_fn fn, void *ctx) {
    if (n <= 0) return;
    if (pool.threads == 1 || n == 1) {
        for (long t = 0; t < n; t++) fn(ctx, t);
        return;
    }
    pthread_mutex_lock(&pool_lock);
    // Close the previous job before overwriting fn, ctx and n: a worker may still hold that job's state
    // word, and would otherwise claim "its" next task and run it with this job's fn and n (and count it
    // in this job's done, letting the caller return while a task still runs). Closed, the old state
    // word no longer matches, so that worker's claim fails. The closed generation has no tasks.
    const uint64_t gen = (atomic_load(&pool.state) >> 32) + 2;
    atomic_store(&pool.state, ((gen - 1) << 32) | 0xFFFFFFFFu);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    atomic_store(&pool.done, 0);
    const uint64_t start = gen << 32;
    atomic_store(&pool.state, start);  // publishes fn, ctx, n (seq_cst store after plain writes)
    atomic_fetch_add(&pool.futex_word, 1);
    if (atomic_load(&pool.sleepers) > 0)
        syscall(SYS_futex, &pool.futex_word, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
    run_tasks(start);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < n) _mm_pause();
    pthread_mutex_unlock(&pool_lock);
}
