/* y = x Wᵀ + b for a few rows of x (decoding, short prompts), fp32, AVX-512 or AVX2: reads W once, at
 * the memory's rate (and the same for bf16 and int8 weights, below).
 *
 * Built by tformer/gemv.py (`tformer.kernels.gemv.main()`, which make runs) for the widest vectors the CPU
 * has, loaded with ctypes. W (N, K) is first packed into blocks of 16 output features, each block
 * K x 16 floats and contiguous:
 *
 *     P[b, k, j] = W[16 b + j, k]          (N rounded up to 16; the extra rows are zero)
 *
 * so each thread reads its blocks front to back, 64 bytes (one AVX-512 register, two AVX2 ones) per
 * (k, block), and multiplies them by x[m, k] broadcast, for up to ROWS rows m at once; the next rows
 * reuse the blocks from the core's cache, so W is read from memory once for all M rows.
 * One or two rows: a pass covers one block, with two chains of partial sums (even and odd k) to
 * hide the latency of the fused multiply-add. Three rows or more with AVX-512: a pass covers two
 * neighbouring blocks, so each broadcast of x[m, k] feeds two multiply-adds (one per multiply-add, the
 * broadcasts, not the memory, limit 8 rows: GPT-2's matrices 22 -> 18 ms, BENCHMARKS.md); AVX2 has
 * half the registers, and takes 4 rows of one block at a time.
 * Threads: OpenMP over the passes; the library links libgomp.so.1, which resolves to the copy
 * PyTorch has already loaded, so torch.set_num_threads applies and no second thread pool exists.
 */
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
 * capped the bf16 product at 10.7 GB/s, against 17.8 for fp32). */
#define BF16_PAIRED 1
/* Bytes ahead that the 1-2 row pass asks for the bf16 blocks (one cache line per 2 k): on Zen 1 the
 * screen of GPT-2's output layer 13.8 -> 15.0 GB/s (median of 40, read probe 16.3); fp32 blocks read
 * slower with it (not measured on AVX-512 CPUs: 0 there). */
#define BF16_PREFETCH 1024
static inline void load16_bf16(vec *w, const uint16_t *p) {
    __m256i r = _mm256_loadu_si256((const __m256i *)p);
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
    w[1] = _mm256_and_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
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

/* Weights i .. i + 15 of a packed matrix: fp32, or bf16 widened exactly to fp32. */
static inline __attribute__((always_inline)) void load16(vec *w, const void *p, int64_t i, const int bf16) {
    if (bf16)
        load16_bf16(w, (const uint16_t *)p + i);
    else
        for (int v = 0; v < PER_BLOCK; v++) w[v] = vload((const float *)p + i + v * LANES);
}

/* 16 floats to y (added to what y holds with `acc`), of which only the first `left` where the matrix
 * ends inside the block. */
static inline void store16(float *y, vec *a, int64_t left, int acc) {
    if (left >= 16) {
        for (int v = 0; v < PER_BLOCK; v++) vstore(y + v * LANES, acc ? vadd(a[v], vload(y + v * LANES)) : a[v]);
        return;
    }
    float tmp[16];
    for (int v = 0; v < PER_BLOCK; v++) vstore(tmp + v * LANES, a[v]);
    for (int64_t j = 0; j < left; j++) y[j] = acc ? y[j] + tmp[j] : tmp[j];
}

/* The bias of outputs n0 .. n0 + 15 (zero past N, or without a bias). */
static inline void bias16(vec *b, const float *bias, int64_t N, int64_t n0) {
    float tmp[16] = {0};
    if (bias)
        for (int64_t j = 0; j < 16 && n0 + j < N; j++) tmp[j] = bias[n0 + j];
    for (int v = 0; v < PER_BLOCK; v++) b[v] = vload(tmp + v * LANES);
}

/* M <= MAX_M rows times one block (two = 0) or the blocks at p and p + K·16 (two = 1): outputs n0 ..
 * n0 + 15 (.. n0 + 31), past N left unwritten. Weights fp32, or bf16 (bf16 = 1). */
static inline __attribute__((always_inline)) void pass(const void *p, const float *x, float *y,
                                                       const float *bias, int64_t K, int64_t N,
                                                       int64_t n0, const int M, const int two, const int bf16, int acc) {
    vec a[MAX_M][PER_BLOCK], c[MAX_M][PER_BLOCK];     /* one block: even / odd k; two: first / second block */
    vec ba[PER_BLOCK], bc[PER_BLOCK], w0[PER_BLOCK], w1[PER_BLOCK];
    const void *q = (const char *)p + K * 16 * (bf16 ? 2 : 4);
    bias16(ba, bias, N, n0);
    bias16(bc, two ? bias : 0, N, n0 + 16);
    for (int m = 0; m < M; m++)
        for (int v = 0; v < PER_BLOCK; v++) {
            a[m][v] = ba[v];
            c[m][v] = two ? bc[v] : vzero();
        }
    if (two) {
        for (int64_t k = 0; k < K; k++) {
            load16(w0, p, k * 16, bf16);
            load16(w1, q, k * 16, bf16);
            for (int m = 0; m < M; m++) {
                vec xb = vset1(x[m * K + k]);
                for (int v = 0; v < PER_BLOCK; v++) {
                    a[m][v] = vfmadd(w0[v], xb, a[m][v]);
                    c[m][v] = vfmadd(w1[v], xb, c[m][v]);
                }
            }
        }
        for (int m = 0; m < M; m++) store16(y + m * N + n0 + 16, c[m], N - n0 - 16, acc);
    } else if (M <= 2) {
        int64_t k = 0;
        for (; k + 2 <= K; k += 2) {
            if (bf16 && BF16_PREFETCH) _mm_prefetch((const char *)p + k * 32 + BF16_PREFETCH, _MM_HINT_T0);
            load16(w0, p, k * 16, bf16);
            load16(w1, p, (k + 1) * 16, bf16);
            for (int m = 0; m < M; m++) {
                vec x0 = vset1(x[m * K + k]), x1 = vset1(x[m * K + k + 1]);
                for (int v = 0; v < PER_BLOCK; v++) {
                    a[m][v] = vfmadd(w0[v], x0, a[m][v]);
                    c[m][v] = vfmadd(w1[v], x1, c[m][v]);
                }
            }
        }
        if (k < K) {
            load16(w0, p, k * 16, bf16);
            for (int m = 0; m < M; m++)
                for (int v = 0; v < PER_BLOCK; v++) a[m][v] = vfmadd(w0[v], vset1(x[m * K + k]), a[m][v]);
        }
        for (int m = 0; m < M; m++)
            for (int v = 0; v < PER_BLOCK; v++) a[m][v] = vadd(a[m][v], c[m][v]);
    } else {
        for (int64_t k = 0; k < K; k++) {
            load16(w0, p, k * 16, bf16);
            for (int m = 0; m < M; m++) {
                vec xb = vset1(x[m * K + k]);
                for (int v = 0; v < PER_BLOCK; v++) a[m][v] = vfmadd(w0[v], xb, a[m][v]);
            }
        }
    }
    for (int m = 0; m < M; m++) store16(y + m * N + n0, a[m], N - n0, acc);
}

#define ROWS(R)                                                                 \
    case R:                                                                     \
        if (two && bf16)                                                        \
            pass(p, x + m0 * K, y + m0 * N, bias, K, N, n0, R, 1, 1, acc);           \
        else if (two)                                                           \
            pass(p, x + m0 * K, y + m0 * N, bias, K, N, n0, R, 1, 0, acc);           \
        else if (bf16)                                                          \
            pass(p, x + m0 * K, y + m0 * N, bias, K, N, n0, R, 0, 1, acc);           \
        else                                                                    \
            pass(p, x + m0 * K, y + m0 * N, bias, K, N, n0, R, 0, 0, acc);           \
        break;

/* All M rows times the block(s) of one pass, MAX_M rows at a time: the blocks come from memory for
 * the first rows and from the core's cache for the next. */
static void pass_rows(const void *p, const float *x, float *y, const float *bias, int64_t M, int64_t N,
                      int64_t K, int64_t n0, int two, int bf16, int acc) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        switch (M - m0 < MAX_M ? M - m0 : MAX_M) {
            ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#if MAX_M > 4
            ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#endif
        }
    }
}

/* y = x Pᵀ + bias, or y += x Pᵀ + bias with `acc`. */
static void gemv(const void *p, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                 int bf16, int acc) {
    int64_t blocks = (N + 15) / 16, width = TWO_BLOCKS && M >= 3 ? 2 : 1, passes = (blocks + width - 1) / width;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < passes; i++) {
        int64_t b = i * width;
        pass_rows((const char *)p + b * K * 16 * (bf16 ? 2 : 4), x, y, bias, M, N, K, b * 16,
                  width == 2 && b + 1 < blocks, bf16, acc);
    }
}

/* x (M, K), P (ceil(N / 16), K, 16), bias (N) or NULL, y (M, N); all contiguous fp32; M >= 1 (a few
 * dozen at most, so that x stays in the core's cache while the blocks stream by). */
void tformer_gemv(const float *p, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    gemv(p, x, bias, y, M, N, K, 0, 0);
}

/* The same with P in bf16 (uint16 bits): half the bytes to read, each product exact in fp32 (only the
 * weights were rounded), summed in fp32. Where tformer_bf16_paired() is 1, each block's 16 weights of
 * one k are stored in the order of outputs 0, 8, 1, 9, ..., 7, 15 (gemv.pack does it). */
int tformer_bf16_paired(void) { return BF16_PAIRED; }

void tformer_gemv_bf16(const uint16_t *p, const float *x, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K) {
    gemv(p, x, bias, y, M, N, K, 1, 0);
}

/* Greedy decoding's token: for each of M <= ARGMAX_ROWS rows of x, the index of the largest output
 * of x Wᵀ + bias (the first of equals), reading W rounded to bf16 (`screen`) and only the fp32 blocks
 * (`p`, W packed by gemv.pack) that can hold it. linear.Gemv.argmax gives the bound:
 *
 *     ỹ = x W̃ᵀ + b (the screen, into `rough`, M x N),  reach_j = ‖x‖₁ slack_j + r |b_j|,
 *     floor = max_j (ỹ_j - reach_j);  candidates: ỹ_j + reach_j >= floor.
 *
 * Each pair of blocks that holds a candidate is multiplied exactly, in increasing order, by the very
 * passes gemv() makes there (so bit for bit the full product's outputs). Returns 0, or -1 when a row
 * or its screen is not finite (the caller then takes all the outputs). */
#define ARGMAX_ROWS 8

static inline vec reach_of(vec l1, const float *slack, const float *bias, vec r, int64_t j) {
    vec reach = vmul(l1, vload(slack + j));
    if (bias) {
        vec b = vload(bias + j);
        reach = vadd(reach, vmul(r, vmax(b, vsub(vzero(), b))));
    }
    return reach;
}

static inline float reach1(float l1, const float *slack, const float *bias, float r, int64_t j) {
    return l1 * slack[j] + (bias ? r * fabsf(bias[j]) : 0.0f);
}

int tformer_argmax_bf16(const uint16_t *screen, const float *p, const float *slack, const float *x,
                        const float *bias, float r, int64_t M, int64_t N, int64_t K, float *rough, int64_t *best) {
    float l1[ARGMAX_ROWS], floor[ARGMAX_ROWS], top[ARGMAX_ROWS], exact[ARGMAX_ROWS * 32];
    if (M < 1 || M > ARGMAX_ROWS) return -1;
    for (int64_t m = 0; m < M; m++) {
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++) s += fabsf(x[m * K + k]);
        if (!isfinite(s)) return -1;
        l1[m] = s;
    }
    gemv(screen, x, bias, rough, M, N, K, 1, 0);
    const vec rv = vset1(r);
    const int64_t whole = N / LANES * LANES;
    for (int64_t m = 0; m < M; m++) {                /* the floor; `bad` turns NaN if any ỹ is not finite */
        const float *y = rough + m * N;
        vec f = vset1(-INFINITY), bad = vzero(), l = vset1(l1[m]);
        for (int64_t j = 0; j < whole; j += LANES) {
            vec v = vload(y + j);
            f = vmax(f, vsub(v, reach_of(l, slack, bias, rv, j)));
            bad = vadd(bad, vsub(v, v));
        }
        float lanes[LANES], fs = -INFINITY, bads = vsum(bad);
        vstore(lanes, f);
        for (int i = 0; i < LANES; i++) fs = fmaxf(fs, lanes[i]);
        for (int64_t j = whole; j < N; j++) {
            fs = fmaxf(fs, y[j] - reach1(l1[m], slack, bias, r, j));
            bads += y[j] - y[j];
        }
        if (!isfinite(fs) || !isfinite(bads)) return -1;
        floor[m] = fs;
        top[m] = -INFINITY;
        best[m] = 0;
    }
    const int64_t blocks = (N + 15) / 16;
    const int two = TWO_BLOCKS && M >= 3;
    for (int64_t n0 = 0; n0 < N; n0 += 32) {             /* pairs of blocks, as gemv()'s passes hold them */
        const int64_t n = N - n0 < 32 ? N - n0 : 32;
        float hi[ARGMAX_ROWS][32];                         /* ỹ + reach, computed as for the floor */
        int hit = 0;
        for (int64_t m = 0; m < M; m++) {
            const vec l = vset1(l1[m]);
            for (int64_t j = 0; j < n; j += LANES)
                if (n0 + j + LANES <= N)
                    vstore(hi[m] + j, vadd(vload(rough + m * N + n0 + j), reach_of(l, slack, bias, rv, n0 + j)));
                else
                    for (int64_t i = j; i < n; i++)
                        hi[m][i] = rough[m * N + n0 + i] + reach1(l1[m], slack, bias, r, n0 + i);
            for (int64_t j = 0; j < n; j++) hit |= hi[m][j] >= floor[m];
        }
        if (!hit) continue;
        const char *q = (const char *)p + n0 * K * 4;             /* blocks n0 / 16 and n0 / 16 + 1 */
        const float *bq = bias ? bias + n0 : 0;
        if (two)
            pass_rows(q, x, exact, bq, M, n, K, 0, n0 / 16 + 1 < blocks, 0, 0);
        else
            for (int64_t b = 0; 16 * b < n; b++) pass_rows(q + 16 * b * K * 4, x, exact, bq, M, n, K, 16 * b, 0, 0, 0);
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < n; j++) {
                float y = exact[m * n + j];
                if (hi[m][j] >= floor[m] && (y > top[m] || (y == top[m] && n0 + j < best[m]))) {
                    top[m] = y;
                    best[m] = n0 + j;
                }
            }
    }
    return 0;
}

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
 * int8 product at ~10 GB/s). AVX2 instructions, or AVX-512 VNNI where the CPU has it (below).
 */
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
        _mm_prefetch((const char *)p + g * 64 + 512, _MM_HINT_NTA);     /* Zen 1, M = 1: 14 -> 16.5 GB/s */
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
static void gemv8(const int8_t *p, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
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

/* Decoding attention: one query per (row, head) against that row's cached keys and values,
 *
 *     s_j = scale q·k_j (-inf where the mask is 0),  p = softmax(s),  o = Σ_j p_j v_j,
 *
 * for every row b < B and head h < H, in one call: PyTorch's batched products pay about a
 * microsecond of dispatch per (row, head), 512 of them in a beam search of 16 sentences x 4 beams x 8
 * heads. Row b reads keys and values of row b / copies (the beams of one source share its encoder
 * keys), head h those of head h / (H / H_kv) (grouped-query attention); the mask row is b / mask_div.
 * q, k, v are strided views (element strides per row, head and, for k and v, position; the head
 * dimension is contiguous), the mask is bytes (1 = may attend) or NULL, out is (B, H, hd) contiguous,
 * hd a multiple of 16 up to 256, T_k up to 16384. A query that may attend to no key gets 0.
 * With `lineage` (beam search; copies = 1), position j of row b is held by row lineage[b, j] (a beam
 * reads its ancestors' keys where they were written, instead of the cache being copied into beam order
 * at every step).
 */
#define MAX_HD 256
#define MAX_TK 16384

void tformer_attend(const float *q, int64_t qsb, int64_t qsh,
                    const float *k, const float *v, int64_t ksb, int64_t ksh, int64_t kst,
                    int64_t vsb, int64_t vsh, int64_t vst,
                    const uint8_t *mask, int64_t msb, int64_t mst, int64_t mask_div,
                    const int32_t *lineage, int64_t lsb, float *out, int64_t B, int64_t H, int64_t H_kv, int64_t T_k, int64_t hd,
                    int64_t copies, float scale) {
    const int64_t group = H / H_kv, nv = hd / LANES;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < B * H; task++) {
        const int64_t b = task / H, h = task % H;
        const float *qb = q + b * qsb + h * qsh;
        const float *kb = k + (b / copies) * ksb + (h / group) * ksh;
        const float *vb = v + (b / copies) * vsb + (h / group) * vsh;
        const uint8_t *mb = mask ? mask + (b / mask_div) * msb : 0;
        const int32_t *lb = lineage ? lineage + b * lsb : 0;     /* key j is then row lb[j]'s, not row b's */
        float s[MAX_TK], top = -INFINITY, sum = 0.0f;
        vec qv[MAX_HD / LANES], acc[MAX_HD / LANES];
        for (int64_t i = 0; i < nv; i++) {
            qv[i] = vmul(vload(qb + LANES * i), vset1(scale));
            acc[i] = vzero();
        }
        for (int64_t j = 0; j < T_k; j++) {
            if (mb && !mb[j * mst]) {
                s[j] = -INFINITY;
                continue;
            }
            const float *kj = kb + j * kst + (lb ? (lb[j] - b) * ksb : 0);
            vec d = vmul(qv[0], vload(kj));
            for (int64_t i = 1; i < nv; i++) d = vfmadd(qv[i], vload(kj + LANES * i), d);
            s[j] = vsum(d);
            top = s[j] > top ? s[j] : top;
        }
        float *o = out + task * hd;
        if (top == -INFINITY) {                                 /* nothing to attend to */
            for (int64_t i = 0; i < nv; i++) vstore(o + LANES * i, vzero());
            continue;
        }
        for (int64_t j = 0; j < T_k; j += LANES) {              /* s_j -> e^(s_j - top), 0 for masked keys */
            float e[LANES];
            if (j + LANES <= T_k)
                vstore(e, vexp(vsub(vload(s + j), vset1(top))));
            for (int64_t i = 0; i < LANES && j + i < T_k; i++)
                s[j + i] = s[j + i] == -INFINITY ? 0.0f : j + LANES <= T_k ? e[i] : expf(s[j + i] - top);
        }
        for (int64_t j = 0; j < T_k; j++) {
            float p = s[j];
            sum += p;
            if (p == 0.0f) continue;
            const float *vj = vb + j * vst + (lb ? (lb[j] - b) * vsb : 0);
            vec pb = vset1(p);
            for (int64_t i = 0; i < nv; i++) acc[i] = vfmadd(pb, vload(vj + LANES * i), acc[i]);
        }
        vec inv = vset1(1.0f / sum);
        for (int64_t i = 0; i < nv; i++) vstore(o + LANES * i, vmul(acc[i], inv));
    }
}

/* One decoding step (one new token for each of M <= 8 rows) through L pre-LN blocks of a GPT, in one
 * call: the Python between the kernels (module calls, shape checks, views: ~5 ms of GPT-2's ~20 ms token
 * on a 2-core AVX2 CPU) is gone, and the threads go from one product to the next without sleeping.
 * Per layer, with x (M, D) the residual stream, updated in place:
 *
 *     h = LayerNorm1(x);  q, k, v = h W_qkvᵀ + b;  K, V caches[pos] = k, v
 *     x += attend(q, K, V) W_oᵀ + b_o                  (heads side by side; H_kv <= H heads of K, V)
 *     h = LayerNorm2(x);  x += act(h W_upᵀ + b_up) W_downᵀ + b_down
 *
 * `table` holds 18 addresses per layer: LayerNorm1 weight, bias; W_qkv packed, its type (0 fp32 by
 * pack, 1 int8 by pack8), b_qkv; W_o, type, b_o; LayerNorm2 weight, bias; W_up, type, b_up; W_down,
 * type, b_down; K cache, V cache (each (rows, H_kv, T_max, hd), contiguous). A bias may be 0 (none).
 * act: 0 GELU (erf), 1 GELU (tanh), 2 ReLU.
 * Each product is the same kernel call as gemv(), so the results match the layer-by-layer path up to
 * the order of LayerNorm's and GELU's floating-point operations.
 */
static void layer_norm(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t D, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * D;
        float *ym = y + m * D;
        double mean = 0.0, var = 0.0;
        for (int64_t i = 0; i < D; i++) mean += xm[i];
        mean /= D;
        for (int64_t i = 0; i < D; i++) var += (xm[i] - mean) * (xm[i] - mean);
        float inv = (float)(1.0 / sqrt(var / D + eps)), mu = (float)mean;
        for (int64_t i = 0; i < D; i++) ym[i] = (xm[i] - mu) * inv * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
    }
}

/* GELU (tanh) = 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = √(2/π) (x + 0.044715 x³): one exp, in
 * vectors (tanhf one value at a time took ~0.3 ms of GPT-2's token); the rest one value at a time. */
static void activate(float *h, int64_t n, int act) {
    if (act == 1) {
        const int64_t vectors = n / LANES;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < vectors; i++) {
            vec x = vload(h + LANES * i);
            vec u = vmul(vmul(x, vset1(-2.0f * 0.7978845608028654f)), vfmadd(vmul(x, x), vset1(0.044715f), vset1(1.0f)));
            vstore(h + LANES * i, vdiv(x, vadd(vset1(1.0f), vexp(u))));
        }
        for (int64_t i = LANES * vectors; i < n; i++)
            h[i] = h[i] / (1.0f + expf(-2.0f * 0.7978845608028654f * h[i] * (1.0f + 0.044715f * h[i] * h[i])));
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float x = h[i];
        h[i] = act == 2 ? (x > 0.0f ? x : 0.0f) : 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
    }
}

/* y (+)= x Wᵀ + bias, W packed fp32 (int8 = 0) or by pack8 (int8 = 1; u its scratch). */
static void product(const void *p, int int8, const float *x, const float *bias, float *y, int64_t M, int64_t N,
                    int64_t K, uint8_t *u, int acc) {
    if (int8)
        gemv8(p, x, bias, y, M, N, K, u, acc);
    else
        gemv(p, x, bias, y, M, N, K, 0, acc);
}

void tformer_gpt_step(const int64_t *table, int64_t L, float *x, int64_t M, int64_t D, int64_t H, int64_t H_kv,
                      int64_t hd, int64_t F, int64_t T_max, int64_t pos, float eps, int64_t act, float scale,
                      float *scratch) {
    const int64_t qd = H * hd, kvd = H_kv * hd, width = qd + 2 * kvd;
    const int64_t sb = H_kv * T_max * hd, sh = T_max * hd;                /* cache strides: row, head */
    float *h = scratch, *qkv = h + M * D, *att = qkv + M * width, *up = att + M * qd;   /* M (D + width + qd + F) */
    uint8_t *u = (uint8_t *)(up + M * F);                                 /* and M (max(D, qd, F) + 3) bytes */
    for (int64_t l = 0; l < L; l++) {
        const int64_t *t = table + 18 * l;
#define P(i) ((const float *)t[i])
#define W(i) (const void *)t[i], (int)t[i + 1]          /* a matrix and its type */
        float *kc = (float *)t[16], *vc = (float *)t[17];
        layer_norm(x, P(0), P(1), h, M, D, eps);
        product(W(2), h, P(4), qkv, M, width, D, u, 0);
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < H_kv; g++) {
                memcpy(kc + m * sb + g * sh + pos * hd, qkv + m * width + qd + g * hd, hd * sizeof(float));
                memcpy(vc + m * sb + g * sh + pos * hd, qkv + m * width + qd + kvd + g * hd, hd * sizeof(float));
            }
        tformer_attend(qkv, width, hd, kc, vc, sb, sh, hd, sb, sh, hd, 0, 0, 0, 1, 0, 0, att, M, H, H_kv, pos + 1, hd,
                       1, scale);
        product(W(5), att, P(7), x, M, D, qd, u, 1);
        layer_norm(x, P(8), P(9), h, M, D, eps);
        product(W(10), h, P(12), up, M, F, D, u, 0);
        activate(up, M * F, (int)act);
        product(W(13), up, P(15), x, M, D, F, u, 1);
#undef W
#undef P
    }
}
