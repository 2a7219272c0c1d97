/* kvlocal CPU kernels: the hot loops of scoring, selection and merging.
 *
 * The scoring functions work on row-major float32 matrices [n_rows, n] and are independent per row,
 * so callers may split rows across threads. Declarations here are parsed by cffi (kernels/build_cpu.py):
 * keep them to plain C types, one declaration per line, no macros. */

/* 1-D pooling along each row with stride 1 and "same" output length (padding kernel/2 on both sides).
 * kind 0 = max (padding ignored), kind 1 = average with zero padding counted (torch avg_pool1d default).
 * kernel must be odd and >= 1. src and dst must not overlap. */
void kvl_pool1d_f32(const float * src, float * dst, int n_rows, int n, int kernel, int kind);

/* Per-row top-k: writes the indices of the k largest values of each row to idx [n_rows, k], in
 * increasing index order (the order cells are kept in). Ties are broken towards the lower index.
 * NaN counts as smaller than every number. Returns 0, or -1 if k > n or k < 0 or when out of memory. */
int kvl_topk_f32(const float * src, int n_rows, int n, int k, int * idx);

/* The k largest of x [n] (k clipped to [0, n]), marked: mark [n] = 1 for the chosen cells, 0 for the others.
 * NaN counts as smaller than every number, -0 as +0; ties go to the cell earlier in order [n] (a permutation of
 * the cells), or with order NULL to the lower index. keys [n] is scratch. kvl_topk_f32 is this per row. */
void kvl_top_marked(const float * x, const int * order, int n, int k, unsigned long long * keys, unsigned char * mark);

/* Window attention votes (SnapKV scoring). q [n_head, w, d] window queries after RoPE with positions
 * q_pos [w]; k [n_kv, n, d] cached keys after RoPE with positions pos [n_kv, n] (any cell order) and an
 * optional additive logit bias [n_kv, n] (NULL = 0). Query head h reads KV head h / (n_head / n_kv).
 * Writes out [n_head, n]: for each query head, the mean over the w queries of softmax_j(q.k_j / sqrt(d)
 * + bias_j) in float32, where a query at p sees only keys with 0 <= pos <= p; a query that sees no key
 * contributes zeros. The keys come as float32 k (k16 NULL) or, k NULL, as k16: an F16 cache's cells [n][n_kv][d]
 * (IEEE half floats), converted exactly as they are read. Returns 0, or -1 on bad sizes (neither or both of k and
 * k16 given) or when out of memory. */
int kvl_window_votes_f32(const float * q, const int * q_pos, int n_head, int w, const float * k, const unsigned short * k16, const int * pos, const float * bias, int n_kv, int n, int d, float * out);

/* Projected value norms (CriticalKV) of one KV head. v [n, d] values; wo the output projection in HF
 * layout (o_proj.weight [D, Hq*d], row stride ld floats), pointing at the first column of the n_group
 * query heads that read this KV head: W_O^h[i][c] = wo[c*ld + h*d + i] for h < n_group; rows [n_rows]
 * the value rows to use (NULL = all, then n_rows == n). Writes out[r] = mean over h of the L1 (p = 1) or L2
 * (p = 2) norm over c of sum_i v[rows[r]][i] * W_O^h[i][c]. Returns 0, or -1 on bad sizes, p not 1 or 2, a
 * row index out of range, or when out of memory. */
int kvl_vnorm_f32(const float * v, int n, int d, const float * wo, int ld, int n_group, int D, int p, const int * rows, int n_rows, float * out);

/* Greedy non-overlapping adjacent pairs (KVSlimmer's pair selection) over m rows in position order.
 * Pair i joins rows i and i+1; order [m-1] lists the pair indices cheapest first. The pairs are taken
 * in that order, skipping any that shares a row with a pair already taken, until n_pairs are taken.
 * taken [m] is scratch; out [min(n_pairs, m/2)] receives the chosen pair indices in the order taken.
 * Returns how many were taken (fewer than n_pairs when the rows run out), or -1 on bad input. */
int kvl_greedy_pairs(const int * order, int m, int n_pairs, unsigned char * taken, int * out);

/* Half-precision rows regrouped by head: src [n][n_head][d] IEEE half floats (an F16 KV cache's cells),
 * dst [n_head][n][d] float32. Exact; F16C where the CPU has it (and kvl_simd_level allows AVX2). */
void kvl_f16_heads_f32(const unsigned short * src, int n, int n_head, int d, float * dst);

/* dst[c][r] = src[r][c] for r < rows, c < cols: 16-bit elements (an F16 V cache stored transposed) moved as
 * bits; rows of src are src_stride elements apart, rows of dst dst_stride. 8 x 8 tiles in SSE2 registers on
 * x86-64, plain C elsewhere. src and dst must not overlap. */
void kvl_transpose_u16(const unsigned short * src, long long src_stride, int rows, int cols,
                       unsigned short * dst, long long dst_stride);

/* Quantized rows to float32: n_blocks blocks of 32 values of ggml type `type` (8 q8_0, 2 q4_0, 3 q4_1,
 * 6 q5_0, 7 q5_1) from src into dst [n_blocks * 32], as ggml's to_float computes them (same bits).
 * Returns 0, or -1 for another type. */
int kvl_dequant_rows(int type, const unsigned char * src, long long n_blocks, float * dst);

/* Rows gathered from a chunked store: row ids[i] is row ids[i] % chunk_rows of chunk ids[i] / chunk_rows,
 * chunks[c] the address of chunk c's first row, rows row_bytes apart. Copies n rows of row_bytes bytes to
 * dst + i * dst_stride. Returns 0, or -1 on bad sizes or an id outside the chunks (rows before it copied). */
int kvl_gather_rows(const unsigned char * const * chunks, long long n_chunks, long long chunk_rows, const long long * ids, long long n, long long row_bytes, unsigned char * dst, long long dst_stride);

/* A compression event's kept rows moved to the front of a cache in place (compact.c): slot j of KV head h takes
 * cell keep[h][j]'s row (-1: zeroed), for j < width. kvl_compact_rows: rows of row_bytes, (cell c, head h) at
 * base + c * cell_stride + h * head_stride (K; V stored as rows). kvl_compact_columns: a transposed V, element e
 * of head h in cell c at base + (h * head_dim + e) * dim_stride + c * elem_bytes (2 or 4). Each returns 0, or -1
 * having moved nothing where a head's kept cells do not rise with its slots, one is below its slot or at or past
 * n_cells (moving forward in place would read a row already overwritten), or for bad sizes. */
int kvl_compact_rows(unsigned char * base, long long cell_stride, long long head_stride, long long row_bytes,
                     int n_head, int n_cells, int width, const int * keep);
int kvl_compact_columns(unsigned char * base, long long dim_stride, int elem_bytes, int n_head, int head_dim,
                        int n_cells, int width, const int * keep);

/* One layer's kept cells under SnapKV (vnorm NULL) or CriticalKV over SnapKV (kernels/cpu/keep.c has the steps):
 * the scorers' keep() in one call. votes [n_head, n] the window votes, or NULL to compute them from q [n_head,
 * w, d] and k [n_kv, n, d] or k16 (kvl_window_votes_f32's); q_pos [w] the window queries' positions; pos [n_kv, n] (-1
 * = empty row), bias [n_kv, n] or NULL; recent < 0: the window is pos >= min(q_pos), else the `recent` latest
 * positions; vnorm [n_kv, n] the projected value norms (NaN = unknown: computed from v [n_kv, n, d] and
 * wo [D, ld], HF o_proj layout, as kvl_vnorm_f32's norm_p-norm, where stage 2 needs them, and written there; with v NULL, from v16, an F16
 * cache's cells [n][n_kv][d], converted row by row where needed). budget [n_kv]: each head keeps min(budget, live rows). Writes
 * keep [n_kv, max_width]: each head's cells in position order in its last slots, -1 before; *width: the most
 * any head keeps. Returns 0, -1 on bad sizes or out of memory, -2 when a norm is needed and v, v16 or wo is NULL. */
int kvl_attention_keep(const float * votes, const float * q, const int * q_pos, int n_head, int w, const float * k, const unsigned short * k16, const float * v, const unsigned short * v16, const int * pos, const float * bias, int n_kv, int n, int d, int n_sink, int recent, int kernel, int pool_kind, const float * wo, int ld, int D, int norm_p, double alpha, float eps, float * vnorm, const int * budget, int max_width, int * keep, int * width);

/* The recall tier's candidates of one KV head (kernels/cpu/pages.c): q [m, d] the observation queries (in the
 * keys' basis, scaled), kmin/kmax [ceil(n / page), d] each page's element-wise key bounds, on_device [n] (1: the
 * row is on the device). Pages holding a row off the device, ranked by Quest's bound max_j sum_i max(q_ji kmin_i,
 * q_ji kmax_i) (ties to the lower page), are taken until they hold n_want rows off the device; their off-device
 * rows go to out [n] in page order. Returns how many, or -1 on bad sizes or out of memory. */
int kvl_page_candidates(const float * q, int m, int d, const float * kmin, const float * kmax, int n, int page, const unsigned char * on_device, long long n_want, int * out);

/* The recall tier's page boxes as rows join a head's store (kernels/cpu/pages.c): keys [m, d] float32 of the
 * store's rows first .. first + m - 1, pages of `page` rows, kmin/kmax [.., d] each page's element-wise minimum and
 * maximum key. A page that row `first` continues widens the box it has; a page that begins in these rows gets
 * theirs. NaN propagates, as in numpy. Returns 0, or -1 on bad sizes. */
int kvl_page_boxes(const float * keys, long long m, int d, long long first, int page, float * kmin, float * kmax);

/* Instruction set of the scoring kernels above: 0 generic (SSE2 / NEON / scalar), 1 AVX2+FMA,
 * 2 AVX-512; the widest the CPU supports is used. cap >= 0 limits it (tests and benchmarks compare the
 * levels; process-wide, not thread-safe); cap < 0 only asks. Returns the level now in use. */
int kvl_simd_level(int cap);
