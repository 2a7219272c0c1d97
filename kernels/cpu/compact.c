/* A compression event's kept rows moved to the front of llama.cpp's own cache, in place: the state backend on a
 * CPU cache (kvlocal/runtime/hostview.py), where the cells are host memory.
 *
 * Slot j of KV head h takes the row of cell keep[h][j] (-1: an empty slot, zeroed). Moving slot after slot in
 * place is safe where each head's kept cells rise with its slots and no slot takes a cell before its own
 * (keep[h][j] >= j): a cell is overwritten only once every slot that reads it has been written. Both functions
 * check that first and return -1, having moved nothing, where it does not hold (e.g. AdaKV's empty slots before
 * a head's first cell): the caller then gathers through scratch rows. Gathering into scratch and copying back
 * read and wrote every kept row twice, and a transposed V was turned into rows and back; here each row that
 * moves is copied once and a row that stays in its cell is not touched. */

#include "kvlocal_kernels.h"

#include <string.h>

static int moves_forward(const int * keep, int n_head, int width, int n_cells) {
    for (int h = 0; h < n_head; h++) {
        int last = -1;
        for (int j = 0; j < width; j++) {
            const int c = keep[(long long) h * width + j];
            if (c < 0) {
                continue;
            }
            if (c < j || c <= last || c >= n_cells) {
                return 0;
            }
            last = c;
        }
    }
    return 1;
}

int kvl_compact_rows(unsigned char * base, long long cell_stride, long long head_stride, long long row_bytes,
                     int n_head, int n_cells, int width, const int * keep) {
    if (row_bytes <= 0 || n_head <= 0 || width < 0 || !moves_forward(keep, n_head, width, n_cells)) {
        return -1;
    }
    for (int h = 0; h < n_head; h++) {
        const int * kh = keep + (long long) h * width;
        for (int j = 0; j < width; j++) {
            unsigned char * dst = base + j * cell_stride + h * head_stride;
            if (kh[j] < 0) {
                memset(dst, 0, (size_t) row_bytes);
            } else if (kh[j] != j) {
                memcpy(dst, base + kh[j] * cell_stride + h * head_stride, (size_t) row_bytes);
            }
        }
    }
    return 0;
}

#define KVL_COLUMNS(T)                                                                            \
    for (int h = 0; h < n_head; h++) {                                                            \
        const int * kh = keep + (long long) h * width;                                            \
        int         j0 = 0;                                                                       \
        while (j0 < width && kh[j0] == j0) { /* the cells that stay where they are: untouched */  \
            j0++;                                                                                 \
        }                                                                                         \
        for (int e = 0; e < head_dim; e++) {                                                      \
            T * row = (T *) (base + ((long long) h * head_dim + e) * dim_stride);                 \
            for (int j = j0; j < width; j++) {                                                    \
                row[j] = kh[j] < 0 ? (T) 0 : row[kh[j]];                                          \
            }                                                                                     \
        }                                                                                         \
    }

int kvl_compact_columns(unsigned char * base, long long dim_stride, int elem_bytes, int n_head, int head_dim,
                        int n_cells, int width, const int * keep) {
    if ((elem_bytes != 2 && elem_bytes != 4) || n_head <= 0 || head_dim <= 0 || width < 0 ||
        !moves_forward(keep, n_head, width, n_cells)) {
        return -1;
    }
    if (elem_bytes == 2) {
        KVL_COLUMNS(unsigned short)
    } else {
        KVL_COLUMNS(unsigned int)
    }
    return 0;
}
