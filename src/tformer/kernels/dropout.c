/* Dropout for training, forward and backward in one pass each (model/dropout.py):
 *
 *     keep_i = bits_i >= round(p · 32768),   y_i = keep_i ? x_i · s : 0,   dL/dx_i = keep_i ? g_i · s : 0
 *
 * with s = 1 / (1 - p) and bits_i 15 random bits: the 15-bit lanes of splitmix64's hash of (seed, j) for each
 * group j of 4 elements (p in steps of 1/32768, as the PyTorch path in dropout.py draws them). The hash of a
 * counter gives every element its bits whatever thread computes it, so the mask depends on the seed only,
 * not on the number of threads. PyTorch's path passes over the elements five times forward (draw, cut the
 * bits, compare, two multiplies) and twice backward; here once each, writing `keep` (a byte each) for the
 * backward. Values fp32, or bf16 (bf16 = 1: x · s computed in fp32 and rounded to nearest even, as PyTorch
 * rounds a bf16 product).
 */
#include "simd.h"
#include "kernels.h"

static inline uint64_t hash(uint64_t seed, uint64_t j) {       /* splitmix64 of the j-th counter */
    uint64_t z = seed + (j + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

#define CHUNK 1024      /* elements per task: their 256 hashes on the stack, each loop below vectorised */

/* y = x · (keep ? s : 0) (NaN stays NaN, as PyTorch's x * keep * s); keep = NULL: the mask drawn from `seed`,
 * written to `mask` */
static void apply(const void *x, void *y, const uint8_t *keep, uint8_t *mask, int64_t n, uint64_t seed,
                  int64_t threshold, float s, int64_t bf16) {
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t first = c * CHUNK, count = first + CHUNK < n ? CHUNK : n - first;
        uint64_t h[CHUNK / 4];
        uint8_t drawn[CHUNK];
        const uint8_t *k = keep ? keep + first : drawn;
        if (!keep) {
            const uint16_t *bits = (const uint16_t *)h;                 /* element i: the i-th 16 bits */
            for (int64_t j = 0; j < CHUNK / 4; j++) h[j] = hash(seed, (uint64_t)(first / 4 + j));
            for (int64_t i = 0; i < count; i++) drawn[i] = (bits[i] & 0x7FFF) >= threshold;
            memcpy(mask + first, drawn, (size_t)count);
        }
        if (bf16) {
            const uint16_t *xb = (const uint16_t *)x + first;
            uint16_t *yb = (uint16_t *)y + first;
            for (int64_t i = 0; i < count; i++) yb[i] = float_to_bf16(bf16_to_float(xb[i]) * (k[i] ? s : 0.0f));
        } else {
            const float *xf = (const float *)x + first;
            float *yf = (float *)y + first;
            for (int64_t i = 0; i < count; i++) yf[i] = xf[i] * (k[i] ? s : 0.0f);
        }
    }
}

void tformer_dropout(const void *x, void *y, uint8_t *keep, int64_t n, int64_t seed, int64_t threshold, float s,
                     int64_t bf16) {
    apply(x, y, NULL, keep, n, (uint64_t)seed, threshold, s, bf16);
}

void tformer_dropout_grad(const void *g, void *dx, const uint8_t *keep, int64_t n, float s, int64_t bf16) {
    apply(g, dx, keep, NULL, n, 0, 0, s, bf16);
}
