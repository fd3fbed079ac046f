/* bf16 weights (the weights rounded, half the bytes to read) through gemv_fp32.c's passes, and greedy
 * decoding's token screened through them: the argmax of x Wᵀ + b, exact, reading the fp32 weights only
 * where the bf16 screen leaves a candidate.
 */
#include "simd.h"
#include "kernels.h"

/* tformer_gemv (gemv_fp32.c) with P in bf16 (uint16 bits): half the bytes to read, each product exact in
 * fp32 (only the weights were rounded), summed in fp32. Where tformer_bf16_paired() is 1, each block's
 * 16 weights of one k are stored in the order of outputs 0, 8, 1, 9, ..., 7, 15 (gemv.pack does it). */
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
