/* RMSNorm for training, forward and backward, each in one pass over the rows (layers.RMSNorm):
 *
 *     r = 1 / sqrt(mean_i x_i^2 + eps),   y_i = x_i r w_i
 *     dL/dx_i = r (g_i w_i) - x_i r^3 / d · Σ_j g_j w_j x_j,   dL/dw_i = Σ_rows g_i x_i r
 *
 * PyTorch 2.13's CPU rms_norm is a composite (pow, mean, rsqrt, two multiplies) and its backward as many
 * ops again, each a pass over the activations: ~3x LayerNorm's fused kernel on a small Llama's (16, 128, 128)
 * (BENCHMARKS.md, "Demo"). x, y, g, dx are (rows, d) contiguous fp32; r (rows) is kept from the forward for
 * the backward. The weight's gradient is summed per thread into `dw_parts` (threads x d; the caller adds
 * them up; zeros on entry), so no two threads write one place.
 */
#include <omp.h>
#include "simd.h"
#include "kernels.h"

static inline float sum_squares(const float *x, int64_t d) {
    vec acc = vzero();
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES) acc = vfmadd(vload(x + i), vload(x + i), acc);
    float s = vsum(acc);
    for (; i < d; i++) s += x[i] * x[i];
    return s;
}

void tformer_rmsnorm(const float *x, const float *w, float *y, float *r, int64_t rows, int64_t d, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < rows; m++) {
        const float *xm = x + m * d;
        float *ym = y + m * d;
        const float rm = 1.0f / sqrtf(sum_squares(xm, d) / (float)d + eps);
        r[m] = rm;
        const vec rv = vset1(rm);
        int64_t i = 0;
        for (; i + LANES <= d; i += LANES) vstore(ym + i, vmul(vmul(vload(xm + i), rv), vload(w + i)));
        for (; i < d; i++) ym[i] = xm[i] * rm * w[i];
    }
}

void tformer_rmsnorm_grad(const float *x, const float *w, const float *r, const float *g, float *dx, float *dw_parts,
                          int64_t rows, int64_t d, int64_t threads) {
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t first = rows * t / n, last = rows * (t + 1) / n;       /* this thread's rows */
        float *dw = dw_parts + t * d;                                         /* zeros from the caller */
        for (int64_t m = first; m < last; m++) {
            const float *xm = x + m * d, *gm = g + m * d;
            float *dxm = dx + m * d;
            const float rm = r[m];
            vec acc = vzero();
            int64_t i = 0;
            for (; i + LANES <= d; i += LANES) acc = vfmadd(vmul(vload(gm + i), vload(w + i)), vload(xm + i), acc);
            float dot = vsum(acc);
            for (; i < d; i++) dot += gm[i] * w[i] * xm[i];
            const float c = dot * rm * rm * rm / (float)d;
            const vec rv = vset1(rm), cv = vset1(c);
            for (i = 0; i + LANES <= d; i += LANES) {
                const vec xv = vload(xm + i), gv = vload(gm + i);
                vstore(dxm + i, vfnmadd(xv, cv, vmul(vmul(gv, vload(w + i)), rv)));   /* r g w - c x */
                vstore(dw + i, vfmadd(vmul(gv, xv), rv, vload(dw + i)));            /* += g x r */
            }
            for (; i < d; i++) {
                dxm[i] = rm * gm[i] * w[i] - c * xm[i];
                dw[i] += gm[i] * xm[i] * rm;
            }
        }
    }
}
