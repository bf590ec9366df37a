// Sixteen float32 lanes, the kernels' one vector type: one AVX-512 register, or two AVX2 ones.
//
// The kernels are written once against these inline functions and compiled twice (build.py): with
// -mavx512f... each is the single AVX-512 instruction it names; with -mavx2 -mfma -mf16c each does the
// same lane arithmetic on a low and a high half. Every lane is computed by the same operations in the
// same order either way (FMA where the code asks for one, the same horizontal-sum tree), so a build's
// results do not depend on the batch, and the AVX2 build computes what the AVX-512 one does.
//
// Lane masks are 16-bit words (bit i: lane i), as AVX-512's __mmask16 is.

#pragma once
#include <immintrin.h>
#include <stdint.h>

typedef uint16_t lanes16;

#if defined(__AVX512F__)

typedef __m512 vf16;

static inline vf16 vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf16 vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf16 vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf16 v) { _mm512_storeu_ps(p, v); }
static inline vf16 vf_load_masked(lanes16 m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
static inline void vf_store_masked(float *p, lanes16 m, vf16 v) { _mm512_mask_storeu_ps(p, m, v); }
static inline vf16 vf_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
static inline vf16 vf_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
static inline vf16 vf_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
static inline vf16 vf_div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
static inline vf16 vf_max(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
static inline vf16 vf_min(vf16 a, vf16 b) { return _mm512_min_ps(a, b); }
static inline vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }   // a*b + c
static inline vf16 vf_fnmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); } // c - a*b
static inline vf16 vf_round(vf16 x) {  // to the nearest integer, ties to even
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vf16 vf_scale2(vf16 x, vf16 n) { return _mm512_scalef_ps(x, n); }  // x * 2^n, n integral
static inline float vf_sum(vf16 v) { return _mm512_reduce_add_ps(v); }
static inline float vf_hmax(vf16 v) { return _mm512_reduce_max_ps(v); }
static inline vf16 vf_select(lanes16 m, vf16 a, vf16 b) { return _mm512_mask_mov_ps(b, m, a); }  // m ? a : b
static inline lanes16 vf_above_neg_inf(vf16 x) {  // lanes that are not -inf
    return _mm512_cmp_ps_mask(x, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ);
}
// float16 <-> float32 (loads are exact; stores round to nearest even).
static inline vf16 vf_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf16 vf_load_f16_masked(lanes16 m, const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
static inline void vf_store_f16(uint16_t *p, vf16 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
// 16 bytes as unsigned or signed integers.
static inline vf16 vf_from_u8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }
static inline vf16 vf_from_i8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

typedef struct {
    __m256 lo, hi;  // lanes 0..7, 8..15
} vf16;

// A lane mask's 8 bits from `shift` as an AVX2 vector mask (all ones where set).
static inline __m256i lanes_to_vector(lanes16 m, int shift) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((m >> shift) & 0xFF), bit), bit);
}
#define VF_PAIR(lo_expr, hi_expr) ((vf16){(lo_expr), (hi_expr)})

static inline vf16 vf_zero(void) { return VF_PAIR(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf16 vf_set1(float a) { return VF_PAIR(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
static inline vf16 vf_load(const float *p) { return VF_PAIR(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vf_store(float *p, vf16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
// Masked-off lanes are neither read nor written (maskload/maskstore do not fault on them).
static inline vf16 vf_load_masked(lanes16 m, const float *p) {
    return VF_PAIR(_mm256_maskload_ps(p, lanes_to_vector(m, 0)), _mm256_maskload_ps(p + 8, lanes_to_vector(m, 8)));
}
static inline void vf_store_masked(float *p, lanes16 m, vf16 v) {
    _mm256_maskstore_ps(p, lanes_to_vector(m, 0), v.lo);
    _mm256_maskstore_ps(p + 8, lanes_to_vector(m, 8), v.hi);
}
#define VF_LANEWISE(name, op) \
    static inline vf16 name(vf16 a, vf16 b) { return VF_PAIR(op(a.lo, b.lo), op(a.hi, b.hi)); }
VF_LANEWISE(vf_add, _mm256_add_ps)
VF_LANEWISE(vf_sub, _mm256_sub_ps)
VF_LANEWISE(vf_mul, _mm256_mul_ps)
VF_LANEWISE(vf_div, _mm256_div_ps)
VF_LANEWISE(vf_max, _mm256_max_ps)
VF_LANEWISE(vf_min, _mm256_min_ps)
#undef VF_LANEWISE
static inline vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) {
    return VF_PAIR(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf16 vf_fnmadd(vf16 a, vf16 b, vf16 c) {
    return VF_PAIR(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf16 vf_round(vf16 x) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return VF_PAIR(_mm256_round_ps(x.lo, mode), _mm256_round_ps(x.hi, mode));
}
// 2^n built in the exponent field: exact for n in [-126, 127], all the callers ask (exp clamps).
static inline __m256 pow2_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf16 vf_scale2(vf16 x, vf16 n) {
    return VF_PAIR(_mm256_mul_ps(x.lo, pow2_8(n.lo)), _mm256_mul_ps(x.hi, pow2_8(n.hi)));
}
// The tree of GCC's _mm512_reduce_add_ps / _mm512_reduce_max_ps: halves, quarters, pairs, last two.
#define VF_REDUCE(name, op256, op128, op1)                                                          \
    static inline float name(vf16 v) {                                                              \
        const __m256 h = op256(v.hi, v.lo);                                                         \
        const __m128 q = op128(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));             \
        const __m128 p = op128(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));                   \
        return op1(_mm_cvtss_f32(p), _mm_cvtss_f32(_mm_shuffle_ps(p, p, _MM_SHUFFLE(1, 1, 1, 1)))); \
    }
static inline float add1(float a, float b) { return a + b; }
static inline float max1(float a, float b) { return a > b ? a : b; }
VF_REDUCE(vf_sum, _mm256_add_ps, _mm_add_ps, add1)
VF_REDUCE(vf_hmax, _mm256_max_ps, _mm_max_ps, max1)
#undef VF_REDUCE
static inline vf16 vf_select(lanes16 m, vf16 a, vf16 b) {
    return VF_PAIR(_mm256_blendv_ps(b.lo, a.lo, _mm256_castsi256_ps(lanes_to_vector(m, 0))),
                   _mm256_blendv_ps(b.hi, a.hi, _mm256_castsi256_ps(lanes_to_vector(m, 8))));
}
static inline lanes16 vf_above_neg_inf(vf16 x) {
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    return (lanes16)(_mm256_movemask_ps(_mm256_cmp_ps(x.lo, ninf, _CMP_NEQ_OQ)) |
                     _mm256_movemask_ps(_mm256_cmp_ps(x.hi, ninf, _CMP_NEQ_OQ)) << 8);
}
static inline vf16 vf_load_f16(const uint16_t *p) {
    return VF_PAIR(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                   _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}
// Masked-off lanes read as 0 and are not touched in memory (a segment's tail may end an array).
static inline vf16 vf_load_f16_masked(lanes16 m, const uint16_t *p) {
    if (m == 0xFFFF) return vf_load_f16(p);
    uint16_t lanes[16] = {0};
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) lanes[i] = p[i];
    return vf_load_f16(lanes);
}
static inline void vf_store_f16(uint16_t *p, vf16 v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v.lo, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(v.hi, _MM_FROUND_TO_NEAREST_INT));
}
static inline vf16 vf_from_u8(__m128i q) {
    return VF_PAIR(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q))));
}
static inline vf16 vf_from_i8(__m128i q) {
    return VF_PAIR(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                   _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q))));
}
#undef VF_PAIR

#else
#error "the kernels need AVX-512 (F, BW, VL, DQ) or AVX2 with FMA and F16C: see build.py"
#endif
