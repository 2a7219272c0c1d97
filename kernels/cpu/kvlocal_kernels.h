/* kvlocal CPU kernels: the hot loops of scoring and selection.
 *
 * Every function works on row-major float32 matrices [n_rows, n] and is independent per row,
 * so callers may split rows across threads. Declarations here are parsed by cffi (kernels/build_cpu.py):
 * keep them to plain C types, one declaration per line, no macros. */

/* 1-D pooling along each row with stride 1 and "same" output length (padding kernel/2 on both sides).
 * kind 0 = max (padding ignored), kind 1 = average with zero padding counted (torch avg_pool1d default).
 * kernel must be odd and >= 1. src and dst must not overlap. */
void kvl_pool1d_f32(const float * src, float * dst, int n_rows, int n, int kernel, int kind);

/* Per-row top-k: writes the indices of the k largest values of each row to idx [n_rows, k], in
 * increasing index order (the order cells are kept in). Ties are broken towards the lower index.
 * NaN counts as smaller than every number. Returns 0, or -1 if k > n or k < 0. */
int kvl_topk_f32(const float * src, int n_rows, int n, int k, int * idx);
