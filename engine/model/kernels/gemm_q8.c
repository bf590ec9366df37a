// The int8 weight GEMM ("native-int8" kernels): C[M, N] = A[M, K] · W[N, K]^T, A float32, W GGUF Q4_1,
// Q8_0 (Q5_0 rewritten as the Q8_0 it equals), Q4_K or Q6_K in a VNNI panel layout. (gemm.c is the float32 GEMM the default "native" kernels use.)
//
// Quantized weights (GGUF Q4_1, Q8_0) are multiplied in int8 with AVX-512 VNNI, as llama.cpp does: each
// row of A is first rounded to int8 codes per 32-k block (scale a = max|x| / 127, code = rint(x / a),
// "Q8 activations"), then one VPDPBUSD multiplies 4 weight codes by 4 activation codes for each of 16
// outputs. Per (output n, block b), with weight scale d, weight min m (Q4_1) and activation code sum s:
//   C[r, n] += (d * a) * sum_k(qw_k * qa_k) + m * (a * s)
// The integer sum is exact, so the only rounding beyond float32's is the activations' to 8 bits, which
// the reference forward (engine/model/reference.py) reproduces. Weights keep GGUF's own numbers.
//
// W is repacked once at load (packing.py) into panels of 16 output rows. Per (panel, 32-k block):
//   Q4_1: f16 d[16], f16 m[16], 4 x 64 code bytes: in vector v, byte 4n + i holds row n's code for
//         k = 4v + i in its low nibble and for k = 4(v + 4) + i in its high nibble;
//   Q8_0: f16 d[16], 8 x 64 code bytes: in vector g, byte 4n + i is row n's code for k = 4g + i, plus
//         128 (VPDPBUSD takes unsigned weights; the kernel subtracts 128 * s again, exactly);
//   Q4_K, Q6_K: f32 scales and min, then codes as Q8_0's (see DEFINE_KTILE); their activations are
//         rounded per 256 values as llama.cpp's Q8_K (quantize_row_k), not per 32.
//
// Determinism: every output element is one chain over k blocks 0..K/32-1 in order, and each activation
// row is quantized on its own, whatever M, the row tile it lands in, or the thread that computes it. A
// sequence's results therefore do not depend on what else is in the batch or on how its prompt was
// chunked.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

// packing.py: FORMAT_Q4_1_VNNI, FORMAT_Q8_0_VNNI, FORMAT_Q4_K_VNNI, FORMAT_Q6_K_VNNI
enum { FMT_Q4_1 = 3, FMT_Q8_0 = 4, FMT_Q4_K = 5, FMT_Q6_K = 6 };
enum { NR = 16, QK = 32 };

// Bytes of one packed (panel, 32-k block).
static inline long block_bytes(int fmt) {
    return fmt == FMT_Q4_1 ? 32 + 32 + 256 : fmt == FMT_Q8_0 ? 32 + 512 : 3 * 64 + 512;
}

// The K-quant formats' codes are unsigned: Q4_K's q (0..15), Q6_K's q (0..63), which stands for q - 32.
static inline int code_offset(int fmt) { return fmt == FMT_Q6_K ? 32 : 0; }

// Rows of A as Q8 blocks: codes qa[r * K + k]; per block b (of nb = K / 32): scale sa[r * nb + b], code
// sum s[r * nb + b], the sum of its first 16 codes s_lo[r * nb + b] (Q6_K's scales cover 16 weights) and
// ma = scale * sum (the factor of Q4_1's and Q4_K's min).
typedef struct {
    int8_t *qa;
    float *sa, *ma;
    int32_t *s, *s_lo;
} q8_rows;

static inline int32_t load4(const int8_t *p) {  // 4 activation codes, for one VPDPBUSD broadcast
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void quantize_row(const float *x, int K, int8_t *q, float *scale, int32_t *sum, int32_t *sum_lo,
                         float *scaled_sum) {
    for (int b = 0; b < K / QK; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float a = amax / 127.0f, inv = amax > 0.0f ? 1.0f / a : 0.0f;
        // cvtps_epi32 rounds to nearest even, as numpy's rint in the reference
        const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
        const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(c1));
        scale[b] = a;
        sum_lo[b] = _mm512_reduce_add_epi32(c0);
        sum[b] = sum_lo[b] + _mm512_reduce_add_epi32(c1);
        scaled_sum[b] = a * (float)sum[b];
    }
}

// The rounding llama.cpp gives the input of a K-quant matrix (its Q8_K, quantize_row_q8_K_ref): per
// 256 values one scale d = max / -127, where max is the value of largest magnitude (its sign kept), and
// codes rint(x * (-127 / max)), at most 127. Stored as 8 blocks of 32 sharing d, for the K tiles.
static void quantize_row_k(const float *x, int K, int8_t *q, float *scale, int32_t *sum, int32_t *sum_lo,
                           float *scaled_sum) {
    const __m512i top = _mm512_set1_epi32(127);
    for (int s = 0; s < K / 256; s++) {
        const float *xs = x + s * 256;
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < 256; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xs + i)));
        const float amax = _mm512_reduce_max_ps(m);
        float max = 0.0f;  // the first value of that magnitude, its sign kept
        for (int i = 0; amax > 0.0f && i < 256; i += 16) {
            const __mmask16 at = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xs + i)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
            if (at) {
                max = xs[i + __builtin_ctz(at)];
                break;
            }
        }
        const float iscale = amax > 0.0f ? -127.0f / max : 0.0f, d = amax > 0.0f ? 1.0f / iscale : 0.0f;
        const __m512 vs = _mm512_set1_ps(iscale);
        for (int b = s * 8; b < s * 8 + 8; b++) {
            // cvtps_epi32 rounds to nearest even, as llama.cpp's nearest_int; at most 127
            const __m512i c0 = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(vs, _mm512_loadu_ps(x + b * QK))), top);
            const __m512i c1 = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(vs, _mm512_loadu_ps(x + b * QK + 16))), top);
            _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(c0));
            _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(c1));
            sum_lo[b] = _mm512_reduce_add_epi32(c0);
            sum[b] = sum_lo[b] + _mm512_reduce_add_epi32(c1);
            scale[b] = d, scaled_sum[b] = d * (float)sum[b];
        }
    }
}

// A tile's R rows of 32 outputs into C, the outputs that exist (m0, m1) only.
static inline void store_rows(int R, const __m512 *f0, const __m512 *f1, float *C, long ldc, __mmask16 m0,
                              __mmask16 m1) {
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(C + r * ldc, m0, f0[r]);
        _mm512_mask_storeu_ps(C + r * ldc + 16, m1, f1[r]);
    }
}

// R rows x 32 outputs (panels p0, p1), all K. m0/m1 mask the outputs that exist.
#define DEFINE_QTILE(R)                                                                                   \
    static void qtile_##R(int fmt, const q8_rows *A, int K, const uint8_t *p0, const uint8_t *p1,        \
                          float *C, long ldc, __mmask16 m0, __mmask16 m1) {                              \
        const int nb = K / QK;                                                                           \
        const long bb = block_bytes(fmt);                                                                \
        const __m512i low4 = _mm512_set1_epi8(0x0F);                                                     \
        __m512 f0[R], f1[R];                                                                             \
        for (int r = 0; r < R; r++) f0[r] = f1[r] = _mm512_setzero_ps();                                 \
        for (int b = 0; b < nb; b++) {                                                                   \
            const uint8_t *b0 = p0 + b * bb, *b1 = p1 + b * bb;                                          \
            __m512i i0[R], i1[R];                                                                        \
            for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm512_setzero_si512();                          \
            if (fmt == FMT_Q4_1) {                                                                       \
                for (int v = 0; v < 4; v++) {                                                            \
                    const __m512i c0 = _mm512_loadu_si512(b0 + 64 + 64 * v);                             \
                    const __m512i c1 = _mm512_loadu_si512(b1 + 64 + 64 * v);                             \
                    const __m512i lo0 = _mm512_and_si512(c0, low4);                                      \
                    const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(c0, 4), low4);                \
                    const __m512i lo1 = _mm512_and_si512(c1, low4);                                      \
                    const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(c1, 4), low4);                \
                    for (int r = 0; r < R; r++) {                                                        \
                        const int8_t *q = A->qa + (long)r * K + b * QK;                                  \
                        const __m512i alo = _mm512_set1_epi32(load4(q + 4 * v));                        \
                        const __m512i ahi = _mm512_set1_epi32(load4(q + 4 * v + 16));                   \
                        i0[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i0[r], lo0, alo), hi0, ahi);     \
                        i1[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i1[r], lo1, alo), hi1, ahi);     \
                    }                                                                                    \
                }                                                                                        \
            } else {                                                                                     \
                for (int g = 0; g < 8; g++) {                                                            \
                    const __m512i c0 = _mm512_loadu_si512(b0 + 32 + 64 * g);                             \
                    const __m512i c1 = _mm512_loadu_si512(b1 + 32 + 64 * g);                             \
                    for (int r = 0; r < R; r++) {                                                        \
                        const __m512i a = _mm512_set1_epi32(load4(A->qa + (long)r * K + b * QK + 4 * g));        \
                        i0[r] = _mm512_dpbusd_epi32(i0[r], c0, a);                                       \
                        i1[r] = _mm512_dpbusd_epi32(i1[r], c1, a);                                       \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
            const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b0));                 \
            const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b1));                 \
            for (int r = 0; r < R; r++) {                                                                \
                const long ab = (long)r * nb + b;                                                        \
                const __m512 sa = _mm512_set1_ps(A->sa[ab]);                                             \
                if (fmt == FMT_Q8_0) { /* the codes were stored + 128: remove 128 * sum(qa) */           \
                    const __m512i bias = _mm512_set1_epi32(128 * A->s[ab]);                              \
                    i0[r] = _mm512_sub_epi32(i0[r], bias);                                               \
                    i1[r] = _mm512_sub_epi32(i1[r], bias);                                               \
                }                                                                                        \
                f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[r]), _mm512_mul_ps(d0, sa), f0[r]);        \
                f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r]), _mm512_mul_ps(d1, sa), f1[r]);        \
                if (fmt == FMT_Q4_1) {                                                                   \
                    const __m512 ma = _mm512_set1_ps(A->ma[ab]);                                         \
                    f0[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b0 + 32))), ma, f0[r]); \
                    f1[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b1 + 32))), ma, f1[r]); \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        store_rows(R, f0, f1, C, ldc, m0, m1);                                                           \
    }

DEFINE_QTILE(1)
DEFINE_QTILE(2)
DEFINE_QTILE(3)
DEFINE_QTILE(4)

// The K-quant formats (Q4_K, Q6_K, exactly as GGUF stores them but one 32-k block at a time). Per (panel,
// block): f32 d_lo[16] (scale of k 0..15), f32 d_hi[16] (k 16..31), f32 m[16] (Q4_K's min; 0 for Q6_K),
// then 8 x 64 unsigned code bytes laid out as Q8_0's. Weight = d * (q - offset) - m, so per output:
//   C += a * (d_lo * (sum_lo(q qa) - offset * s_lo) + d_hi * (sum_hi(q qa) - offset * s_hi)) - m * (a * s)
// with integer sums, exact. Q4_K has d_lo == d_hi (its scales cover 32 weights).
#define DEFINE_KTILE(R)                                                                                   \
    static void ktile_##R(int fmt, const q8_rows *A, int K, const uint8_t *p0, const uint8_t *p1,        \
                          float *C, long ldc, __mmask16 m0, __mmask16 m1) {                              \
        const int nb = K / QK, offset = code_offset(fmt);                                                \
        const long bb = block_bytes(fmt);                                                                \
        __m512 f0[R], f1[R];                                                                             \
        for (int r = 0; r < R; r++) f0[r] = f1[r] = _mm512_setzero_ps();                                 \
        for (int b = 0; b < nb; b++) {                                                                   \
            const uint8_t *b0 = p0 + b * bb, *b1 = p1 + b * bb;                                          \
            __m512i l0[R], l1[R], h0[R], h1[R];                                                          \
            for (int r = 0; r < R; r++) l0[r] = l1[r] = h0[r] = h1[r] = _mm512_setzero_si512();          \
            for (int g = 0; g < 4; g++) {                                                                \
                const __m512i c0 = _mm512_loadu_si512(b0 + 192 + 64 * g);                                \
                const __m512i c1 = _mm512_loadu_si512(b1 + 192 + 64 * g);                                \
                const __m512i e0 = _mm512_loadu_si512(b0 + 192 + 64 * (g + 4));                          \
                const __m512i e1 = _mm512_loadu_si512(b1 + 192 + 64 * (g + 4));                          \
                for (int r = 0; r < R; r++) {                                                            \
                    const int8_t *q = A->qa + (long)r * K + b * QK;                                      \
                    const __m512i alo = _mm512_set1_epi32(load4(q + 4 * g));                            \
                    const __m512i ahi = _mm512_set1_epi32(load4(q + 16 + 4 * g));                       \
                    l0[r] = _mm512_dpbusd_epi32(l0[r], c0, alo);                                         \
                    l1[r] = _mm512_dpbusd_epi32(l1[r], c1, alo);                                         \
                    h0[r] = _mm512_dpbusd_epi32(h0[r], e0, ahi);                                         \
                    h1[r] = _mm512_dpbusd_epi32(h1[r], e1, ahi);                                         \
                }                                                                                        \
            }                                                                                            \
            const float *s0 = (const float *)b0, *s1 = (const float *)b1;                                \
            const __m512 dl0 = _mm512_loadu_ps(s0), dh0 = _mm512_loadu_ps(s0 + 16), mn0 = _mm512_loadu_ps(s0 + 32); \
            const __m512 dl1 = _mm512_loadu_ps(s1), dh1 = _mm512_loadu_ps(s1 + 16), mn1 = _mm512_loadu_ps(s1 + 32); \
            for (int r = 0; r < R; r++) {                                                                \
                const long ab = (long)r * nb + b;                                                        \
                const __m512 sa = _mm512_set1_ps(A->sa[ab]), ma = _mm512_set1_ps(A->ma[ab]);             \
                const __m512i olo = _mm512_set1_epi32(offset * A->s_lo[ab]);                             \
                const __m512i ohi = _mm512_set1_epi32(offset * (A->s[ab] - A->s_lo[ab]));                \
                const __m512 lo0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(l0[r], olo));                     \
                const __m512 lo1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(l1[r], olo));                     \
                const __m512 hi0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(h0[r], ohi));                     \
                const __m512 hi1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(h1[r], ohi));                     \
                const __m512 t0 = _mm512_fmadd_ps(lo0, dl0, _mm512_mul_ps(hi0, dh0));                   \
                const __m512 t1 = _mm512_fmadd_ps(lo1, dl1, _mm512_mul_ps(hi1, dh1));                   \
                f0[r] = _mm512_fnmadd_ps(mn0, ma, _mm512_fmadd_ps(t0, sa, f0[r]));                        \
                f1[r] = _mm512_fnmadd_ps(mn1, ma, _mm512_fmadd_ps(t1, sa, f1[r]));                        \
            }                                                                                            \
        }                                                                                                \
        store_rows(R, f0, f1, C, ldc, m0, m1);                                                           \
    }

DEFINE_KTILE(1)
DEFINE_KTILE(2)
DEFINE_KTILE(3)
DEFINE_KTILE(4)

typedef void (*qtile_fn)(int, const q8_rows *, int, const uint8_t *, const uint8_t *, float *, long,
                         __mmask16, __mmask16);
static const qtile_fn QTILES[5] = {0, qtile_1, qtile_2, qtile_3, qtile_4};
static const qtile_fn KTILES[5] = {0, ktile_1, ktile_2, ktile_3, ktile_4};
enum { MRQ = 4 };

typedef struct {
    int fmt, M, K, N, panels, pairs_per_task;
    const float *A;
    long lda, ldc, panel_bytes;
    const uint8_t *W;
    float *C;
    q8_rows q;  // A as Q8 blocks
} gemm_job;

static inline __mmask16 valid_mask(long n0, long N) {
    long v = N - n0;
    return v >= 16 ? (__mmask16)0xFFFF : v <= 0 ? (__mmask16)0 : (__mmask16)((1u << v) - 1);
}

// The 32 outputs of panel pair `pp`, all M rows.
static void gemm_pair(const gemm_job *j, long pp) {
    const int p0 = 2 * (int)pp, has_p1 = p0 + 1 < j->panels;
    const int p1 = has_p1 ? p0 + 1 : p0;  // without a second panel, compute panel 0 twice; m1 == 0 drops it
    const __mmask16 m0 = valid_mask((long)p0 * NR, j->N);
    const __mmask16 m1 = has_p1 ? valid_mask((long)p1 * NR, j->N) : 0;
    float *Cp = j->C + (long)p0 * NR;
    const uint8_t *w0 = j->W + p0 * j->panel_bytes, *w1 = j->W + p1 * j->panel_bytes;
    const int nb = j->K / QK;
    for (int i = 0; i < j->M; i += MRQ) {
        const int r = j->M - i < MRQ ? j->M - i : MRQ;
        const q8_rows rows = {j->q.qa + (long)i * j->K, j->q.sa + (long)i * nb, j->q.ma + (long)i * nb,
                              j->q.s + (long)i * nb, j->q.s_lo + (long)i * nb};
        (j->fmt >= FMT_Q4_K ? KTILES : QTILES)[r](j->fmt, &rows, j->K, w0, w1, Cp + (long)i * j->ldc, j->ldc, m0, m1);
    }
}

// One task: pairs_per_task consecutive panel pairs, one contiguous stretch of W.
static void gemm_task(void *arg, long task) {
    const gemm_job *j = arg;
    const long pairs = (j->panels + 1) / 2, end = (task + 1) * j->pairs_per_task;
    for (long pp = task * j->pairs_per_task; pp < end && pp < pairs; pp++) gemm_pair(j, pp);
}

// Tasks per thread a GEMM of at most MRQ rows is cut into at most. Such a task only streams its panels
// once, and is claimed with two atomic operations on a cache line the threads share: for the LM head's
// 8,192 panel pairs of 22 KB at one row, a claim per pair cost more than the balance it buys. With more
// rows a pair is MRQ-row tiles of work each, and one pair a task balances best on a busy machine.
enum { TASKS_PER_THREAD = 64 };

enum { QUANTIZE_ROWS = 16 };  // rows per quantization task

static void quantize_task(void *arg, long task) {
    const gemm_job *j = arg;
    const int nb = j->K / QK;
    for (long r = task * QUANTIZE_ROWS; r < j->M && r < (task + 1) * QUANTIZE_ROWS; r++)
        (j->fmt >= FMT_Q4_K ? quantize_row_k : quantize_row)(j->A + r * j->lda, j->K, j->q.qa + r * j->K,
                                                             j->q.sa + r * nb, j->q.s + r * nb,
                                                             j->q.s_lo + r * nb, j->q.ma + r * nb);
}

// Per-thread Q8 buffers, grown as needed and kept: every linear of every step quantizes its input.
static __thread void *q8_buf;
static __thread size_t q8_cap;

static void *q8_buffer(size_t bytes) {
    if (bytes > q8_cap) {
        free(q8_buf);
        q8_cap = bytes * 2;
        q8_buf = aligned_alloc(64, (q8_cap + 63) / 64 * 64);
    }
    return q8_buf;
}

// W: packed panels, panel p at W + p * panel_bytes. N outputs (the last panel may be partial: its
// padding rows are zero and masked out of C). A and C are row-major with leading dims lda, ldc. K: a
// multiple of 32.
void cm_gemm_q8(int fmt, const float *A, long lda, int M, int K, const void *W, int N, float *C, long ldc) {
    if (M <= 0) return;
    const int panels = (N + NR - 1) / NR;
    const long nb = (long)M * (K / QK);
    uint8_t *buf = q8_buffer((size_t)M * K + nb * 16);
    const q8_rows q = {(int8_t *)(buf + nb * 16), (float *)buf, (float *)(buf + nb * 4), (int32_t *)(buf + nb * 8),
                       (int32_t *)(buf + nb * 12)};
    const int pairs = (panels + 1) / 2, most = TASKS_PER_THREAD * cm_get_threads();
    const int per_task = M <= MRQ && pairs > most ? (pairs + most - 1) / most : 1;
    gemm_job job = {fmt, M, K, N, panels, per_task, A, lda, ldc, (long)(K / QK) * block_bytes(fmt), (const uint8_t *)W, C, q};
    cm_parallel_for((M + QUANTIZE_ROWS - 1) / QUANTIZE_ROWS, quantize_task, &job);
    cm_parallel_for((pairs + per_task - 1) / per_task, gemm_task, &job);
}

// Expands a whole quantized panel set to float32 [N, K] (tests compare it with gguf's dequantize): d * q + m
// with a separate multiply and add, as gguf does (this file is compiled with -ffp-contract=off).
void cm_unpack_q8(int fmt, const void *W, int K, int N, float *out) {
    const long panel_bytes = (long)(K / QK) * block_bytes(fmt);
    for (int n = 0; n < N; n++) {
        const uint8_t *panel = (const uint8_t *)W + (n / NR) * panel_bytes;
        const int lane = n % NR;
        for (int k = 0; k < K; k++) {
            const uint8_t *blk = panel + (k / QK) * block_bytes(fmt);
            const int kk = k % QK;
            float w;
            if (fmt >= FMT_Q4_K) {  // d * (q - offset) - m, as gguf computes Q4_K's d * q - m and Q6_K's d * (q - 32)
                const float *scales = (const float *)blk;
                const int q = (int)blk[192 + 64 * (kk / 4) + 4 * lane + kk % 4] - code_offset(fmt);
                w = scales[(kk < 16 ? 0 : 16) + lane] * (float)q;
                if (fmt == FMT_Q4_K) w = w - scales[32 + lane];
                out[(long)n * K + k] = w;
                continue;
            }
            const float d = _cvtsh_ss(((const uint16_t *)blk)[lane]);
            if (fmt == FMT_Q4_1) {
                const uint8_t byte = blk[64 + 64 * (kk / 4 % 4) + 4 * lane + kk % 4];
                const int q = kk < 16 ? byte & 0x0F : byte >> 4;
                w = d * (float)q + _cvtsh_ss(((const uint16_t *)(blk + 32))[lane]);
            } else {
                w = (float)((int)blk[32 + 64 * (kk / 4) + 4 * lane + kk % 4] - 128) * d;
            }
            out[(long)n * K + k] = w;
        }
    }
}
