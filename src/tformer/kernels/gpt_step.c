/* One decoding step (one new token for each of M <= 8 rows) through L pre-LN blocks of a GPT, in one
 * call: the Python between the kernels (module calls, shape checks, views: a large share of GPT-2's token
 * on a 2-core AVX2 CPU; BENCHMARKS.md, "Kernels") is gone, and the threads go from one product to the
 * next without sleeping.
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
#include "simd.h"
#include "kernels.h"

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

/* GELU (tanh): gelu.c's, in place. */
static void activate(float *h, int64_t n, int act) {
    if (act == 1) {
        gelu_tanh(h, h, n);
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
                       1, 0, scale);
        product(W(5), att, P(7), x, M, D, qd, u, 1);
        layer_norm(x, P(8), P(9), h, M, D, eps);
        product(W(10), h, P(12), up, M, F, D, u, 0);
        activate(up, M * F, (int)act);
        product(W(13), up, P(15), x, M, D, F, u, 1);
#undef W
#undef P
    }
}
