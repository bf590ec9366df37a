// The decoder layer stack in one call: what cpu_runner.py's per-kernel loop does, layer after layer,
// without returning to Python between kernels (each ctypes round trip costs microseconds, and a
// single-stream decode step makes ~330 of them: a fifth of the step).
//
// Per layer: RMSNorm → QKV GEMM → (RMSNorm of each q and k head) → RoPE (the layer's own tables) → K/V of
// this step into the float16 cache → attention (the layer's window) → output GEMM → (RMSNorm), residual →
// RMSNorm → gate|up GEMM → SwiGLU or GELU gate → down GEMM → (RMSNorm), residual; the bracketed steps
// where the model has those weights (Qwen3's and Gemma 3's head norms, Gemma 3's post-norms). The same
// kernels in the same order as the Python loop, so the two give bit-identical results (a test checks
// this); the Python loop remains for the numpy kernels, for tensor-parallel ranks, which all-reduce
// between kernels, and for Qwen2's q/k/v biases.

#include <stdint.h>
#include <stdlib.h>

#include "simd16.h"

void cm_gemm(int fmt, const float *A, long lda, int M, int K, const void *W, int N, float *C, long ldc);
#if defined(CM_WITH_GEMM_Q8)  // the AVX-512 build's int8 GEMM (gemm_q8.c, VNNI); the AVX2 build has none
enum { FMT_Q4_1_VNNI = 3 };   // packing.py: formats 3 to 6 are the int8 GEMM's
void cm_gemm_q8(int fmt, const float *A, long lda, int M, int K, const void *W, int N, float *C, long ldc);
#endif
void cm_rms_norm(const float *x, int T, int H, const float *w, float eps, float *out);
void cm_rope(float *x, long stride, int T, int num_heads, int head_dim, const int *pos, const float *cos_t,
             const float *sin_t);
void cm_attention(const float *q, long q_stride, int T, int num_heads, int num_kv_heads, int head_dim,
                  const uint16_t *k_cache, const uint16_t *v_cache, int block_size, const int *token_seq,
                  const int *token_pos, const int *block_tables, int max_blocks, int max_len, int window,
                  float scale, float *out);
void cm_silu_mul(const float *gu, int T, int F, float *out);
void cm_gelu_mul(const float *gu, int T, int F, float *out);

typedef struct {
    int fmt, out_features;
    const void *data;
} cm_matrix;

typedef struct {
    const float *attn_norm, *ffn_norm;
    cm_matrix qkv, wo, gate_up, down;
    uint16_t *k_cache, *v_cache;  // [blocks, kv_heads, head_dim, block_size], [blocks, block_size, kv_heads, head_dim]
    const float *q_norm, *k_norm;  // [head_dim] each, or NULL: no per-head norm
    const float *post_attn_norm, *post_ffn_norm;  // [hidden] each, or NULL: no post-norm
    const float *rope_cos, *rope_sin;  // this layer's tables [positions, head_dim / 2]
    int window;  // sliding window (positions a token sees, itself included); 0: all
} cm_layer;

typedef struct {
    int num_layers, hidden, ffn, num_heads, num_kv_heads, head_dim, block_size, gelu;
    float eps, scale;
} cm_model;

static void linear(const cm_matrix *w, const float *a, int M, int K, float *c) {
#if defined(CM_WITH_GEMM_Q8)
    if (w->fmt >= FMT_Q4_1_VNNI) {
        cm_gemm_q8(w->fmt, a, K, M, K, w->data, w->out_features, c, w->out_features);
        return;
    }
#endif
    cm_gemm(w->fmt, a, K, M, K, w->data, w->out_features, c, w->out_features);
}

static void add_into(float *x, const float *y, long n) {
    long i = 0;
    for (; i + 16 <= n; i += 16)
        vf_store(x + i, vf_add(vf_load(x + i), vf_load(y + i)));
    for (; i < n; i++) x[i] += y[i];
}

// K and V of each token (columns after the q heads of its qkv row) into its cache slot, rounded to
// float16 to nearest even (as numpy's astype(float16)).
static void store_kv(const cm_model *m, const cm_layer *l, const float *qkv, long stride, int T,
                     const long *slots) {
    const int hd = m->head_dim, kvh = m->num_kv_heads, bs = m->block_size;
    const long q_width = (long)m->num_heads * hd, kv_width = (long)kvh * hd;
    for (int t = 0; t < T; t++) {
        const float *k = qkv + t * stride + q_width, *v = k + kv_width;
        const long block = slots[t] / bs, offset = slots[t] % bs;
        uint16_t *kb = l->k_cache + block * kv_width * bs;
        for (long i = 0; i < kv_width; i++) kb[i * bs + offset] = _cvtss_sh(k[i], _MM_FROUND_TO_NEAREST_INT);
        uint16_t *vb = l->v_cache + (block * bs + offset) * kv_width;
        for (long i = 0; i < kv_width; i += 16)
            vf_store_f16(vb + i, vf_load(v + i));
    }
}

// RMSNorm of each head_dim-wide head of heads first..first+count-1 in every qkv row, in place.
static void norm_heads(const cm_model *m, float *qkv, long stride, int T, int first, int count, const float *w) {
    for (int t = 0; t < T; t++) {
        float *heads = qkv + t * stride + (long)first * m->head_dim;
        cm_rms_norm(heads, count, m->head_dim, w, m->eps, heads);
    }
}

// out, RMSNorm-ed in place where the layer has that post-norm (w), then added into x.
static void residual(const cm_model *m, float *x, float *out, int T, const float *w) {
    if (w) cm_rms_norm(out, T, m->hidden, w, m->eps, out);
    add_into(x, out, (long)T * m->hidden);
}

// x: [T, hidden] float32, updated in place. positions/slots/token_seq/block_tables: the step (see
// step_batch.py). Returns 0, or -1 when scratch memory could not be allocated (x untouched then).
int cm_layer_stack(const cm_model *m, const cm_layer *layers, float *x, int T, const int *positions,
                   const long *slots, const int *token_seq, const int *block_tables, int max_blocks,
                   int max_len) {
    const int H = m->hidden, F = m->ffn, hd = m->head_dim;
    const long qkv_w = (long)(m->num_heads + 2 * m->num_kv_heads) * hd, attn_w = (long)m->num_heads * hd;
    float *buf = malloc(sizeof(float) * (size_t)T * (2 * H + qkv_w + attn_w + 3 * F));
    if (!buf) return -1;
    float *h = buf, *out = h + (long)T * H, *qkv = out + (long)T * H, *attn = qkv + T * qkv_w;
    float *gu = attn + T * attn_w, *act = gu + (long)T * 2 * F;
    for (int i = 0; i < m->num_layers; i++) {
        const cm_layer *l = &layers[i];
        cm_rms_norm(x, T, H, l->attn_norm, m->eps, h);
        linear(&l->qkv, h, T, H, qkv);
        if (l->q_norm && l->k_norm) {
            norm_heads(m, qkv, qkv_w, T, 0, m->num_heads, l->q_norm);
            norm_heads(m, qkv, qkv_w, T, m->num_heads, m->num_kv_heads, l->k_norm);
        }
        cm_rope(qkv, qkv_w, T, m->num_heads + m->num_kv_heads, hd, positions, l->rope_cos, l->rope_sin);
        store_kv(m, l, qkv, qkv_w, T, slots);
        cm_attention(qkv, qkv_w, T, m->num_heads, m->num_kv_heads, hd, l->k_cache, l->v_cache, m->block_size,
                     token_seq, positions, block_tables, max_blocks, max_len, l->window, m->scale, attn);
        linear(&l->wo, attn, T, (int)attn_w, out);
        residual(m, x, out, T, l->post_attn_norm);
        cm_rms_norm(x, T, H, l->ffn_norm, m->eps, h);
        linear(&l->gate_up, h, T, H, gu);
        (m->gelu ? cm_gelu_mul : cm_silu_mul)(gu, T, F, act);
        linear(&l->down, act, T, F, out);
        residual(m, x, out, T, l->post_ffn_norm);
    }
    free(buf);
    return 0;
}
