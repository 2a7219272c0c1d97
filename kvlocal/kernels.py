"""numpy front end of the native CPU kernels (kernels/cpu, compiled into ``kvlocal._kernels``).

Its own layer, below everything that calls a kernel: the scorers (``kvlocal.compress``), the runtime's views of
the cache (``kvlocal.runtime.hostview``, ``seqstate``, ``kvquant``), the recall tier and the GGUF reader
(``kvlocal.models.gguf_file``) all import it, and it imports nothing of kvlocal (``tests/test_layers.py``)."""

from __future__ import annotations

import numpy as np

try:
    from kvlocal._kernels import ffi, lib
except ImportError as e:  # an install that skipped the cffi step (e.g. a bare checkout on PYTHONPATH)
    raise ImportError(
        f"kvlocal's native kernels are not built ({e}); reinstall with `pip install -e .` (needs a C compiler)"
    ) from None

POOL_KINDS = {"max": 0, "avg": 1}


def _f32_rows(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x.reshape(1, -1) if x.ndim == 1 else x.reshape(-1, x.shape[-1])


def _ptr(a: np.ndarray, ctype: str):
    return ffi.cast(ctype, ffi.from_buffer(a))


def _nullable(a: np.ndarray | None, ctype: str):
    return ffi.NULL if a is None else _ptr(a, ctype)


def f16_cells(rows: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Rows ``[H, n, d]`` for a kernel that reads float32 rows or an F16 cache's cells: ``(float32 rows, None)``, or
    ``(None, the cells [n, H, d] float16, C-contiguous)`` for half floats (a view of the cache's cells as it holds
    them, not copied; other half-float layouts copied into it). The kernels convert the cells they read, exactly."""
    if rows is None:
        return None, None
    if rows.dtype != np.float16:
        return np.ascontiguousarray(rows, dtype=np.float32), None
    return None, np.ascontiguousarray(rows.transpose(1, 0, 2))


def transpose16(src: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``src.T`` of a 2-D array of 16-bit elements (rows may be strided, each row contiguous) as a C-contiguous
    array, or written into ``out`` (``[cols, rows]``, each row contiguous): bits moved, not converted."""
    def rows_ok(a):  # 16-bit elements, each row contiguous (strides of an empty array mean nothing)
        contiguous = (a.shape[1] == 1 or a.strides[1] == 2) and a.strides[0] % 2 == 0
        return a.dtype.itemsize == 2 and (a.size == 0 or contiguous)

    rows, cols = src.shape
    if not rows_ok(src):
        raise ValueError(f"transpose16 takes 16-bit rows, each contiguous; got {src.dtype} strides {src.strides}")
    out = np.empty((cols, rows), src.dtype) if out is None else out
    if out.shape != (cols, rows) or not rows_ok(out):
        raise ValueError(f"transpose16: out {out.shape} {out.dtype} strides {out.strides} cannot hold {src.shape}.T")
    if src.size:
        lib.kvl_transpose_u16(ffi.cast("unsigned short *", src.ctypes.data), src.strides[0] // 2, rows, cols,
                              ffi.cast("unsigned short *", out.ctypes.data), out.strides[0] // 2)
    return out


def pool1d(x: np.ndarray, kernel: int, kind: str = "max") -> np.ndarray:
    """Stride-1 'same' pooling along the last axis (max, or avg counting zero padding)."""
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd and >= 1, got {kernel}")
    src = _f32_rows(x)
    dst = np.empty_like(src)
    lib.kvl_pool1d_f32(_ptr(src, "float *"), _ptr(dst, "float *"), src.shape[0], src.shape[1], kernel, POOL_KINDS[kind])
    return dst.reshape(np.shape(x))


def topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values along the last axis, in increasing index order (ties: lower index)."""
    src = _f32_rows(x)
    if not 0 <= k <= src.shape[1]:
        raise ValueError(f"k={k} out of range for rows of {src.shape[1]}")
    idx = np.empty((src.shape[0], k), dtype=np.int32)
    if lib.kvl_topk_f32(_ptr(src, "float *"), src.shape[0], src.shape[1], k, _ptr(idx, "int *")) != 0:
        raise MemoryError("kvl_topk_f32 failed (out of memory)")
    return idx.reshape(*np.shape(x)[:-1], k)


def _i32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int32)


def window_votes(q: np.ndarray, q_pos: np.ndarray, k: np.ndarray, pos: np.ndarray,
                 bias: np.ndarray | None = None) -> np.ndarray:
    """Mean over the window queries of their softmax over the keys, per query head: ``[Hq, n]`` float32.

    q: [Hq, w, d] queries after RoPE at positions q_pos [w]; k: [Hkv, n, d] keys after RoPE at positions
    pos ([n], or [Hkv, n] when heads differ), in any cell order — float32, or float16 (an F16 cache's cells
    ``[n, Hkv, d]`` seen as ``[Hkv, n, d]``: read in place, :func:`f16_cells`); bias: optional [Hkv, n] logit bias.
    Logits ``q·k/sqrt(d) + bias`` in float32; a query at ``p`` sees keys with ``0 <= pos <= p``; query head
    ``h`` reads KV head ``h // (Hq/Hkv)``. The result is in cell order. Readable numpy version:
    ``kvlocal.compress.numpy_kernels.window_votes``.
    """
    q = np.ascontiguousarray(q, dtype=np.float32)
    k, k16 = f16_cells(k)
    (hq, w, d), (hkv, n, dk) = q.shape, np.shape(k if k16 is None else k16.transpose(1, 0, 2))
    if dk != d or hq % hkv != 0:
        raise ValueError(f"q {q.shape} and k {(hkv, n, dk)} do not match (head dims, or Hq not a multiple of Hkv)")
    qp = _i32(q_pos).reshape(w)
    p = _i32(np.broadcast_to(pos, (hkv, n)))
    b = None if bias is None else np.ascontiguousarray(np.broadcast_to(bias, (hkv, n)), dtype=np.float32)
    out = np.empty((hq, n), dtype=np.float32)
    rc = lib.kvl_window_votes_f32(_ptr(q, "float *"), _ptr(qp, "int *"), hq, w, _nullable(k, "float *"),
                                  _nullable(k16, "unsigned short *"), _ptr(p, "int *"), _nullable(b, "float *"),
                                  hkv, n, d, _ptr(out, "float *"))
    if rc != 0:
        raise MemoryError("kvl_window_votes_f32 failed (out of memory)")
    return out


def vnorm(v: np.ndarray, wo: np.ndarray, first_head: int, n_group: int,
          rows: np.ndarray | None = None, p: int = 1) -> np.ndarray:
    """``mean_h ||v[r] · W_O^h||_p`` over the query heads ``h = first_head .. first_head+n_group-1``: ``[m]`` float32.

    v: [n, d] values of one KV head; wo: [D, Hq*d] the layer's output projection in HF layout
    (``o_proj.weight``; ``W_O^h = wo[:, h*d:(h+1)*d].T``, read in place, no transposed copy), or for ``p=2`` its
    ``[d, Hq*d]`` factor (:func:`kvlocal.compress.criticalkv.l2_factor`: the same norms); rows: optional cell
    indices (default all n); p: 1 (L1, the CriticalKV paper's) or 2 (L2). Readable numpy version:
    ``kvlocal.compress.numpy_kernels.vnorm``.
    """
    if p not in (1, 2):
        raise ValueError(f"p must be 1 or 2, got {p}")
    r = None if rows is None else _i32(rows).reshape(-1)
    if r is not None and r.size and (r.min() < 0 or r.max() >= v.shape[0]):
        raise ValueError(f"row index out of range for {v.shape[0]} rows")
    if v.dtype != np.float32 and r is not None:  # half-float rows (exact in float32): only those asked for
        v, r = v[r], None
    v = np.ascontiguousarray(v, dtype=np.float32)
    wo = np.ascontiguousarray(wo, dtype=np.float32)
    (n, d), (big_d, ld) = v.shape, wo.shape
    if not (0 <= first_head and n_group >= 1 and (first_head + n_group) * d <= ld):
        raise ValueError(f"heads {first_head}..{first_head + n_group - 1} of d={d} do not fit in wo {wo.shape}")
    m = n if r is None else r.shape[0]
    out = np.empty(m, dtype=np.float32)
    w_ptr = ffi.cast("float *", ffi.from_buffer(wo)) + first_head * d
    rc = lib.kvl_vnorm_f32(_ptr(v, "float *"), n, d, w_ptr, ld, n_group, big_d, p,
                           ffi.NULL if r is None else _ptr(r, "int *"), m, _ptr(out, "float *"))
    if rc != 0:
        raise MemoryError("kvl_vnorm_f32 failed (out of memory)")
    return out


def f16_heads_f32(x: np.ndarray) -> np.ndarray:
    """Half-float rows grouped by head as float32: ``x`` [H, n, d] float16, a transposed view of cells
    [n, H, d] (an F16 cache as llama.cpp stores it) or contiguous; returns a C-contiguous [H, n, d] copy.
    Exact (every half is a float32)."""
    if x.dtype != np.float16 or x.ndim != 3:
        raise ValueError(f"want float16 [H, n, d], got {x.dtype} {x.shape}")
    cells = x.transpose(1, 0, 2)
    if not cells.flags.c_contiguous:
        cells = np.ascontiguousarray(cells)
    n, h, d = cells.shape
    out = np.empty((h, n, d), dtype=np.float32)
    lib.kvl_f16_heads_f32(ffi.cast("unsigned short *", ffi.from_buffer(cells)), n, h, d, _ptr(out, "float *"))
    return out


def gather_rows(chunks: np.ndarray, chunk_rows: int, ids: np.ndarray, dst: np.ndarray) -> None:
    """Copy rows of a chunked store into ``dst`` ``[len(ids), ...]`` (a view; each row contiguous, rows any
    stride apart): row ``i`` of ``dst`` gets row ``ids[i] % chunk_rows`` of the chunk at address
    ``chunks[ids[i] // chunk_rows]`` (``chunks``: the chunks' first-row addresses, ``np.uintp``). The
    caller keeps the chunks alive and sees that ``dst``'s rows have the chunks' row size."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if len(ids) == 0:
        return
    row_bytes = dst[0].nbytes
    if not dst[0].flags.c_contiguous:
        raise ValueError("gather_rows: each destination row must be contiguous")
    if lib.kvl_gather_rows(ffi.cast("unsigned char **", chunks.ctypes.data), len(chunks), chunk_rows,
                           ffi.cast("long long *", ids.ctypes.data), len(ids), row_bytes,
                           ffi.cast("unsigned char *", dst.ctypes.data), dst.strides[0]) != 0:
        raise IndexError("gather_rows: a row id outside the store")


def compact_rows(cells: np.ndarray, keep: np.ndarray) -> bool:
    """Move each KV head's kept rows to the front of ``cells`` ``[size, Hkv, row]`` in place (a view of a cache;
    each row contiguous): slot ``j`` of head ``h`` takes cell ``keep[h, j]``'s row (``-1``: zeroed). False, with
    nothing moved, where moving forward in place is not safe (a head's kept cells do not rise with its slots, or
    one lies before its slot): gather through other memory then."""
    keep = _i32(keep)
    hkv, width = keep.shape
    if cells.shape[1] != hkv or not cells[0, 0].flags.c_contiguous:
        raise ValueError(f"compact_rows: cells {cells.shape} with contiguous rows for keep {keep.shape}")
    return lib.kvl_compact_rows(ffi.cast("unsigned char *", cells.ctypes.data), cells.strides[0], cells.strides[1],
                                cells[0, 0].nbytes, hkv, cells.shape[0], width, _ptr(keep, "int *")) == 0


def compact_columns(vt: np.ndarray, keep: np.ndarray) -> bool:
    """:func:`compact_rows` for a transposed V ``[Hkv * d, size]`` (each row contiguous, 16- or 32-bit elements)."""
    keep = _i32(keep)
    hkv, width = keep.shape
    if vt.shape[0] % hkv or vt.strides[1] != vt.itemsize or vt.itemsize not in (2, 4):
        raise ValueError(f"compact_columns: a transposed V {vt.shape} {vt.dtype} for keep {keep.shape}")
    return lib.kvl_compact_columns(ffi.cast("unsigned char *", vt.ctypes.data), vt.strides[0], vt.itemsize, hkv,
                                   vt.shape[0] // hkv, vt.shape[1], width, _ptr(keep, "int *")) == 0


def page_boxes(keys: np.ndarray, first: int, page: int, kmin: np.ndarray, kmax: np.ndarray) -> None:
    """The recall tier's page boxes as rows ``first ..`` with these ``keys`` ``[m, d]`` join a head's store
    (:meth:`kvlocal.recall.tier.HostTier.add`): in place, each page's element-wise minimum and maximum key in
    ``kmin``/``kmax`` ``[n_pages, d]`` float32 (C-contiguous); a page begun before widens its box. One call per head
    instead of a dozen numpy reductions along a middle axis (the numpy steps are its test's reference)."""
    keys = np.ascontiguousarray(keys, dtype=np.float32)
    m, d = keys.shape
    if m == 0:
        return
    for box in (kmin, kmax):
        if box.dtype != np.float32 or not box.flags.c_contiguous or box.shape[1:] != (d,) \
                or len(box) <= (first + m - 1) // page:
            raise ValueError(f"page_boxes: boxes {box.dtype} {box.shape} do not hold the pages of rows "
                             f"{first}..{first + m - 1}")
    if lib.kvl_page_boxes(_ptr(keys, "float *"), m, d, first, page, _ptr(kmin, "float *"), _ptr(kmax, "float *")) != 0:
        raise ValueError("page_boxes: bad sizes")


def page_candidates(q: np.ndarray, kmin: np.ndarray, kmax: np.ndarray, on_device: np.ndarray, page: int,
                    n_want: int) -> np.ndarray:
    """The recall tier's candidate rows of one KV head (:func:`kvlocal.recall.select.choose_candidates`): the
    pages holding a row off the device, ranked by Quest's bound over the queries ``q`` ``[m, d]`` (``kmin``/``kmax``
    ``[n_pages, d]``, ties to the lower page), taken until they hold ``n_want`` rows off the device; their rows off
    the device (``on_device`` ``[n]`` bool), in page order. The numpy steps it stands for are its test's reference
    (``tests/recall/test_recall_tier.py::test_page_candidates_are_the_numpy_steps``)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    n = len(on_device)
    n_pages = -(-n // page)
    lo, hi = (np.ascontiguousarray(a[:n_pages], dtype=np.float32) for a in (kmin, kmax))
    if lo.shape != (n_pages, q.shape[1]) or hi.shape != lo.shape:
        raise ValueError(f"page bounds {kmin.shape} do not fit {n} rows of {q.shape[1]} in pages of {page}")
    flags = np.ascontiguousarray(on_device, dtype=np.bool_).view(np.uint8)
    out = np.empty(max(n, 1), dtype=np.int32)
    count = lib.kvl_page_candidates(_ptr(q, "float *"), q.shape[0], q.shape[1], _ptr(lo, "float *"), _ptr(hi, "float *"),
                                    n, page, _ptr(flags, "unsigned char *"), int(n_want), _ptr(out, "int *"))
    if count < 0:
        raise MemoryError("kvl_page_candidates failed (bad sizes, or out of memory)")
    return out[:count].astype(np.int64)


DEQUANT_BLOCK_BYTES = {8: 34, 2: 18, 3: 20, 6: 22, 7: 24}  # ggml type -> bytes of a block of 32 values


def dequant_rows(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """Quantized rows ``[..., row_bytes]`` uint8 of a q8_0/q4_0/q4_1/q5_0/q5_1 cache → float32 ``[..., values]``,
    the same bits as ggml's (and gguf-py's) dequantization."""
    size = DEQUANT_BLOCK_BYTES.get(ggml_type)
    if size is None or raw.shape[-1] % size:
        raise ValueError(f"rows of {raw.shape[-1]} bytes are not blocks of ggml type {ggml_type}")
    src = np.ascontiguousarray(raw, dtype=np.uint8)
    n_blocks = src.size // size
    out = np.empty((*src.shape[:-1], src.shape[-1] // size * 32), dtype=np.float32)
    lib.kvl_dequant_rows(ggml_type, ffi.cast("unsigned char *", ffi.from_buffer(src)), n_blocks, _ptr(out, "float *"))
    return out


def greedy_pairs(mass: np.ndarray, n_pairs: int) -> np.ndarray:
    """Greedy non-overlapping adjacent pairs with the smallest mass: sorted pair indices ``[P]`` int64.

    mass: [m] per-row weights in position order; pair ``i`` joins rows ``i`` and ``i+1`` and costs
    ``mass[i] + mass[i+1]`` (float32). Pairs are taken cheapest first (ties: the earlier pair), skipping
    any that shares a row with one already taken, until ``n_pairs`` (fewer if the rows run out).
    Readable numpy version: ``kvlocal.compress.numpy_kernels.greedy_pairs``.
    """
    mass = np.ascontiguousarray(mass, dtype=np.float32).reshape(-1)
    m = mass.shape[0]
    n_pairs = min(int(n_pairs), m // 2)
    if n_pairs <= 0:
        return np.zeros(0, dtype=np.int64)
    order = _i32(np.argsort(mass[:-1] + mass[1:], kind="stable"))
    taken = np.empty(m, dtype=np.uint8)
    out = np.empty(n_pairs, dtype=np.int32)
    got = lib.kvl_greedy_pairs(_ptr(order, "int *"), m, n_pairs, _ptr(taken, "unsigned char *"), _ptr(out, "int *"))
    if got < 0:
        raise ValueError("kvl_greedy_pairs: bad input")
    return np.sort(out[:got]).astype(np.int64)


SIMD_LEVELS = ("generic", "avx2", "avx512")


def simd_level(cap: str | None = None) -> str:
    """The instruction set the scoring kernels use (``"generic"``, ``"avx2"``, ``"avx512"``).

    The widest one the CPU supports is chosen at run time. ``cap`` limits it for the whole process
    (tests and benchmarks compare the levels); returns the level now in use.
    """
    global _simd_level
    # C is asked once, and when capped: a call into it gives up the GIL and on its way back waits for the
    # plan's threads to let go of it (a cost that shows in a prefill), and the scorers ask at every layer
    if cap is not None or _simd_level is None:
        _simd_level = SIMD_LEVELS[lib.kvl_simd_level(-1 if cap is None else SIMD_LEVELS.index(cap))]
    return _simd_level


_simd_level = None


def attention_keep(votes, q, q_pos, k, v, pos, bias, *, n_sink: int, recent: int | None, kernel: int, pooling: str,
                   budget: int, wo=None, vnorm=None, norm_p: int = 1, alpha: float = 0.5,
                   epsilon: float = 1e-4) -> np.ndarray:
    """One layer's kept cells ``[Hkv, B]`` under SnapKV, or CriticalKV over SnapKV where ``vnorm`` is given —
    what ``SnapKV().keep`` / ``CriticalKV(SnapKV()).keep`` return, in one call (kernels/cpu/keep.c).

    votes: ``[Hq, n]`` window votes, or None to compute them from q ``[Hq, w, d]`` (the window queries) and
    k ``[Hkv, n, d]``; q_pos ``[w]``; pos ``[Hkv, n]`` (-1: empty row); bias ``[Hkv, n]`` or None; recent: the
    protected recent span (None: the cells at or after the first window query). vnorm ``[Hkv, n]`` float32,
    NaN where unknown: the norms stage 2 needs are computed from v and wo (``[D, Hq*d]``, or its factor for
    ``norm_p=2``: :func:`vnorm`) as ``norm_p``-norms and written into
    it; k and v may be float16 (an F16 cache's rows, ``[Hkv, n, d]`` views of its cells ``[n, Hkv, d]``): then the
    keys are converted as the votes read them, and only the value rows that need a norm. ``budget``: each head
    keeps ``min(budget, live rows)``."""
    hkv, n = pos.shape
    hq, w = (votes.shape[0], len(q_pos)) if votes is not None else q.shape[:2]
    d = q.shape[2] if q is not None else (k.shape[2] if k is not None else 1)
    qp = _i32(q_pos).reshape(-1)
    p = _i32(pos)
    f32 = (lambda a: None if a is None else np.ascontiguousarray(a, dtype=np.float32))
    k, k16 = f16_cells(k)  # half floats: the cells [n, Hkv, d] as the cache holds them
    v, v16 = f16_cells(v)
    votes, q, bias, wo = (f32(a) for a in (votes, q, bias, wo))
    vn = None if vnorm is None else (vnorm if vnorm.flags.c_contiguous else np.ascontiguousarray(vnorm))
    budgets = np.full(hkv, max(int(budget), 0), dtype=np.int32)
    max_width = min(max(int(budget), 0), n)
    keep = np.empty((hkv, max(max_width, 1)), dtype=np.int32)
    width = ffi.new("int *")

    def ptr(a, ctype="float *"):
        return ffi.NULL if a is None else _ptr(a, ctype)

    rc = lib.kvl_attention_keep(ptr(votes), ptr(q), _ptr(qp, "int *"), hq, w, ptr(k), ptr(k16, "unsigned short *"),
                                ptr(v), ptr(v16, "unsigned short *"), _ptr(p, "int *"),
                                ptr(bias), hkv, n, d, n_sink, -1 if recent is None else recent, kernel,
                                POOL_KINDS[pooling], ptr(wo), wo.shape[1] if wo is not None else 0,
                                wo.shape[0] if wo is not None else 0, norm_p, alpha, np.float32(epsilon), ptr(vn),
                                _ptr(budgets, "int *"), max_width, _ptr(keep, "int *"), width)
    if rc == -2:
        raise ValueError("CriticalKV without v needs the norms of every cell it ranks")
    if rc != 0:
        raise MemoryError("kvl_attention_keep failed (bad sizes, or out of memory)")
    if vn is not None and vn is not vnorm:
        vnorm[...] = vn
    return keep[:, max_width - width[0]:max_width].astype(np.int64)


def native_scoring() -> bool:
    """Whether the scorers run the C scoring kernels (True) or their numpy definitions (False).

    The kernels are used where they have wide vectors (AVX2+FMA or AVX-512, chosen at run time). The
    generic build (SSE2 on x86-64, NEON on arm64) loses to numpy, whose BLAS has them: measured on
    x86-64 with ``python -m tools.bench_kernels --simd generic`` (docs/engine.md § a layer's selection in one call).
    """
    return simd_level() != "generic"


def as_f32(rows: np.ndarray) -> np.ndarray:
    """``rows`` as a C-contiguous float32 array: half floats [H, n, d] or [n, d] by :func:`f16_heads_f32`
    where that is faster (:func:`native_scoring`), anything else by numpy. Exact either way."""
    if rows.dtype == np.float16 and rows.ndim in (2, 3) and native_scoring():
        return f16_heads_f32(rows) if rows.ndim == 3 else f16_heads_f32(rows[None])[0]
    return np.ascontiguousarray(rows, dtype=np.float32)
