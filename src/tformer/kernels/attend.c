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
#include <stdlib.h>

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

/* Whole-text attention without a mask (an encoder's, on the real tokens of a padded batch: masks.Packing):
 * text b is rows starts[b] .. starts[b + 1] - 1 of `qkv` (row stride `stride` elements; Q of head h at
 * column h·hd, K and V of head h / (H / H_kv) at k_off and v_off + that head's hd), fp32 or bf16 (`bf16`),
 * and each of its tokens attends to all of them. out (rows, `out_stride`), head h at column h·hd, is
 * written in the same dtype. For texts of a few dozen tokens PyTorch's flash kernel, with the padding
 * put back for it and taken out after, is most of an encoder's time outside its products (BENCHMARKS.md,
 * "Against CTranslate2 and ONNX Runtime"). One task is a (text, head): its keys are laid out by position
 * (kt[d·tp + j], widened, zero past the text's end) and QB queries' (scaled) likewise, so that QB queries x
 * LANES keys of scores are QB independent sums of hd products; its values are read in place. The rows
 * are asked for (prefetched) a few ahead: each is a cache miss the first time a head reads it. hd a
 * multiple of LANES up to MAX_HD. */

#define QB 8               /* queries of one text and head at a time: 8 independent sums in flight */

static inline float element(const void *x, int64_t at, int64_t bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[at]) : ((const float *)x)[at];
}

/* The blocked kernels' shared steps (tformer_attend_whole, tformer_attend_causal). Keys are laid out by
 * position, kt[d·ld + j]; QB queries by dimension, qv[d·QB + c], scaled; scores s[c·ls + j]. */

/* scores of LANES keys from j x QB queries: QB independent sums of hd products */
static inline void score_block(const float *kt, int64_t ld, int64_t j, const float *qv, int64_t hd, float *s,
                               int64_t ls) {
    vec acc[QB];
    for (int64_t c = 0; c < QB; c++) acc[c] = vzero();
    for (int64_t d = 0; d < hd; d++) {
        const vec kd = vload(kt + d * ld + j);
        for (int64_t c = 0; c < QB; c++) acc[c] = vfmadd(vset1(qv[d * QB + c]), kd, acc[c]);
    }
    for (int64_t c = 0; c < QB; c++) vstore(s + c * ls + j, acc[c]);
}

/* a row of scores over keys 0 .. n - 1 (tp >= n, a multiple of LANES) -> e^(s - max), 0 from n on; 1 / their sum */
static inline float softmax_row(float *s, int64_t n, int64_t tp) {
    for (int64_t j = n; j < tp; j++) s[j] = -INFINITY;
    vec top = vload(s), total = vzero();
    for (int64_t j = LANES; j < tp; j += LANES) top = vmax(top, vload(s + j));
    const vec high = vset1(vmaxall(top));
    for (int64_t j = 0; j < tp; j += LANES) {
        vstore(s + j, vexp(vsub(vload(s + j), high)));
        for (int64_t r = n > j ? n - j : 0; r < LANES; r++) s[j + r] = 0.0f;
        total = vadd(total, vload(s + j));
    }
    return 1.0f / vsum(total);
}

/* acc[c] = Σ_j s[c·ls + j] v_j over keys 0 .. n - 1: LANES columns of the values, v_j at element v0 + j·vs */
static inline void weigh_values(const void *v, int64_t v0, int64_t vs, int64_t n, const float *s, int64_t ls,
                                int64_t bf16, vec acc[QB]) {
    for (int64_t c = 0; c < QB; c++) acc[c] = vzero();
    for (int64_t j = 0; j < n; j++) {
        const vec vj = kv_load(v, v0 + j * vs, bf16);
        for (int64_t c = 0; c < QB; c++) acc[c] = vfmadd(vset1(s[c * ls + j]), vj, acc[c]);
    }
}

/* LANES outputs at element `at` of out, fp32 or rounded to bf16 */
static inline void store_out(void *out, int64_t at, vec o, int64_t bf16) {
    if (!bf16) {
        vstore((float *)out + at, o);
        return;
    }
    float f[LANES];
    vstore(f, o);
    for (int64_t r = 0; r < LANES; r++) ((uint16_t *)out)[at + r] = float_to_bf16(f[r]);
}

void tformer_attend_whole(const void *qkv, int64_t stride, int64_t k_off, int64_t v_off, const int64_t *starts,
                          void *out, int64_t out_stride, int64_t B, int64_t H, int64_t H_kv, int64_t hd,
                          int64_t bf16, float scale) {
    const int64_t group = H / H_kv, nv = hd / LANES, size = bf16 ? 2 : 4, ahead = 4;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++)
        longest = starts[b + 1] - starts[b] > longest ? starts[b + 1] - starts[b] : longest;
    const int64_t most = (longest + LANES - 1) / LANES * LANES;
#pragma omp parallel
    {
        float *kt = malloc(sizeof(float) * (hd * most + QB * most + QB * hd));
        float *s = kt + hd * most, *qs = s + QB * most;     /* scores s[q·tp + j]; queries qs[d·QB + q], scaled */
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < B * H; task++) {
            const int64_t b = task / H, h = task % H, first = starts[b], n = starts[b + 1] - first;
            const int64_t tp = (n + LANES - 1) / LANES * LANES;
            const int64_t kc = k_off + (h / group) * hd, vc = v_off + (h / group) * hd;
            for (int64_t j = 0; j < tp; j++) {
                if (j + ahead < n)
                    for (int64_t at = 0; at < hd * size; at += 64) {
                        __builtin_prefetch((const char *)qkv + ((first + j + ahead) * stride + kc) * size + at);
                        __builtin_prefetch((const char *)qkv + ((first + j + ahead) * stride + h * hd) * size + at);
                        __builtin_prefetch((const char *)qkv + ((first + j + ahead) * stride + vc) * size + at);
                    }
                for (int64_t d = 0; d < hd; d++)
                    kt[d * tp + j] = j < n ? element(qkv, (first + j) * stride + kc + d, bf16) : 0.0f;
            }
            for (int64_t i0 = 0; i0 < n; i0 += QB) {
                for (int64_t q = 0; q < QB; q++)                      /* queries past the text's end: 0 */
                    for (int64_t d = 0; d < hd; d++)
                        qs[d * QB + q] = i0 + q < n ? scale * element(qkv, (first + i0 + q) * stride + h * hd + d, bf16) : 0.0f;
                for (int64_t j = 0; j < tp; j += LANES)               /* scores: LANES keys x QB queries */
                    score_block(kt, tp, j, qs, hd, s, tp);
                float inv[QB];
                for (int64_t q = 0; q < QB; q++) inv[q] = softmax_row(s + q * tp, n, tp);   /* 0 past the end */
                for (int64_t c = 0; c < nv; c++) {                    /* out = p V: LANES columns x QB queries */
                    vec acc[QB];
                    weigh_values(qkv, first * stride + vc + c * LANES, stride, n, s, tp, bf16, acc);
                    for (int64_t q = 0; q < QB && i0 + q < n; q++)
                        store_out(out, (first + i0 + q) * out_stride + h * hd + c * LANES, vmul(acc[q], vset1(inv[q])),
                                  bf16);
                }
            }
        }
        free(kt);
    }
}

/* Causal self-attention of T new queries of one sequence after `offset` cached positions (a prompt, or a
 * server's prompt chunk after the ones before it): query i, at position offset + i, attends to keys
 * 0 .. offset + i of the sequence's cache k, v (L = offset + T positions). PyTorch's flash kernel runs these
 * at ~160 GFLOP/s on a Zen 5 (~1/3 of its fp32 products') and with a mask for offset > 0 computes the
 * masked scores too. One task is a head: its keys are laid out by position once (kt, as in
 * tformer_attend_whole), then each block of QB queries scores the keys up to its last query's position
 * only. q: element (i, h, d) at q[i·qs + h·qh + d]; k, v: (h_kv, j, d) at [h_kv·ksh + j·kst + d]; out: (i,
 * h·hd + d) at out[i·os + h·hd + d] in q's dtype; q (and out) fp32 or bf16 (`q_bf16`: a bf16 model's), k and v
 * fp32 or bf16 (`kv_bf16`), the sums fp32 either way. hd a multiple of LANES up to MAX_HD. */
void tformer_attend_causal(const void *q, int64_t qs, int64_t qh, const void *k, const void *v, int64_t ksh,
                           int64_t kst, int64_t vsh, int64_t vst, void *out, int64_t os, int64_t T, int64_t offset,
                           int64_t H, int64_t H_kv, int64_t hd, int64_t q_bf16, int64_t kv_bf16, float scale) {
    const int64_t group = H / H_kv, nv = hd / LANES, L = offset + T;
    const int64_t lp = (L + LANES - 1) / LANES * LANES;
#pragma omp parallel
    {
        float *kt = malloc(sizeof(float) * (hd * lp + QB * lp + QB * hd));
        float *s = kt + hd * lp, *qv = s + QB * lp;          /* scores s[q·lp + j]; queries qv[d·QB + q], scaled */
#pragma omp for schedule(dynamic)
        for (int64_t h = 0; h < H; h++) {
            const int64_t kh = (h / group) * ksh, vh = (h / group) * vsh;
            for (int64_t j0 = 0; j0 < lp; j0 += LANES)               /* LANES keys at a time: their rows stay */
                for (int64_t d = 0; d < hd; d++)                     /* in L1, each line of kt written whole */
                    for (int64_t j = j0; j < j0 + LANES; j++)
                        kt[d * lp + j] = j < L ? element(k, kh + j * kst + d, kv_bf16) : 0.0f;
            for (int64_t i0 = 0; i0 < T; i0 += QB) {
                const int64_t nq = T - i0 < QB ? T - i0 : QB, seen = offset + i0 + nq;   /* keys the block sees */
                const int64_t tp = (seen + LANES - 1) / LANES * LANES;
                for (int64_t c = 0; c < QB; c++)                      /* queries past the last: 0 */
                    for (int64_t d = 0; d < hd; d++)
                        qv[d * QB + c] = c < nq ? scale * element(q, (i0 + c) * qs + h * qh + d, q_bf16) : 0.0f;
                for (int64_t j = 0; j < tp; j += LANES)               /* scores: LANES keys x QB queries */
                    score_block(kt, lp, j, qv, hd, s, lp);
                float inv[QB];                                        /* query c sees keys 0 .. offset + i0 + c */
                for (int64_t c = 0; c < QB; c++) inv[c] = softmax_row(s + c * lp, offset + i0 + c + 1, tp);
                for (int64_t e = 0; e < nv; e++) {                    /* out = p V: LANES columns x QB queries */
                    vec acc[QB];
                    weigh_values(v, vh + e * LANES, vst, seen, s, lp, kv_bf16, acc);
                    for (int64_t c = 0; c < nq; c++)
                        store_out(out, (i0 + c) * os + h * hd + e * LANES, vmul(acc[c], vset1(inv[c])), q_bf16);
                }
            }
        }
        free(kt);
    }
}
