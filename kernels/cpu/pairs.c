#include "kvlocal_kernels.h"

int kvl_greedy_pairs(const int * order, int m, int n_pairs, unsigned char * taken, int * out) {
    if (m < 0 || n_pairs < 0) {
        return -1;
    }
    for (int i = 0; i < m; i++) {
        taken[i] = 0;
    }
    int got = 0;
    for (int r = 0; r < m - 1 && got < n_pairs; r++) {
        const int i = order[r];
        if (i < 0 || i >= m - 1) {
            return -1;
        }
        if (!taken[i] && !taken[i + 1]) {
            taken[i]     = 1;
            taken[i + 1] = 1;
            out[got++]   = i;
        }
    }
    return got;
}
