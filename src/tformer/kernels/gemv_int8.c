/* Int8 weights times int8 inputs (decoding a model quantize_int8 made: quant.py's q and scales s).
 * pack8 lays q (N, K) out as blocks of 16 output features by groups of 4 k, then the outputs' sums of q
 * and their scales:
 *
 *     P[b, g, j, i] = q[16 b + j, 4 g + i]   (ceil(N / 16), G = ceil(K / 4), 16, 4) int8, zero past N, K
 *     c[n] = Σ_k q[n, k]  (N rounded up to 16, int32),  then s[n]  (as many, fp32)
 *
 * Each row m of x is rounded to 7 bits on its own range [lo_m, hi_m] = [min(0, min_k x_mk), max(0, max_k x_mk)]:
 *
 *     i_m = 128 / (hi_m - lo_m),  z_m = round(-lo_m i_m),  u_mk = round(x_mk i_m) + z_m  in [0, 129],
 *     y_mn = s_n (Σ_k u_mk q_nk - z_m c_n) / i_m + b_n
 *
 * (a step of (hi - lo) / 128 <= 2 max_k |x_mk| / 128: FBGEMM's dynamic int8 has (hi - lo) / 127).
 * The sum is exact in integers: vpmaddubsw multiplies unsigned bytes (u) by signed ones (q) and adds
 * pairs into int16, |u q + u' q'| <= 2 · 129 · 127 = 32766 < 2^15 (8-bit u could overflow), vpmaddwd
 * adds pairs of those into int32: 64 products for 4 instructions, where fp32 needs 8 multiply-adds and
 * converting the bytes to floats costs as much again (on Zen 1's 128-bit units that capped a weight-only
 * int8 product well below the memory's rate; BENCHMARKS.md, "Kernels"). AVX2 instructions, or AVX-512
 * VNNI where the CPU has it (below).
 */
#include "simd.h"
#include "kernels.h"

#ifdef __AVX512VNNI__
/* With AVX-512 VNNI one vpdpbusd does a block's 64 products (16 outputs x 4 k) and their sums, 4 per
 * output, exactly in int32 (u q <= 129 · 128 < 2^15): a third of the instructions of the AVX2 pair,
 * which matters where the product is compute-bound (64 rows of a beam search). Same sums, same outputs. */
#define ROWS8 8
typedef __m512i acc8;
static inline void zero8(acc8 *s) { s[0] = _mm512_setzero_si512(); }
static inline void load8(__m512i *w, const int8_t *p) { w[0] = _mm512_loadu_si512((const void *)p); }
static inline void madd8(acc8 *s, const __m512i *w, int32_t four) {
    s[0] = _mm512_dpbusd_epi32(s[0], _mm512_set1_epi32(four), w[0]);
}
static inline __m256i half8(const acc8 *s, int h) {
    return h ? _mm512_extracti64x4_epi64(s[0], 1) : _mm512_castsi512_si256(s[0]);
}
#else
#define ROWS8 4
typedef __m256i acc8[2];
static inline void zero8(acc8 *s) { (*s)[0] = (*s)[1] = _mm256_setzero_si256(); }
static inline void load8(__m256i *w, const int8_t *p) {
    w[0] = _mm256_loadu_si256((const __m256i *)p);
    w[1] = _mm256_loadu_si256((const __m256i *)(p + 32));
}
static inline void madd8(acc8 *s, const __m256i *w, int32_t four) {
    const __m256i ones = _mm256_set1_epi16(1), xb = _mm256_set1_epi32(four);
    (*s)[0] = _mm256_add_epi32((*s)[0], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w[0]), ones));
    (*s)[1] = _mm256_add_epi32((*s)[1], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w[1]), ones));
}
static inline __m256i half8(const acc8 *s, int h) { return (*s)[h]; }
#endif

static inline __attribute__((always_inline)) void pass8(const int8_t *p, const uint8_t *u, const float *a,
                                                        const int32_t *z,
                                                        const int32_t *sums, const float *scales,
                                                        const float *bias, float *y, int64_t G, int64_t N,
                                                        int64_t n0, const int M, int acc) {
    acc8 s[ROWS8];
#ifdef __AVX512VNNI__
    __m512i w[1];
#else
    __m256i w[2];
#endif
    for (int m = 0; m < M; m++) zero8(&s[m]);
    for (int64_t g = 0; g < G; g++) {
        _mm_prefetch((const char *)p + g * 64 + 512, _MM_HINT_NTA);     /* Zen 1, M = 1: faster (BENCHMARKS.md) */
        load8(w, p + g * 64);
        for (int m = 0; m < M; m++) {
            int32_t four;
            memcpy(&four, u + m * 4 * G + 4 * g, 4);
            madd8(&s[m], w, four);
        }
    }
    float t[16];
    for (int m = 0; m < M; m++) {
        for (int h = 0; h < 2; h++) {
            __m256i c = _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(sums + n0 + 8 * h)), _mm256_set1_epi32(z[m]));
            __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(half8(&s[m], h), c));
            __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(scales + n0 + 8 * h), _mm256_set1_ps(a[m]));
            _mm256_storeu_ps(t + 8 * h, _mm256_mul_ps(v, sc));
        }
        float *ym = y + m * N + n0;
        for (int64_t j = 0; j < 16 && n0 + j < N; j++) {
            float out = t[j] + (bias ? bias[n0 + j] : 0.0f);
            ym[j] = acc ? ym[j] + out : out;
        }
    }
}

/* Row m of x (K) -> u (4 G bytes, zero past K), its step a[m] = 1 / i_m and zero point z[m]; a[m] is
 * NaN where x holds a NaN or an infinity (so that the outputs are NaN, as the float product's would be),
 * 0 for a row of zeros. */
static void round_rows(const float *x, int64_t M, int64_t K, int64_t G, uint8_t *u, float *a, int32_t *z) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        uint8_t *um = u + m * 4 * G;
        __m256 lo8 = _mm256_setzero_ps(), hi8 = _mm256_setzero_ps(), bad8 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v = _mm256_loadu_ps(xm + k);
            lo8 = _mm256_min_ps(lo8, v);
            hi8 = _mm256_max_ps(hi8, v);
            bad8 = _mm256_add_ps(bad8, _mm256_sub_ps(v, v));                /* NaN from a NaN or an inf */
        }
        float l[8], h[8], b[8], lo = 0.0f, hi = 0.0f, nan = 0.0f;
        _mm256_storeu_ps(l, lo8);
        _mm256_storeu_ps(h, hi8);
        _mm256_storeu_ps(b, bad8);
        for (int i = 0; i < 8; i++) {
            lo = l[i] < lo ? l[i] : lo;
            hi = h[i] > hi ? h[i] : hi;
            nan += b[i];
        }
        for (; k < K; k++) {
            lo = xm[k] < lo ? xm[k] : lo;
            hi = xm[k] > hi ? xm[k] : hi;
            nan += xm[k] - xm[k];
        }
        const float inv = hi > lo && nan == 0.0f ? 128.0f / (hi - lo) : 0.0f;
        const int32_t zero = (int32_t)nearbyintf(-lo * inv);
        a[m] = (inv > 0.0f ? 1.0f / inv : 0.0f) + nan;
        z[m] = zero;
        const __m256 vi = _mm256_set1_ps(inv);
        const __m256i off = _mm256_set1_epi32(zero), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (k = 0; k + 32 <= K; k += 32) {                                 /* round to nearest even, as torch.round */
            __m256i v0 = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xm + k), vi)), off);
            __m256i v1 = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xm + k + 8), vi)), off);
            __m256i v2 = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xm + k + 16), vi)), off);
            __m256i v3 = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xm + k + 24), vi)), off);
            __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3));
            _mm256_storeu_si256((__m256i *)(um + k), _mm256_permutevar8x32_epi32(bytes, order));
        }
        for (; k < K; k++) um[k] = (uint8_t)((int32_t)nearbyintf(xm[k] * inv) + zero);
        for (; k < 4 * G; k++) um[k] = 0;
    }
}

/* y = x Wᵀ + bias (or y += with `acc`), W = s · q packed by pack8 at p; u: 4 G · M bytes of scratch. */
HIDDEN void gemv8(const int8_t *p, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                  uint8_t *u, int acc) {
    const int64_t G = (K + 3) / 4, blocks = (N + 15) / 16;
    const int32_t *sums = (const int32_t *)(p + blocks * G * 64);
    const float *scales = (const float *)(sums + blocks * 16);
    float a[64];
    int32_t z[64];
    for (int64_t m0 = 0; m0 < M; m0 += 64) {
        const int64_t rows = M - m0 < 64 ? M - m0 : 64;
        round_rows(x + m0 * K, rows, K, G, u, a, z);
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t i = 0; i < rows; i += ROWS8) {
                const int8_t *pb = p + b * G * 64;
                const uint8_t *ui = u + i * 4 * G;
                float *yi = y + (m0 + i) * N;
#define ROWS8_CASE(R) case R: pass8(pb, ui, a + i, z + i, sums, scales, bias, yi, G, N, b * 16, R, acc); break;
                switch (rows - i < ROWS8 ? rows - i : ROWS8) {
                    ROWS8_CASE(1) ROWS8_CASE(2) ROWS8_CASE(3) ROWS8_CASE(4)
#if ROWS8 > 4
                    ROWS8_CASE(5) ROWS8_CASE(6) ROWS8_CASE(7) ROWS8_CASE(8)
#endif
                }
#undef ROWS8_CASE
            }
    }
}

void tformer_gemv_int8(const int8_t *p, const float *x, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, uint8_t *scratch) {
    gemv8(p, x, bias, y, M, N, K, scratch, 0);
}
