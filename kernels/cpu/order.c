/* Cells in position order (kvl_position_order): the scorers' keep (keep.c) and an answer step's prefilter
 * (prefilter.c) pool and rank along positions, whatever order the cells or candidates come in. */

#include "kvlocal_kernels.h"

#include <string.h>

void kvl_position_order(const int * pos, int n, int * order, int * scratch) {
    unsigned top = 0;
    for (int j = 0; j < n; j++) {
        order[j] = j;
        top = (unsigned) (pos[j] + 1) > top ? (unsigned) (pos[j] + 1) : top;
    }
    int * src = order, * dst = scratch;
    for (int shift = 0; shift == 0 || (shift < 32 && top >> shift); shift += 11) {
        int count[2049] = { 0 };
        for (int j = 0; j < n; j++) {
            count[(((unsigned) (pos[src[j]] + 1)) >> shift & 2047) + 1]++;
        }
        for (int b = 0; b < 2048; b++) {
            count[b + 1] += count[b];
        }
        for (int j = 0; j < n; j++) {
            dst[count[((unsigned) (pos[src[j]] + 1)) >> shift & 2047]++] = src[j];
        }
        int * t = src;
        src = dst;
        dst = t;
    }
    if (src != order) {
        memcpy(order, src, sizeof(int) * (size_t) n);
    }
}
