// Weight GEMM for the CPU runner: C[M, N] (+)= A[M, K] · W[N, K]^T with A float32 and W packed.
//
// W is repacked once at load into panels of 16 output rows, k-major inside a panel, so the inner loop
// is "broadcast one activation, FMA it into 16 outputs" (no horizontal sums). Quantized panels keep
// GGUF's own numbers (f16 scale/min, 4- or 8-bit codes) and are expanded to float32 one k-chunk at a
// time into a per-thread scratch that stays in L1. The expansion computes d*q + m with a separate
// multiply and add (this file is compiled with -ffp-contract=off), exactly as gguf.quants.dequantize
// does, so the float32 weights are bit-identical to the reference's.
//
// Determinism: every output element is one FMA chain over k = 0..K-1 in order, whatever M, the row tile
// it lands in, or the thread that computes it. A sequence's results therefore do not depend on what else
// is in the batch or on how its prompt was chunked.

#include <stdint.h>

#include "pool.h"
#include "simd16.h"

enum { FMT_F32 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2 };
enum { NR = 16, QK = 32, KC = 128 };

// Bytes of one packed (panel, 32-k block): f16 d[16], [f16 m[16]], codes.
static inline long block_bytes(int fmt) {
    return fmt == FMT_Q4_1 ? 32 + 32 + 256 : 32 + 512;
}

// Q4_1 codes: 16 bytes per k pair; byte n holds row k's code in its low nibble and row k+1's in its high.
static inline void expand_q4_1(const uint8_t *blk, int k_lo, int k_hi, float *dst, long ds) {
    const vf16 d = vf_load_f16((const uint16_t *)blk);
    const vf16 m = vf_load_f16((const uint16_t *)(blk + 32));
    const uint8_t *codes = blk + 64;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int k = k_lo; k < k_hi; k += 2) {
        __m128i pair = _mm_loadu_si128((const __m128i *)(codes + (k / 2) * 16));
        __m128i q0 = _mm_and_si128(pair, low4);
        __m128i q1 = _mm_and_si128(_mm_srli_epi16(pair, 4), low4);
        vf_store(dst + (long)(k - k_lo) * ds, vf_add(vf_mul(d, vf_from_u8(q0)), m));
        vf_store(dst + (long)(k - k_lo + 1) * ds, vf_add(vf_mul(d, vf_from_u8(q1)), m));
    }
}

// Q8_0 codes: 16 signed bytes per k (one per output row).
static inline void expand_q8_0(const uint8_t *blk, int k_lo, int k_hi, float *dst, long ds) {
    const vf16 d = vf_load_f16((const uint16_t *)blk);
    const int8_t *codes = (const int8_t *)(blk + 32);
    for (int k = k_lo; k < k_hi; k++) {
        __m128i q = _mm_loadu_si128((const __m128i *)(codes + k * 16));
        vf_store(dst + (long)(k - k_lo) * ds, vf_mul(vf_from_i8(q), d));
    }
}

// Expands k in [k0, k0 + kc) of one quantized panel into dst[k - k0][0..15] (row stride ds floats).
static void expand_panel(int fmt, const uint8_t *panel, int k0, int kc, float *dst, long ds) {
    const long bb = block_bytes(fmt);
    for (int kb = k0; kb < k0 + kc; kb += QK) {
        const uint8_t *blk = panel + (kb / QK) * bb;
        int hi = k0 + kc - kb < QK ? k0 + kc - kb : QK;
        if (fmt == FMT_Q4_1)
            expand_q4_1(blk, 0, hi, dst + (long)(kb - k0) * ds, ds);
        else
            expand_q8_0(blk, 0, hi, dst + (long)(kb - k0) * ds, ds);
    }
}

// Both macros below keep accumulators c0[r], c1[r] (rows r, panels 0 and 1) and end by storing them.
#define STORE_ROWS(R)                                 \
    for (int r = 0; r < R; r++) {                     \
        vf_store_masked(C + r * ldc, m0, c0[r]);      \
        vf_store_masked(C + r * ldc + 16, m1, c1[r]); \
    }

// R rows x 32 outputs (two panels at w0 and w1, k stride ws), k in [0, kc). first: start from zero
// (else continue the chain from C). m0/m1 mask the outputs that exist.
#define DEFINE_TILE(R)                                                                                \
    static void tile_##R(const float *A, long lda, int kc, const float *w0, const float *w1, long ws, \
                         float *C, long ldc, int first, lanes16 m0, lanes16 m1) {                     \
        vf16 c0[R], c1[R];                                                                            \
        for (int r = 0; r < R; r++) {                                                                 \
            c0[r] = first ? vf_zero() : vf_load_masked(m0, C + r * ldc);                              \
            c1[r] = first ? vf_zero() : vf_load_masked(m1, C + r * ldc + 16);                         \
        }                                                                                             \
        for (int k = 0; k < kc; k++) {                                                                \
            vf16 b0 = vf_load(w0 + k * ws);                                                           \
            vf16 b1 = vf_load(w1 + k * ws);                                                           \
            _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {                                    \
                vf16 a = vf_set1(A[r * lda + k]);                                                     \
                c0[r] = vf_fmadd(a, b0, c0[r]);                                                       \
                c1[r] = vf_fmadd(a, b1, c1[r]);                                                       \
            }                                                                                         \
        }                                                                                             \
        STORE_ROWS(R);                                                                                \
    }

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
typedef void (*tile_fn)(const float *, long, int, const float *, const float *, long, float *, long, int,
                        lanes16, lanes16);
// Rows per tile: a row's two accumulators (two registers each with AVX2) must stay in registers beside
// the weights: 32 AVX-512 registers hold 12 rows, 16 AVX2 ones 3. Any tiling gives the same bits.
#if defined(__AVX512F__)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
DEFINE_TILE(7)
DEFINE_TILE(8)
DEFINE_TILE(9)
DEFINE_TILE(10)
DEFINE_TILE(11)
DEFINE_TILE(12)
enum { MR = 12 };
static const tile_fn TILES[MR + 1] = {0,       tile_1,  tile_2,  tile_3,  tile_4,  tile_5, tile_6,
                                      tile_7, tile_8,  tile_9,  tile_10, tile_11, tile_12};
#else
enum { MR = 3 };
static const tile_fn TILES[MR + 1] = {0, tile_1, tile_2, tile_3};
#endif

static inline lanes16 valid_mask(long n0, long N) {
    long v = N - n0;
    return v >= 16 ? (lanes16)0xFFFF : v <= 0 ? (lanes16)0 : (lanes16)((1u << v) - 1);
}

static void rows(const float *A, long lda, int M, int kc, const float *w0, const float *w1, long ws, float *C,
                 long ldc, int first, lanes16 m0, lanes16 m1) {
    for (int i = 0; i < M; i += MR) {
        int r = M - i < MR ? M - i : MR;
        TILES[r](A + (long)i * lda, lda, kc, w0, w1, ws, C + (long)i * ldc, ldc, first, m0, m1);
    }
}

// Few rows (decode of a handful of sequences): expand each pair of k rows of both panels in registers
// and use it at once, skipping the scratch round trip. Same values, same FMA order per output as the
// scratch path, so results are bit-identical whichever path a batch size takes.
#define DEFINE_FUSED(R)                                                                                   \
    static void fused_##R(int fmt, const float *A, long lda, int K, const uint8_t *p0, const uint8_t *p1, \
                          float *C, long ldc, lanes16 m0, lanes16 m1) {                                   \
        vf16 c0[R], c1[R];                                                                                \
        for (int r = 0; r < R; r++) c0[r] = c1[r] = vf_zero();                                            \
        const long bb = block_bytes(fmt);                                                                 \
        const __m128i low4 = _mm_set1_epi8(0x0F);                                                         \
        for (int kb = 0; kb < K; kb += QK) {                                                              \
            const uint8_t *b0 = p0 + (kb / QK) * bb, *b1 = p1 + (kb / QK) * bb;                           \
            const vf16 d0 = vf_load_f16((const uint16_t *)b0);                                            \
            const vf16 d1 = vf_load_f16((const uint16_t *)b1);                                            \
            if (fmt == FMT_Q4_1) {                                                                        \
                const vf16 n0 = vf_load_f16((const uint16_t *)(b0 + 32));                                 \
                const vf16 n1 = vf_load_f16((const uint16_t *)(b1 + 32));                                 \
                for (int j = 0; j < QK / 2; j++) {                                                        \
                    const __m128i q0 = _mm_loadu_si128((const __m128i *)(b0 + 64 + j * 16));              \
                    const __m128i q1 = _mm_loadu_si128((const __m128i *)(b1 + 64 + j * 16));              \
                    const vf16 w00 = vf_add(                                                              \
                        vf_mul(d0, vf_from_u8(_mm_and_si128(q0, low4))), n0);                             \
                    const vf16 w01 = vf_add(                                                              \
                        vf_mul(d0, vf_from_u8((                                                           \
                                              _mm_and_si128(_mm_srli_epi16(q0, 4), low4)))), n0);         \
                    const vf16 w10 = vf_add(                                                              \
                        vf_mul(d1, vf_from_u8(_mm_and_si128(q1, low4))), n1);                             \
                    const vf16 w11 = vf_add(                                                              \
                        vf_mul(d1, vf_from_u8((                                                           \
                                              _mm_and_si128(_mm_srli_epi16(q1, 4), low4)))), n1);         \
                    const int k = kb + 2 * j;                                                             \
                    for (int r = 0; r < R; r++) {                                                         \
                        const vf16 a0 = vf_set1(A[r * lda + k]);                                          \
                        const vf16 a1 = vf_set1(A[r * lda + k + 1]);                                      \
                        c0[r] = vf_fmadd(a1, w01, vf_fmadd(a0, w00, c0[r]));                              \
                        c1[r] = vf_fmadd(a1, w11, vf_fmadd(a0, w10, c1[r]));                              \
                    }                                                                                     \
                }                                                                                         \
            } else {                                                                                      \
                for (int j = 0; j < QK; j++) {                                                            \
                    const vf16 w0 = vf_mul(                                                               \
                        vf_from_i8((_mm_loadu_si128((const __m128i *)(b0 + 32 + j * 16)))), d0);          \
                    const vf16 w1 = vf_mul(                                                               \
                        vf_from_i8((_mm_loadu_si128((const __m128i *)(b1 + 32 + j * 16)))), d1);          \
                    for (int r = 0; r < R; r++) {                                                         \
                        const vf16 a = vf_set1(A[r * lda + kb + j]);                                      \
                        c0[r] = vf_fmadd(a, w0, c0[r]);                                                   \
                        c1[r] = vf_fmadd(a, w1, c1[r]);                                                   \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        STORE_ROWS(R);                                                                                    \
    }

DEFINE_FUSED(1)
DEFINE_FUSED(2)
typedef void (*fused_fn)(int, const float *, long, int, const uint8_t *, const uint8_t *, float *, long,
                         lanes16, lanes16);
// As for tiles: four weight vectors and each row's two accumulators in registers.
#if defined(__AVX512F__)
DEFINE_FUSED(3)
DEFINE_FUSED(4)
enum { FUSED_MAX_ROWS = 4 };
static const fused_fn FUSED[FUSED_MAX_ROWS + 1] = {0, fused_1, fused_2, fused_3, fused_4};
#else
enum { FUSED_MAX_ROWS = 2 };
static const fused_fn FUSED[FUSED_MAX_ROWS + 1] = {0, fused_1, fused_2};
#endif

typedef struct {
    int fmt, M, K, N, panels;
    const float *A;
    long lda, ldc, panel_bytes;
    const uint8_t *W;
    float *C;
} gemm_job;

// One task: the 32 outputs of panel pair `pp`, all M rows.
static void gemm_task(void *arg, long pp) {
    const gemm_job *j = arg;
    const int p0 = 2 * (int)pp, has_p1 = p0 + 1 < j->panels;
    const int p1 = has_p1 ? p0 + 1 : p0;
    const lanes16 m0 = valid_mask((long)p0 * NR, j->N);
    const lanes16 m1 = has_p1 ? valid_mask((long)p1 * NR, j->N) : 0;
    float *Cp = j->C + (long)p0 * NR;
    const uint8_t *w0 = j->W + p0 * j->panel_bytes, *w1 = j->W + p1 * j->panel_bytes;
    if (j->fmt == FMT_F32) {
        rows(j->A, j->lda, j->M, j->K, (const float *)w0, (const float *)w1, NR, Cp, j->ldc, 1, m0, m1);
        return;
    }
    if (j->M <= FUSED_MAX_ROWS) {
        FUSED[j->M](j->fmt, j->A, j->lda, j->K, w0, w1, Cp, j->ldc, m0, m1);
        return;
    }
    float scratch[KC * 2 * NR] __attribute__((aligned(64)));
    for (int k0 = 0; k0 < j->K; k0 += KC) {
        const int kc = j->K - k0 < KC ? j->K - k0 : KC;
        expand_panel(j->fmt, w0, k0, kc, scratch, 2 * NR);
        // Without a second panel, tile computes panel 0 twice and m1 == 0 discards the copy.
        if (has_p1) expand_panel(j->fmt, w1, k0, kc, scratch + NR, 2 * NR);
        rows(j->A + k0, j->lda, j->M, kc, scratch, has_p1 ? scratch + NR : scratch, 2 * NR, Cp, j->ldc, k0 == 0,
             m0, m1);
    }
}

// W: packed panels, panel p at W + p * panel_bytes. N outputs (the last panel may be partial: its
// padding rows are zero and masked out of C). A and C are row-major with leading dims lda, ldc.
void cm_gemm(int fmt, const float *A, long lda, int M, int K, const void *W, int N, float *C, long ldc) {
    if (M <= 0) return;
    const int panels = (N + NR - 1) / NR;
    gemm_job job = {fmt, M, K, N, panels, A, lda, ldc, 0, (const uint8_t *)W, C};
    job.panel_bytes = fmt == FMT_F32 ? (long)K * NR * 4 : (long)(K / QK) * block_bytes(fmt);
    cm_parallel_for((panels + 1) / 2, gemm_task, &job);
}

// Expands a whole quantized panel set to float32 [N, K] (tests compare it with gguf's dequantize).
void cm_unpack(int fmt, const void *W, int K, int N, float *out) {
    const int panels = (N + NR - 1) / NR;
    const long panel_bytes = (long)(K / QK) * block_bytes(fmt);
    float tmp[QK * NR] __attribute__((aligned(64)));
    for (int p = 0; p < panels; p++)
        for (int k0 = 0; k0 < K; k0 += QK) {
            expand_panel(fmt, (const uint8_t *)W + p * panel_bytes, k0, QK, tmp, NR);
            for (int n = 0; n < NR && p * NR + n < N; n++)
                for (int k = 0; k < QK; k++) out[(long)(p * NR + n) * K + k0 + k] = tmp[k * NR + n];
        }
}
