/* An answer step's candidates cut to the rows that can win, before they join the cache being compressed.
 *
 * Quest's page bounds choose a step's candidates without reading a row, but on 64-dimension heads they are
 * loose: four budgets of candidates hold ~90% of the off-device rows a step's query attends to most, one budget
 * ~45% (SmolLM2, 4K tokens). So four budgets are taken, and every one of them was copied into the union and
 * scored with the device's cells at every step — though a step keeps about a tenth of them. This reads each
 * candidate's key where the tier keeps it, scores it by its largest logit over the step's queries, max-pools the
 * scores along positions as SnapKV's scores are (a fact's neighbouring tokens rank together), and keeps the
 * best: only those are copied and scored with the method (kvlocal/recall/select.py, choose_candidates).
 *
 * The logits are the arithmetic (candidates x queries x head dimension): one instance per instruction set as in
 * window.c, lanes over the head dimension (prefilter.inc). */

#include "kvlocal_kernels.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define KVL_TEMPLATE "prefilter.inc"
#include "instances.h"

#define BLOCK 32 /* candidate rows converted to float32 at a time */

/* a key row as float32 into dst [d]: F32 (0), F16 (1) or a quantized type's blocks (kvl_dequant_rows); 0 or -1 */
static int key_f32(const unsigned char * src, int key_type, int d, float * dst) {
    if (key_type == 0) {
        memcpy(dst, src, sizeof(float) * (size_t) d);
        return 0;
    }
    if (key_type == 1) {
        kvl_f16_heads_f32((const unsigned short *) src, 1, 1, d, dst);
        return 0;
    }
    return d % 32 == 0 ? kvl_dequant_rows(key_type, src, d / 32, dst) : -1;
}

int kvl_rows_prefilter(const unsigned char * const * chunks, long long n_chunks, long long chunk_rows,
                       long long row_bytes, int key_type, const long long * ids, const int * pos, int n,
                       const float * q, int m, int d, int kernel, int n_keep, long long * out) {
    if (n < 0 || m < 0 || d <= 0 || chunk_rows <= 0 || row_bytes <= 0 || kernel < 1 || kernel % 2 == 0) {
        return -1;
    }
    n_keep = n_keep < 0 ? 0 : (n_keep < n ? n_keep : n);
    const size_t         nn    = (size_t) (n > 0 ? n : 1);
    float *              kb    = malloc(sizeof(float) * (size_t) BLOCK * d);
    float *              score = malloc(sizeof(float) * nn * 2);
    int *                order = malloc(sizeof(int) * nn * 2); /* then the sort's scratch */
    unsigned long long * keys  = malloc(sizeof(unsigned long long) * nn);
    unsigned char *      mark  = malloc(nn);
    int                  rc    = 0;
    if (!kb || !score || !order || !keys || !mark) {
        rc = -1;
        goto done;
    }
    for (int r0 = 0; r0 < n && rc == 0; r0 += BLOCK) { /* the largest logit of each candidate */
        const int nb = n - r0 < BLOCK ? n - r0 : BLOCK;
        for (int r = 0; r < nb && rc == 0; r++) {
            const long long id = ids[r0 + r], c = id / chunk_rows;
            rc = id < 0 || c >= n_chunks ? -1 : key_f32(chunks[c] + (id % chunk_rows) * row_bytes, key_type, d,
                                                        kb + (ptrdiff_t) r * d);
        }
        if (rc != 0) {
            break;
        }
#if KVL_X86_DISPATCH
        switch (kvl_simd_active()) {
            case 2: max_logits_avx512(q, m, d, kb, nb, score + r0); break;
            case 1: max_logits_avx2(q, m, d, kb, nb, score + r0); break;
            default: max_logits_generic(q, m, d, kb, nb, score + r0); break;
        }
#else
        max_logits_generic(q, m, d, kb, nb, score + r0);
#endif
    }
    if (rc != 0) {
        goto done;
    }
    kvl_position_order(pos, n, order, order + nn);
    float * sorted = score + n;
    for (int i = 0; i < n; i++) {
        sorted[i] = score[order[i]];
    }
    kvl_pool1d_f32(sorted, score, 1, n, kernel, 0); /* pooled along positions */
    kvl_top_marked(score, NULL, n, n_keep, keys, mark);
    for (int i = 0; i < n; i++) {
        if (mark[i]) {
            out[rc++] = ids[order[i]];
        }
    }
done:
    free(kb);
    free(score);
    free(order);
    free(keys);
    free(mark);
    return rc;
}
