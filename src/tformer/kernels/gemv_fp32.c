/* y = x Wᵀ + b for a few rows of x (decoding, short prompts), fp32, AVX-512 or AVX2: reads W once, at
 * the memory's rate. The same passes read bf16 weights (gemv_bf16.c); int8 ones: gemv_int8.c.
 *
 * Built with the library's other sources by tformer/kernels/build.py (`main()`, which make runs) for the
 * widest vectors the CPU has (simd.h), loaded with ctypes. W (N, K) is first packed into blocks of 16
 * output features, each block K x 16 floats and contiguous:
 *
 *     P[b, k, j] = W[16 b + j, k]          (N rounded up to 16; the extra rows are zero)
 *
 * so each thread reads its blocks front to back, 64 bytes (one AVX-512 register, two AVX2 ones) per
 * (k, block), and multiplies them by x[m, k] broadcast, for up to ROWS rows m at once; the next rows
 * reuse the blocks from the core's cache, so W is read from memory once for all M rows.
 * One or two rows: a pass covers one block, with two chains of partial sums (even and odd k) to
 * hide the latency of the fused multiply-add. Three rows or more with AVX-512: a pass covers two
 * neighbouring blocks, so each broadcast of x[m, k] feeds two multiply-adds (one per multiply-add, the
 * broadcasts, not the memory, limit 8 rows; BENCHMARKS.md, "Kernels"); AVX2 has
 * half the registers, and takes 4 rows of one block at a time.
 * Threads: OpenMP over the passes; the library links libgomp.so.1, which resolves to the copy
 * PyTorch has already loaded, so torch.set_num_threads applies and no second thread pool exists.
 */
#include "simd.h"
#include "kernels.h"

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
HIDDEN void pass_rows(const void *p, const float *x, float *y, const float *bias, int64_t M, int64_t N,
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
HIDDEN void gemv(const void *p, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
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
