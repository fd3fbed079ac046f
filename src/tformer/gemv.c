/* y = x Wᵀ + b for a few rows of x (decoding, short prompts), fp32, AVX-512: reads W once, at the
 * memory's rate.
 *
 * Built by tformer/gemv.py (`tformer.gemv.main()`, which make runs), loaded with ctypes. W (N, K) is first
 * packed into blocks of 16 output features, each block K x 16 floats and contiguous:
 *
 *     P[b, k, j] = W[16 b + j, k]          (N rounded up to 16; the extra rows are zero)
 *
 * so each thread reads one stream of memory front to back, 64 bytes (one register) per (k, block),
 * and multiplies it by x[m, k] broadcast, for 8 rows m at once; the next 8 rows reuse the block from
 * the core's cache, so W is read from memory once for all M rows.
 * Two chains of partial sums per row (even and odd k) hide the latency of the fused multiply-add.
 * Threads: OpenMP over the blocks; the library links libgomp.so.1, which resolves to the copy
 * PyTorch has already loaded, so torch.set_num_threads applies and no second thread pool exists.
 */
#include <immintrin.h>
#include <stdint.h>

#define MAX_M 8

static inline __attribute__((always_inline)) void block(const float *p, const float *x, float *y,
                                                        const float *bias, int64_t K, int64_t N,
                                                        int64_t n0, const int M) {
    __m512 even[MAX_M], odd[MAX_M];
    int64_t left = N - n0;
    __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < M; m++) {
        even[m] = b;
        odd[m] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
        __m512 w0 = _mm512_loadu_ps(p + k * 16), w1 = _mm512_loadu_ps(p + (k + 1) * 16);
        for (int m = 0; m < M; m++) {
            even[m] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[m * K + k]), even[m]);
            odd[m] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[m * K + k + 1]), odd[m]);
        }
    }
    if (k < K) {
        __m512 w0 = _mm512_loadu_ps(p + k * 16);
        for (int m = 0; m < M; m++) even[m] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[m * K + k]), even[m]);
    }
    for (int m = 0; m < M; m++) _mm512_mask_storeu_ps(y + m * N + n0, mask, _mm512_add_ps(even[m], odd[m]));
}

#define ROWS(R) \
    case R:      \
        block(p, x + m0 * K, y + m0 * N, bias, K, N, n0, R); \
        break;

/* One block of 16 outputs for all M rows, 8 rows at a time: the block (K x 64 bytes) comes from
 * memory for the first 8 and from the core's cache for the next. */
static void block_rows(const float *p, const float *x, float *y, const float *bias, int64_t M, int64_t N,
                       int64_t K, int64_t n0) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        switch (M - m0 < MAX_M ? M - m0 : MAX_M) {
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
        }
    }
}

/* x (M, K), P (ceil(N / 16), K, 16), bias (N) or NULL, y (M, N); all contiguous fp32; M >= 1 (a few
 * dozen at most, so that x stays in the core's cache while the blocks stream by). */
void tformer_gemv(const float *p, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    int64_t blocks = (N + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) block_rows(p + b * K * 16, x, y, bias, M, N, K, b * 16);
}
