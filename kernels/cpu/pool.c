#include "kvlocal_kernels.h"

void kvl_pool1d_f32(const float * src, float * dst, int n_rows, int n, int kernel, int kind) {
    const int half = kernel / 2;
    for (int r = 0; r < n_rows; r++) {
        const float * x = src + (long) r * n;
        float       * y = dst + (long) r * n;
        for (int j = 0; j < n; j++) {
            const int lo = j - half < 0     ? 0     : j - half;
            const int hi = j + half > n - 1 ? n - 1 : j + half;
            if (kind == 0) {
                float m = x[lo];
                for (int i = lo + 1; i <= hi; i++) {
                    if (x[i] > m) {
                        m = x[i];
                    }
                }
                y[j] = m;
            } else {
                float s = 0.0f;
                for (int i = lo; i <= hi; i++) {
                    s += x[i];
                }
                y[j] = s / (float) kernel;
            }
        }
    }
}
