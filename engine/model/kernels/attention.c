// Attention over the paged KV cache and the small per-token kernels around it (RMSNorm, RoPE, SwiGLU).
//
// KV cache, per layer (see cpu_runner.py), IEEE float16 (converted to float32 as it is loaded):
//   K: [num_blocks, num_kv_heads, head_dim, block_size]  keys of a block transposed, so the scores of a
//      whole block are head_dim broadcast-FMAs into one vector, with no horizontal sums;
//   V: [num_blocks, block_size, num_kv_heads, head_dim]  one value row per position.
// A token at position `pos` attends to positions 0..pos (pos-window+1..pos on a sliding-window layer),
// found through its sequence's block table; the
// K/V of the current step are written into the cache before this runs, so a prefill chunk attends to
// the cached prefix and causally to itself in one pass. Work items are (token, kv head): the query
// heads of a GQA group share every K/V load. Each item is computed alone, in a fixed order, so results
// do not depend on batch composition or chunking.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"
#include "simd16.h"

// e^x with x clamped to [-87, 88]: Cody-Waite reduction, degree-6 polynomial, times 2^n.
// Relative error ~2 ulp.
static inline vf16 vf_exp(vf16 x) {
    x = vf_max(vf_min(x, vf_set1(88.0f)), vf_set1(-87.0f));
    vf16 n = vf_round(vf_mul(x, vf_set1(1.44269504f)));
    vf16 r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf16 p = vf_set1(1.0f / 720);
    p = vf_fmadd(p, r, vf_set1(1.0f / 120));
    p = vf_fmadd(p, r, vf_set1(1.0f / 24));
    p = vf_fmadd(p, r, vf_set1(1.0f / 6));
    p = vf_fmadd(p, r, vf_set1(0.5f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    return vf_scale2(p, n);
}

static inline lanes16 tail_mask(int n) { return n >= 16 ? (lanes16)0xFFFF : (lanes16)((1u << n) - 1); }

enum { MAX_GROUP = 16, MAX_VEC = 16 };  // query heads per kv head; head_dim / 16
// Value accumulators one pass keeps (AVX-512 has 32 registers; the scores and values need a few).
enum { MAX_ACCUMULATORS = 16 };
// Segments ahead whose K/V are prefetched while one is computed. One segment's work is shorter than a
// DRAM round trip: fetching 4 ahead made 32-stream steps at 1k-token contexts ~15 % faster than 1 ahead.
enum { PREFETCH_AHEAD = 4 };

typedef struct {
    const float *q;
    const uint16_t *k_cache, *v_cache;  // float16
    const int *token_seq, *token_pos, *block_tables;
    float *out;
    long q_stride;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_len;
    int window;  // sliding window: a token sees the last `window` positions (itself included); 0: all
    float scale;
} attention_job;

// Per-thread scores buffer, grown as needed and kept: attention runs every layer of every step.
static __thread float *scores_buf;
static __thread size_t scores_cap;

static float *scores_for(size_t floats) {
    if (floats > scores_cap) {
        free(scores_buf);
        scores_cap = floats * 2;
        scores_buf = aligned_alloc(64, sizeof(float) * scores_cap);
    }
    return scores_buf;
}

// Token t = item / num_kv_heads, kv head g = item % num_kv_heads, with its G query heads. Always
// inlined into callers with constant G and nv (head_dim / 16), so the per-head accumulators live in
// registers; with runtime values they would sit on the stack and every FMA would wait on memory.
static inline __attribute__((always_inline)) void attend(const attention_job *jb, long item, const int G,
                                                         const int nv) {
    const float *q = jb->q;
    const uint16_t *k_cache = jb->k_cache, *v_cache = jb->v_cache;
    const long q_stride = jb->q_stride;
    const int num_heads = jb->num_heads, num_kv_heads = jb->num_kv_heads, head_dim = jb->head_dim;
    const int block_size = jb->block_size;
    const float scale = jb->scale;
    const int seg_len = block_size < 16 ? block_size : 16;
    const long block_elems = (long)num_kv_heads * head_dim * block_size;  // K and V alike
    const long v_row = (long)num_kv_heads * head_dim;
    float *scores = scores_for((size_t)16 * G * ((jb->max_len + seg_len - 1) / seg_len + 1));
    float *out = jb->out;
    const int *token_seq = jb->token_seq, *token_pos = jb->token_pos;
    const int *block_tables = jb->block_tables;
    const int max_blocks = jb->max_blocks;
    const int t = (int)(item / num_kv_heads), g = (int)(item % num_kv_heads);
    const int L = token_pos[t] + 1;
    const int nseg = (L + seg_len - 1) / seg_len;
    // First visible position, and the segment holding it: the segments before it are never read.
    const int lo = jb->window > 0 && L > jb->window ? L - jb->window : 0;
    const int s0 = lo / seg_len;
    const int *table = block_tables + (long)token_seq[t] * max_blocks;
    const float *qh[MAX_GROUP];
    float *sc[MAX_GROUP];
    vf16 mx[MAX_GROUP];
    for (int h = 0; h < G; h++) {
        qh[h] = q + (long)t * q_stride + (long)(g * G + h) * head_dim;
        sc[h] = scores + (long)h * 16 * nseg;
        mx[h] = vf_set1(-INFINITY);
    }
    // scores: for each segment, sum over d of q_h[d] * K[block][g][d][seg keys] (two chains).
    for (int s = s0; s < nseg; s++) {
        const int j0 = s * seg_len;  // first position of the segment
        // Positions j0.. up to pos, less those before the window (only ever in the first segment).
        const lanes16 valid = (lanes16)(tail_mask(L - j0 < seg_len ? L - j0 : seg_len) &
                                        ~tail_mask(lo > j0 ? lo - j0 : 0));
        const uint16_t *kb = k_cache + (long)table[j0 / block_size] * block_elems +
                          (long)g * head_dim * block_size + j0 % block_size;
        // Keys of a later segment, fetched while this one is scored: its block lies anywhere in the
        // pool, where the hardware prefetcher cannot follow.
        const int j1 = (s + PREFETCH_AHEAD < nseg ? s + PREFETCH_AHEAD : nseg - 1) * seg_len;
        const uint16_t *kn = k_cache + (long)table[j1 / block_size] * block_elems +
                          (long)g * head_dim * block_size + j1 % block_size;
        vf16 even[MAX_GROUP], odd[MAX_GROUP];
        for (int h = 0; h < G; h++) even[h] = odd[h] = vf_zero();
        for (int d = 0; d < head_dim; d += 2) {
            _mm_prefetch((const char *)(kn + (long)d * block_size), _MM_HINT_T0);
            _mm_prefetch((const char *)(kn + (long)(d + 1) * block_size), _MM_HINT_T0);
            const vf16 k0 = vf_load_f16_masked(valid, kb + (long)d * block_size);
            const vf16 k1 = vf_load_f16_masked(valid, kb + (long)(d + 1) * block_size);
            for (int h = 0; h < G; h++) {
                even[h] = vf_fmadd(vf_set1(qh[h][d]), k0, even[h]);
                odd[h] = vf_fmadd(vf_set1(qh[h][d + 1]), k1, odd[h]);
            }
        }
        for (int h = 0; h < G; h++) {
            vf16 v = vf_mul(vf_add(even[h], odd[h]), vf_set1(scale));
            v = vf_select(valid, v, vf_set1(-INFINITY));
            vf_store(sc[h] + s * 16, v);
            mx[h] = vf_max(mx[h], v);
        }
    }
    // softmax numerators in place; out = sum_j p_j v_j / sum_j p_j
    float inv_sum[MAX_GROUP];
    for (int h = 0; h < G; h++) {
        const vf16 m = vf_set1(vf_hmax(mx[h]));
        vf16 sum = vf_zero();
        for (int s = s0; s < nseg; s++) {
            const vf16 x = vf_load(sc[h] + s * 16);
            // exp512 clamps at -87, so masked lanes (-inf) are zeroed explicitly
            const vf16 e = vf_select(vf_above_neg_inf(x), vf_exp(vf_sub(x, m)), vf_zero());
            vf_store(sc[h] + s * 16, e);
            sum = vf_add(sum, e);
        }
        inv_sum[h] = 1.0f / vf_sum(sum);
    }
    // out = sum_j p_j v_j, in passes of vc value vectors: G x vc accumulators stay in registers (Gemma 3's
    // 4 heads x 16 vectors would not fit in one pass). Each accumulator is the same chain over j in any case.
    const int vc = G * nv <= MAX_ACCUMULATORS ? nv : MAX_ACCUMULATORS / G;
    for (int v0 = 0; v0 < nv; v0 += vc) {
        const int w = nv - v0 < vc ? nv - v0 : vc;  // this pass's vectors
        vf16 acc[MAX_GROUP][MAX_VEC];
        for (int h = 0; h < G; h++)
            for (int v = 0; v < w; v++) acc[h][v] = vf_zero();
        for (int s = s0; s < nseg; s++) {  // positions before the window have probability 0
            const int j0 = s * seg_len;
            const int n = L - j0 < seg_len ? L - j0 : seg_len;
            const uint16_t *vb = v_cache + (long)table[j0 / block_size] * block_elems +
                              (long)(j0 % block_size) * v_row + (long)g * head_dim + v0 * 16;
            const int j1 = (s + PREFETCH_AHEAD < nseg ? s + PREFETCH_AHEAD : nseg - 1) * seg_len;  // as for keys
            const uint16_t *vn = v_cache + (long)table[j1 / block_size] * block_elems +
                              (long)(j1 % block_size) * v_row + (long)g * head_dim + v0 * 16;
            for (int j = 0; j < n; j++) {
                const uint16_t *vp = vb + j * v_row;
                for (int v = 0; v < w; v++) {
                    _mm_prefetch((const char *)(vn + j * v_row + v * 16), _MM_HINT_T0);
                    const vf16 vv = vf_load_f16(vp + v * 16);
                    for (int h = 0; h < G; h++)
                        acc[h][v] = vf_fmadd(vf_set1(sc[h][s * 16 + j]), vv, acc[h][v]);
                }
            }
        }
        for (int h = 0; h < G; h++) {
            float *o = out + (long)t * num_heads * head_dim + (long)(g * G + h) * head_dim + v0 * 16;
            for (int v = 0; v < w; v++)
                vf_store(o + v * 16, vf_mul(acc[h][v], vf_set1(inv_sum[h])));
        }
    }
}

// One task per (token, kv head); the shapes of common models get their own register-resident copy.
static void attention_task(void *arg, long item) {
    const attention_job *jb = arg;
    const int G = jb->num_heads / jb->num_kv_heads, nv = jb->head_dim / 16;
    if (G == 3 && nv == 4)
        attend(jb, item, 3, 4);  // SmolLM2-135M: 9 query heads, 3 kv heads, head_dim 64
    else if (G == 4 && nv == 4)
        attend(jb, item, 4, 4);
    else if (G == 1 && nv == 4)
        attend(jb, item, 1, 4);
    else if (G == 4 && nv == 8)
        attend(jb, item, 4, 8);
    else if (G == 4 && nv == 16)
        attend(jb, item, 4, 16);  // Gemma 3 270M: 4 query heads, 1 kv head, head_dim 256
    else
        attend(jb, item, G, nv);
}

// q: [T, q_stride] with query head h at q + t*q_stride + h*head_dim. out: [T, num_heads * head_dim].
// token_seq[t]: row of block_tables ([num_seqs, max_blocks]) for token t; token_pos[t]: its position.
// block_size: at most 16, or a multiple of 16. Keys are visited in segments of min(block_size, 16)
// positions, each inside one block.
void cm_attention(const float *q, long q_stride, int T, int num_heads, int num_kv_heads, int head_dim,
                  const uint16_t *k_cache, const uint16_t *v_cache, int block_size, const int *token_seq,
                  const int *token_pos, const int *block_tables, int max_blocks, int max_len, int window,
                  float scale, float *out) {
    attention_job job = {q,         k_cache,      v_cache,  token_seq,  token_pos,  block_tables, out,
                         q_stride,  num_heads,    num_kv_heads, head_dim, block_size, max_blocks, max_len,
                         window,    scale};
    cm_parallel_for((long)T * num_kv_heads, attention_task, &job);
}

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, rows of length H (a multiple of 16).
void cm_rms_norm(const float *x, int T, int H, const float *w, float eps, float *out) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (long)t * H;
        vf16 ss = vf_zero();
        for (int i = 0; i < H; i += 16) {
            vf16 v = vf_load(xr + i);
            ss = vf_fmadd(v, v, ss);
        }
        const vf16 inv = vf_set1(1.0f / sqrtf(vf_sum(ss) / H + eps));
        for (int i = 0; i < H; i += 16)
            vf_store(out + (long)t * H + i,
                             vf_mul(vf_mul(vf_load(xr + i), inv), vf_load(w + i)));
    }
}

// Interleaved-pair RoPE in place on the first num_heads heads of each row (q heads then k heads).
// cos/sin: [positions, head_dim / 2].
void cm_rope(float *x, long stride, int T, int num_heads, int head_dim, const int *pos, const float *cos_t,
             const float *sin_t) {
    const int half = head_dim / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + (long)pos[t] * half, *s = sin_t + (long)pos[t] * half;
        for (int h = 0; h < num_heads; h++) {
            float *v = x + (long)t * stride + (long)h * head_dim;
            for (int i = 0; i < half; i++) {
                const float a = v[2 * i], b = v[2 * i + 1];
                v[2 * i] = a * c[i] - b * s[i];
                v[2 * i + 1] = a * s[i] + b * c[i];
            }
        }
    }
}

// out[t, f] = act(gu[t, f]) * gu[t, F + f]: gate and up projections side by side in one [T, 2F] row.
// act(g) = g * sigmoid(z(g)): SiLU with z = g; GELU's tanh form, 0.5 g (1 + tanh(u)) with
// u = sqrt(2/pi) (g + 0.044715 g^3), is the same with z = 2u.
static inline __attribute__((always_inline)) void gated(const float *gu, int T, int F, float *out,
                                                        const int gelu) {
    for (int t = 0; t < T; t++) {
        const float *g = gu + (long)t * 2 * F, *u = g + F;
        for (int f = 0; f < F; f += 16) {
            const lanes16 k = tail_mask(F - f);
            const vf16 gv = vf_load_masked(k, g + f);
            vf16 z = gv;
            if (gelu) {
                const vf16 cube = vf_mul(vf_mul(gv, gv), gv);
                z = vf_mul(vf_set1(1.5957691216f), vf_fmadd(vf_set1(0.044715f), cube, gv));  // 2 sqrt(2/pi)
            }
            const vf16 sig = vf_div(vf_set1(1.0f), vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), z))));
            vf_store_masked(out + (long)t * F + f, k, vf_mul(vf_mul(gv, sig), vf_load_masked(k, u + f)));
        }
    }
}

void cm_silu_mul(const float *gu, int T, int F, float *out) { gated(gu, T, F, out, 0); }

void cm_gelu_mul(const float *gu, int T, int F, float *out) { gated(gu, T, F, out, 1); }
