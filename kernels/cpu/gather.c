/* Rows gathered from a chunked store (the recall tier's).
 *
 * The tier keeps each KV head's rows in fixed-size chunks (RAM or a memory-mapped file); a question's or
 * an answer step's candidates are a few thousand rows spread over dozens of chunks, read for every layer
 * and head at every re-selection. numpy gathers one chunk at a time; this copies row by row in one call,
 * straight into the slots of the cache being compressed. */

#include "kvlocal_kernels.h"

#include <string.h>

int kvl_gather_rows(const unsigned char * const * chunks, long long n_chunks, long long chunk_rows, const long long * ids,
                    long long n, long long row_bytes, unsigned char * dst, long long dst_stride) {
    if (chunk_rows <= 0 || row_bytes <= 0 || n < 0) {
        return -1;
    }
    for (long long i = 0; i < n; i++) {
        const long long c = ids[i] / chunk_rows;
        if (ids[i] < 0 || c >= n_chunks) {
            return -1;
        }
        const unsigned char * src = chunks[c] + (ids[i] % chunk_rows) * row_bytes;
        memcpy(dst + i * dst_stride, src, (size_t) row_bytes);
    }
    return 0;
}
