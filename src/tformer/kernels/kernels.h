/* The functions one source of the library calls in another. Hidden: the library exports only the
 * tformer_* entry points that build.py loads with ctypes, so these names cannot clash with another
 * library's and are called directly, as the static functions of one file were.
 */
#ifndef TFORMER_KERNELS_H
#define TFORMER_KERNELS_H

#include <stdint.h>

#define HIDDEN __attribute__((visibility("hidden")))

/* gemv_fp32.c: y = x Pᵀ + bias (y += with `acc`), P packed fp32, or bf16 (bf16 = 1) */
HIDDEN void gemv(const void *p, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                 int bf16, int acc);
/* gemv_fp32.c: all M rows times the block at p (two = 0) or the blocks at p and p + K·16 (two = 1) */
HIDDEN void pass_rows(const void *p, const float *x, float *y, const float *bias, int64_t M, int64_t N,
                      int64_t K, int64_t n0, int two, int bf16, int acc);
/* gemv_int8.c: y = x Wᵀ + bias (y += with `acc`), W packed by pack8; u the rounded rows' scratch */
HIDDEN void gemv8(const int8_t *p, const float *x, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                  uint8_t *u, int acc);
/* attend.c: decoding attention for every row and head (exported too: gemv.attend calls it); k, v fp32 or bf16 */
void tformer_attend(const float *q, int64_t qsb, int64_t qsh,
                    const void *k, const void *v, int64_t ksb, int64_t ksh, int64_t kst,
                    int64_t vsb, int64_t vsh, int64_t vst,
                    const uint8_t *mask, int64_t msb, int64_t mst, int64_t mask_div,
                    const int32_t *lineage, int64_t lsb, float *out, int64_t B, int64_t H, int64_t H_kv, int64_t T_k, int64_t hd,
                    int64_t copies, int64_t kv_bf16, float scale);

/* gelu.c: y = GELU(x) with tanh's approximation, n values (y may be x) */
HIDDEN void gelu_tanh(const float *x, float *y, int64_t n);

#endif
