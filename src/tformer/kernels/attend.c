/* Decoding attention: one query per (row, head) against that row's cached keys and values,
 *
 *     s_j = scale q·k_j (-inf where the mask is 0),  p = softmax(s),  o = Σ_j p_j v_j,
 *
 * for every row b < B and head h < H, in one call: PyTorch's batched products pay a dispatch cost
 * per (row, head), 512 of them in a beam search of 16 sentences x 4 beams x 8 heads (BENCHMARKS.md,
 * "Kernels"). Row b reads keys and values of row b / copies (the beams of one source share its encoder
 * keys), head h those of head h / (H / H_kv) (grouped-query attention); the mask row is b / mask_div.
 * q, k, v are strided views (element strides per row, head and, for k and v, position; the head
 * dimension is contiguous), the mask is bytes (1 = may attend) or NULL, out is (B, H, hd) contiguous,
 * hd a multiple of 16 up to 256, T_k up to 16384. A query that may attend to no key gets 0.
 * With `lineage` (beam search; copies = 1), position j of row b is held by row lineage[b, j] (a beam
 * reads its ancestors' keys where they were written, instead of the cache being copied into beam order
 * at every step). With `kv_bf16` the keys and values are bf16 (a server's KV cache of half the bytes:
 * each is widened to fp32 as it is read; the sums stay fp32).
 */
#include "simd.h"
#include "kernels.h"

#define MAX_HD 256
#define MAX_TK 16384

/* LANES keys or values from element `at` of x, fp32 or bf16 */
static inline vec kv_load(const void *x, int64_t at, int64_t bf16) {
    return bf16 ? vload_bf16((const uint16_t *)x + at) : vload((const float *)x + at);
}

void tformer_attend(const float *q, int64_t qsb, int64_t qsh,
                    const void *k, const void *v, int64_t ksb, int64_t ksh, int64_t kst,
                    int64_t vsb, int64_t vsh, int64_t vst,
                    const uint8_t *mask, int64_t msb, int64_t mst, int64_t mask_div,
                    const int32_t *lineage, int64_t lsb, float *out, int64_t B, int64_t H, int64_t H_kv, int64_t T_k, int64_t hd,
                    int64_t copies, int64_t kv_bf16, float scale) {
    const int64_t group = H / H_kv, nv = hd / LANES;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < B * H; task++) {
        const int64_t b = task / H, h = task % H;
        const float *qb = q + b * qsb + h * qsh;
        const int64_t kb = (b / copies) * ksb + (h / group) * ksh;         /* element offsets into k and v */
        const int64_t vb = (b / copies) * vsb + (h / group) * vsh;
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
            const int64_t kj = kb + j * kst + (lb ? (lb[j] - b) * ksb : 0);
            vec d = vmul(qv[0], kv_load(k, kj, kv_bf16));
            for (int64_t i = 1; i < nv; i++) d = vfmadd(qv[i], kv_load(k, kj + LANES * i, kv_bf16), d);
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
            const int64_t vj = vb + j * vst + (lb ? (lb[j] - b) * vsb : 0);
            vec pb = vset1(p);
            for (int64_t i = 0; i < nv; i++) acc[i] = vfmadd(pb, kv_load(v, vj + LANES * i, kv_bf16), acc[i]);
        }
        vec inv = vset1(1.0f / sum);
        for (int64_t i = 0; i < nv; i++) vstore(o + LANES * i, vmul(acc[i], inv));
    }
}
