// See pool.c: run fn(ctx, 0..n-1) on the calling thread and the pool's workers.
#pragma once
void cm_parallel_for(long n, void (*fn)(void *ctx, long task), void *ctx);
int cm_get_threads(void);
