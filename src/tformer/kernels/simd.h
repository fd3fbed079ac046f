/* The vectors every source of tformer's kernel library shares: `vec` is 16 floats (AVX-512) or 8 (AVX2 +
 * FMA), the operations on it under one name for both widths, bf16 weights widened to fp32, a vector's
 * sum and e^x. build.py compiles the library for the CPU's widest vectors (flags()): __AVX512F__ picks
 * the width here (and __AVX512VNNI__ the int8 product's instructions in gemv_int8.c).
 */
#ifndef TFORMER_SIMD_H
#define TFORMER_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
/* The vector: 16 floats (AVX-512) or 8 (AVX2 + FMA); a block of 16 outputs is PER_BLOCK of them. */
#ifdef __AVX512F__
#define LANES 16
#define MAX_M 8
#define TWO_BLOCKS 1
typedef __m512 vec;
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vmul _mm512_mul_ps
#define vfmadd _mm512_fmadd_ps
#define vsub _mm512_sub_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vdiv _mm512_div_ps
#define vfnmadd _mm512_fnmadd_ps
#define vround(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vscale2(p, n) _mm512_scalef_ps(p, n)
#define BF16_PAIRED 0
#define BF16_PREFETCH 0
static inline void load16_bf16(vec *w, const uint16_t *p) {      /* a bf16 is the top half of its fp32 */
    w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline float vmaxall(vec v) { return _mm512_reduce_max_ps(v); }
static inline vec vload_bf16(const uint16_t *p) {                  /* LANES bf16 values widened, in order */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#else
#define LANES 8
#define MAX_M 4
#define TWO_BLOCKS 0
typedef __m256 vec;
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vmul _mm256_mul_ps
#define vfmadd _mm256_fmadd_ps
#define vsub _mm256_sub_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vdiv _mm256_div_ps
#define vfnmadd _mm256_fnmadd_ps
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vscale2(p, n) _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)))
/* bf16 blocks are packed in pairs (outputs j and 8 + j side by side, BF16_PAIRED): each 32-bit lane of
 * one load holds two weights, the low one shifted up and the high one masked are both exact fp32, two
 * in-lane operations for 16 weights (widening 8 at a time crosses lanes: on Zen 1's 128-bit units that
 * capped the bf16 product well below fp32's read rate; BENCHMARKS.md, "Kernels"). */
#define BF16_PAIRED 1
/* Bytes ahead that the 1-2 row pass asks for the bf16 blocks (one cache line per 2 k): on Zen 1 the
 * screen of GPT-2's output layer reads faster with it (BENCHMARKS.md, "Kernels"); fp32 blocks read
 * slower with it (not measured on AVX-512 CPUs: 0 there). */
#define BF16_PREFETCH 1024
static inline void load16_bf16(vec *w, const uint16_t *p) {
    __m256i r = _mm256_loadu_si256((const __m256i *)p);
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
    w[1] = _mm256_and_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline vec vload_bf16(const uint16_t *p) {                  /* LANES bf16 values widened, in order */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vmaxall(vec v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif
#define PER_BLOCK (16 / LANES)

/* e^x for x in [-87, 88] (clamped there; NaN gives NaN), within 2 ulps: x = n ln 2 + r, |r| <= ln 2 / 2 (ln 2 in two
 * parts), e^r by Cephes' expf polynomial, times 2^n (at the clamp n = -126 and e^r > 1: the result stays normal). */
static inline vec vexp(vec x) {
    x = vmin(vset1(88.0f), vmax(vset1(-87.0f), x));               /* NaN stays NaN: min/max return it */
    vec n = vround(vmul(x, vset1(1.44269504088896341f)));
    vec r = vfnmadd(n, vset1(0.693359375f), x);
    r = vfnmadd(n, vset1(-2.12194440e-4f), r);
    vec p = vset1(1.9875691500e-4f);
    p = vfmadd(p, r, vset1(1.3981999507e-3f));
    p = vfmadd(p, r, vset1(8.3334519073e-3f));
    p = vfmadd(p, r, vset1(4.1665795894e-2f));
    p = vfmadd(p, r, vset1(1.6666665459e-1f));
    p = vfmadd(p, r, vset1(5.0000001201e-1f));
    return vscale2(vfmadd(p, vmul(r, r), vadd(r, vset1(1.0f))), n);
}

/* One bf16 value to fp32 (exact) and back (round to nearest even; a NaN stays a NaN). */
static inline float bf16_to_float(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#endif
