/* GELU with tanh's approximation (GPT-2's "gelu_new"), forward and backward, one pass each:
 *
 *     y = 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)) = x s,   u = √(2/π) (x + 0.044715 x³)
 *     dy/dx = s + x s (1 - s) · 2 du/dx,   s (1 - s) = e^(-2u) s² (not 1 - s: exact where s is near 1),
 *     2 du/dx = 2 √(2/π) (1 + 3 · 0.044715 x²)
 *
 * one e^x per value, in vectors: PyTorch 2.13's CPU gelu(approximate="tanh") and its backward evaluate
 * tanh at ~3x the time of the erf GELU (1.5 and 1.7 ms for GPT-2's (4, 128, 3072) on 2 cores against 0.45;
 * BENCHMARKS.md, "LoRA"). Also the activation of gpt_step.c's decoding step. x, y, g, dx contiguous fp32;
 * y may be x (in place).
 */
#include "simd.h"
#include "kernels.h"

#define C2 (2.0f * 0.7978845608028654f)           /* 2 √(2/π) */
#define A 0.044715f

static inline vec e2u(vec x) {                    /* e^(-2u) */
    return vexp(vmul(vmul(x, vset1(-C2)), vfmadd(vmul(x, x), vset1(A), vset1(1.0f))));
}

static inline float e2u1(float x) {                /* clamped as vexp is: e^(-2u) s stays finite */
    return expf(fminf(88.0f, fmaxf(-87.0f, -C2 * x * (1.0f + A * x * x))));
}

void gelu_tanh(const float *x, float *y, int64_t n) {
    const int64_t vectors = n / LANES;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < vectors; i++) {
        const vec xv = vload(x + LANES * i);
        vstore(y + LANES * i, vdiv(xv, vadd(vset1(1.0f), e2u(xv))));
    }
    for (int64_t i = LANES * vectors; i < n; i++) y[i] = x[i] / (1.0f + e2u1(x[i]));
}

void tformer_gelu_tanh(const float *x, float *y, int64_t n) { gelu_tanh(x, y, n); }

void tformer_gelu_tanh_grad(const float *x, const float *g, float *dx, int64_t n) {
    const int64_t vectors = n / LANES;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < vectors; i++) {
        const vec xv = vload(x + LANES * i), e = e2u(xv), s = vdiv(vset1(1.0f), vadd(vset1(1.0f), e));
        const vec du = vmul(vset1(C2), vfmadd(vmul(xv, xv), vset1(3.0f * A), vset1(1.0f)));   /* 2 du/dx */
        const vec d = vfmadd(vmul(vmul(xv, s), vmul(e, s)), du, s);                            /* s(1 - s) = e s² */
        vstore(dx + LANES * i, vmul(vload(g + LANES * i), d));
    }
    for (int64_t i = LANES * vectors; i < n; i++) {
        const float xi = x[i], e = e2u1(xi), s = 1.0f / (1.0f + e);
        dx[i] = g[i] * (s + (xi * s) * (e * s) * C2 * (1.0f + 3.0f * A * xi * xi));
    }
}
