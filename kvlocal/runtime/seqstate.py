"""llama.cpp's sequence-state blob, as bytes: :func:`parse_blob` into a :class:`SeqKV` of numpy arrays and
:func:`build_blob` back (the layout is in :mod:`kvlocal.runtime.state`'s docstring). Pure numpy: nothing here
calls llama.cpp; :mod:`kvlocal.runtime.state` reads and writes a context's cells with these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvlocal.kernels import transpose16
from kvlocal.errors import UsageError
from kvlocal.runtime.kvquant import codec, type_name

SEQ_STATE_MAGIC = 0xAF143CD8
SEQ_ID = 0  # kvlocal's contexts hold one sequence

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_BF16 = 30
# ggml type → numpy dtype of SeqKV.k/v (BF16 is widened to float32: exact, and narrowed back on write)
_ARRAY_DTYPE = {
    GGML_TYPE_F32: np.dtype(np.float32),
    GGML_TYPE_F16: np.dtype(np.float16),
    GGML_TYPE_BF16: np.dtype(np.float32),
}
_ELEM_BYTES = {GGML_TYPE_F32: 4, GGML_TYPE_F16: 2, GGML_TYPE_BF16: 2}
_META_PLAIN = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
_META_EXT = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("ext", "<i4", (3,)), ("seq", "<i4")])


@dataclass
class SeqKV:
    """The cells of sequence 0, in cell (blob) order.

    ``k[il]`` and ``v[il]`` are ``[n, n_head_kv, head_dim]``: float16 for an F16 cache, float32 for F32
    (and for BF16, widened exactly); for a quantized cache ``[n, n_head_kv, head_bytes]`` uint8, each
    head's raw blocks (:mod:`.kvquant` decodes them). Keys are after RoPE. Row ``k[il][j, h]`` is what KV head ``h`` of
    layer ``il`` attends to in cell ``j``; rows of different heads (and layers) in one cell may come
    from different tokens — a cell has only the one position ``pos[j]``, used for the causal mask and
    for "next position = max + 1". Arrays of a fresh read are views into one buffer (V is copied when
    the cache stores it transposed); :meth:`copy` detaches them.
    """

    pos: np.ndarray  # [n] int32
    k: list[np.ndarray]  # per layer [n, n_head_kv, head_dim]
    v: list[np.ndarray]  # per layer [n, n_head_kv, head_dim] (V un-transposed)
    v_trans: bool  # how the context stores V: transposed when flash attention is off
    k_type: int  # ggml type of the K cache
    v_type: int  # ggml type of the V cache
    ext: np.ndarray | None = None  # [n, 3] int32 (x, y, token) for caches that keep cell ext (M-RoPE, PLE)
    seq_id: int = SEQ_ID  # seq id written in the header (llama.cpp ignores it on load)
    tail: np.ndarray | None = None  # raw bytes after the cache (an iSWA memory's sliding-window cache)
    blob: np.ndarray | None = None  # the blob a fresh read parsed (its arrays are views into it), else None
    bias: list[np.ndarray] | None = None  # per layer [n, n_head_kv] float32 attention bias; None = all 0
    # read where the cache lies (HostView.read): k/v (an untransposed v) are views of llama.cpp's cache, or, in a
    # recall union (StateBackend.extend), scratch copies of them (HostView.holds tells): applied through the view
    in_place: bool = False

    @property
    def n(self) -> int:
        return int(self.pos.shape[0])

    @property
    def n_layer(self) -> int:
        return len(self.k)

    def copy(self) -> "SeqKV":
        return SeqKV(
            pos=self.pos.copy(), k=[a.copy() for a in self.k], v=[a.copy() for a in self.v], v_trans=self.v_trans,
            k_type=self.k_type, v_type=self.v_type, ext=None if self.ext is None else self.ext.copy(),
            seq_id=self.seq_id, tail=None if self.tail is None else self.tail.copy(),
            bias=None if self.bias is None else [a.copy() for a in self.bias],
        )

    def select(self, cells) -> "SeqKV":
        """A new SeqKV with the given cells (indices or boolean mask), in that order; arrays are copies."""
        idx = np.asarray(cells)
        return SeqKV(
            pos=self.pos[idx].copy(), k=[a[idx] for a in self.k], v=[a[idx] for a in self.v], v_trans=self.v_trans,
            k_type=self.k_type, v_type=self.v_type, ext=None if self.ext is None else self.ext[idx].copy(),
            seq_id=self.seq_id, tail=None if self.tail is None else self.tail.copy(),
            bias=None if self.bias is None else [a[idx] for a in self.bias],
        )


class _Reader:
    def __init__(self, buf: np.ndarray):
        self.buf = buf
        self.off = 0

    def scalar(self, dtype: str) -> int:
        dt = np.dtype(dtype)
        if self.off + dt.itemsize > self.buf.size:
            raise _Malformed(f"blob ends at byte {self.buf.size} inside a header field")
        val = int(self.buf[self.off : self.off + dt.itemsize].view(dt)[0])
        self.off += dt.itemsize
        return val

    def array(self, dtype, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        nbytes = dt.itemsize * count
        if self.off + nbytes > self.buf.size:
            raise _Malformed(f"blob ends at byte {self.buf.size}, {nbytes} more bytes expected at {self.off}")
        out = self.buf[self.off : self.off + nbytes].view(dt)
        self.off += nbytes
        return out


class _Malformed(Exception):
    pass


def _not_plain_cache() -> UsageError:
    return UsageError(
        "the state KV backend reads a single plain KV cache; this model's memory has another layout "
        "(sliding-window, hybrid or recurrent)"
    )


def _check_cache_type(t: int, which: str) -> None:
    if t in _ARRAY_DTYPE:
        return
    if 0 <= t < 64:  # a ggml type: a quantized cache; UsageError for one kvlocal cannot rewrite
        codec(t)
        return
    raise _Malformed(f"{which} type {t} is not a ggml type")


def _elem_bytes(t: int) -> int:
    """Bytes per array element of a row of type t (1: a quantized row, kept as raw bytes)."""
    return _ELEM_BYTES.get(t, 1)


def row_format(t: int | None, head_dim: int) -> tuple[np.dtype, tuple]:
    """``(dtype, shape)`` of one KV head's row of a cache of type t (None: F16) in :class:`SeqKV`'s arrays:
    values for F16/F32/BF16, raw bytes for a quantized type."""
    t = GGML_TYPE_F16 if t is None else t
    if t in _ARRAY_DTYPE:
        return _ARRAY_DTYPE[t], (head_dim,)
    return np.dtype(np.uint8), (codec(t).row_bytes(head_dim),)


def row_bytes(t: int | None, head_dim: int) -> int:
    """Bytes one KV head's row of a cache of type t (None: F16) takes in llama.cpp."""
    t = GGML_TYPE_F16 if t is None else t
    return _ELEM_BYTES[t] * head_dim if t in _ARRAY_DTYPE else codec(t).row_bytes(head_dim)


def rows_from_bytes(raw: np.ndarray, t: int | None) -> np.ndarray:
    """``[n, row bytes]`` uint8 rows of type t (None: F16), as llama.cpp stores them → ``[n, *shape]`` in
    :func:`row_format` (values, BF16 widened; raw bytes for a quantized type)."""
    t = GGML_TYPE_F16 if t is None else t
    return _rows_to_array(np.ascontiguousarray(raw).reshape(-1), t, len(raw), 1)[:, 0]


def rows_to_bytes(rows: np.ndarray, t: int | None, head_dim: int) -> np.ndarray:
    """The inverse of :func:`rows_from_bytes`: ``[n, row bytes]`` uint8."""
    t = GGML_TYPE_F16 if t is None else t
    out = np.empty((len(rows), row_bytes(t, head_dim)), np.uint8)
    _put_rows(out.reshape(-1), rows, t)
    return out


def _rows_to_array(raw: np.ndarray, t: int, n: int, n_head_kv: int) -> np.ndarray:
    """Raw bytes of n rows of type t → [n, n_head_kv, head_dim] (a view for F16/F32), or
    [n, n_head_kv, head_bytes] uint8 for a quantized type."""
    if t not in _ARRAY_DTYPE:
        return raw.reshape(n, n_head_kv, -1)
    if t == GGML_TYPE_BF16:
        vals = raw.view("<u2").astype(np.uint32) << 16
        vals = vals.view(np.float32)
    else:
        vals = raw.view(_ARRAY_DTYPE[t])
    return vals.reshape(n, n_head_kv, -1)


def parse_blob(buf: np.ndarray, n_layer: int, n_head_kv: int, swa: bool = False, bias: bool = True) -> SeqKV:
    """Parse a sequence-state blob (see the module docstring) into a :class:`SeqKV`.

    n_layer and n_head_kv are the cache's (they split a row into heads and check the layer count: for
    an iSWA memory, the full-attention layers only). ``swa``: the memory is iSWA, so the bytes after
    the first cache are its sliding-window cache (kept raw in :attr:`SeqKV.tail`). ``bias``: the blob has
    the attention-bias section of the patched runtime (a stock one has not).
    """
    try:
        return _parse(buf, n_layer, n_head_kv, swa, bias)
    except _Malformed as e:
        raise RuntimeError(f"unexpected sequence-state blob from llama.cpp: {e}") from None


def _swa_tail(buf: np.ndarray, off: int, swa: bool) -> np.ndarray | None:
    """The bytes after the first cache: an iSWA memory's second cache, else nothing may follow."""
    if not swa:
        if off != buf.size:  # e.g. an iSWA cache read as a plain one
            raise _not_plain_cache()
        return None
    if off + 4 > buf.size or int(buf[off:off + 4].view("<u4")[0]) != 1:
        raise _Malformed("no sliding-window cache with one stream after the full-attention cache")
    return buf[off:]


def _parse(buf: np.ndarray, n_layer: int, n_head_kv: int, swa: bool = False, has_bias_section: bool = True) -> SeqKV:
    r = _Reader(buf)
    magic = r.scalar("<u4")
    if magic != SEQ_STATE_MAGIC:
        raise _Malformed(f"magic {magic:#x}, expected {SEQ_STATE_MAGIC:#x}")
    seq_id = r.scalar("<i4")
    n_stream = r.scalar("<u4")
    if n_stream != 1:
        raise UsageError(f"the state KV backend needs a context with one KV stream (this one has {n_stream})")
    if r.off == buf.size:  # a cache that shares another's cells writes nothing after the stream count
        raise _not_plain_cache()
    n = r.scalar("<u4")
    if n == 0:
        return SeqKV(pos=np.zeros(0, np.int32), k=[], v=[], v_trans=False, k_type=-1, v_type=-1, seq_id=seq_id,
                     tail=_swa_tail(buf, r.off, swa))

    # cell meta: fixed stride, with or without the 12-byte ext; pick the one that parses consistently
    meta = None
    data_off = r.off
    for dt in (_META_PLAIN, _META_EXT):
        end = r.off + n * dt.itemsize
        if end + 8 > buf.size:
            continue
        m = buf[r.off : end].view(dt)
        if not ((m["n_seq"] == 1).all() and (m["seq"] == seq_id).all()):
            continue
        tail = buf[end : end + 8].view("<u4")
        if tail[0] in (0, 1) and tail[1] == n_layer:
            meta, data_off = m, end
            break
    if meta is None:
        raise _not_plain_cache()
    r.off = data_off
    pos = meta["pos"].astype(np.int32)
    ext = meta["ext"].astype(np.int32) if "ext" in meta.dtype.names else None

    v_trans = bool(r.scalar("<u4"))
    if r.scalar("<u4") != n_layer:
        raise _Malformed("layer count")

    k_list, k_types = [], set()
    for il in range(n_layer):
        t = r.scalar("<i4")
        _check_cache_type(t, "K")
        k_types.add(t)
        row = r.scalar("<u8")
        if row % (_elem_bytes(t) * n_head_kv):
            raise _Malformed(f"K row of {row} bytes in layer {il} does not split into {n_head_kv} heads")
        k_list.append(_rows_to_array(r.array(np.uint8, n * row), t, n, n_head_kv))

    v_list, v_types = [], set()
    for il in range(n_layer):
        t = r.scalar("<i4")
        _check_cache_type(t, "V")
        v_types.add(t)
        if not v_trans:
            row = r.scalar("<u8")
            if row % (_elem_bytes(t) * n_head_kv):
                raise _Malformed(f"V row of {row} bytes in layer {il} does not split into {n_head_kv} heads")
            v_list.append(_rows_to_array(r.array(np.uint8, n * row), t, n, n_head_kv))
        else:
            if t not in _ARRAY_DTYPE:  # llama.cpp stores a quantized V cache only untransposed (flash attention)
                raise _Malformed(f"a transposed {type_name(t)} V cache")
            el = r.scalar("<u4")
            if el != _ELEM_BYTES[t]:
                raise _Malformed(f"V element of {el} bytes for {type_name(t)}")
            n_embd_v = r.scalar("<u4")
            if n_embd_v % n_head_kv:
                raise _Malformed(f"n_embd_v_gqa {n_embd_v} does not split into {n_head_kv} heads")
            raw = r.array(np.uint8, n * n_embd_v * el)
            vt = _rows_to_array(raw, t, n_embd_v, 1).reshape(n_embd_v, n)  # [element, cell]
            cells = transpose16(vt) if vt.dtype.itemsize == 2 else np.ascontiguousarray(vt.T)
            v_list.append(cells.reshape(n, n_head_kv, n_embd_v // n_head_kv))
    has_bias = r.scalar("<u4") if has_bias_section else 0
    if has_bias not in (0, 1):
        raise _Malformed(f"attention bias flag {has_bias}")
    bias = None
    if has_bias:  # per layer [n_head_kv, n] f32 -> [n, n_head_kv]
        bias = [r.array("<f4", n_head_kv * n).reshape(n_head_kv, n).T for _ in range(n_layer)]
    tail = _swa_tail(buf, r.off, swa)
    if len(k_types) != 1 or len(v_types) != 1:
        raise _Malformed("cache types differ between layers")
    return SeqKV(
        pos=pos, k=k_list, v=v_list, v_trans=v_trans, k_type=k_types.pop(), v_type=v_types.pop(), ext=ext, seq_id=seq_id,
        tail=tail, bias=bias,
    )


def _put_rows(dst: np.ndarray, a: np.ndarray, t: int) -> None:
    """Write [n, ...] values (raw bytes for a quantized type) as rows of ggml type t into the uint8 view dst
    (nothing to do where ``a`` already is those bytes: :func:`blob_rows`)."""
    if _placed(a, dst, t):
        return
    if t not in _ARRAY_DTYPE:
        dst[:] = np.reshape(a, -1)
    elif t == GGML_TYPE_BF16:
        u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).reshape(-1)
        # round to nearest even, as ggml_fp32_to_bf16 does (NaN kept quiet)
        r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        if nan.any():
            r[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
        dst.view("<u2")[:] = r
    else:
        dst.view(_ARRAY_DTYPE[t]).reshape(np.shape(a)[0], -1)[:] = np.reshape(a, (np.shape(a)[0], -1))


def _placed(a, dst: np.ndarray, t: int) -> bool:
    """Whether array ``a`` is the bytes of uint8 view ``dst`` already, as rows of type t."""
    return (isinstance(a, np.ndarray) and a.flags.c_contiguous and a.nbytes == dst.nbytes
            and a.dtype == (_ARRAY_DTYPE[t] if t in _ARRAY_DTYPE and t != GGML_TYPE_BF16 else np.uint8)
            and a.__array_interface__["data"][0] == dst.__array_interface__["data"][0])


def _row_sections(n: int, ext: bool, k_rows: list[int], v_rows: list[int]) -> tuple[list[int], list[int], int]:
    """Where an n-cell blob's K and V rows begin (per layer, after the layer's 12-byte header), and the offset
    after them (the bias section's): rows of ``k_rows[l]``/``v_rows[l]`` bytes."""
    off = 16 + n * (_META_EXT if ext else _META_PLAIN).itemsize + 8
    k_at, v_at = [], []
    for rows, at in ((k_rows, k_at), (v_rows, v_at)):
        for row in rows:
            at.append(off + 12)
            off += 12 + n * row
    return k_at, v_at, off


def blob_rows(like: SeqKV, n: int, alloc: Callable[[int], np.ndarray]) -> tuple[list | None, list | None]:
    """Per layer K and V arrays ``[n, n_head_kv, ...]`` of ``like``'s dtypes and row shapes, lying where
    :func:`build_blob` puts an n-cell blob's rows in the buffer ``alloc(nbytes)`` gives (asked once for the
    largest such blob, bias section included): rows written into them are in place, and ``build_blob`` of a
    SeqKV holding them, built in a buffer that ``alloc`` gives at the same address, copies none of them. K's or
    V's are None where the stored rows are not an array's bytes (BF16, a transposed V); both where there is no
    cell or a sliding-window cache's bytes follow (``build_blob`` appends them to a new buffer)."""
    if n == 0 or like.tail is not None:
        return None, None
    k_fmt, v_fmt = ([(a.shape[1:], _ARRAY_DTYPE.get(t, np.dtype(np.uint8))) for a in arrays]
                    for arrays, t in ((like.k, like.k_type), (like.v, like.v_type)))
    k_rows, v_rows = ([int(np.prod(shape)) * _elem_bytes(t) for shape, _ in fmt]
                      for fmt, t in ((k_fmt, like.k_type), (v_fmt, like.v_type)))
    k_at, v_at, end = _row_sections(n, like.ext is not None, k_rows, v_rows)
    buf = alloc(end + 4 + 4 * n * sum(int(np.prod(a.shape[1:-1])) for a in like.k))  # + every layer's bias
    placed = (like.k_type != GGML_TYPE_BF16, like.v_type != GGML_TYPE_BF16 and not like.v_trans)
    return tuple([buf[at:at + n * row].view(dt).reshape(n, *shape) for at, row, (shape, dt) in zip(ats, rows, fmt)]
                 if ok else None for ok, ats, rows, fmt in zip(placed, (k_at, v_at), (k_rows, v_rows), (k_fmt, v_fmt)))


def build_blob(kv: SeqKV, pos: np.ndarray | None = None, bias: bool = True,
               alloc: Callable[[int], np.ndarray] | None = None) -> np.ndarray:
    """The sequence-state blob for kv (the inverse of :func:`parse_blob`), without validation. ``bias``:
    write the patched runtime's attention-bias section (``kv.bias`` must be None without it). ``alloc(nbytes)``:
    the uint8 buffer to build it in (default: a new one; a sliding-window tail is always appended to a new one)."""
    if kv.bias is not None and not bias:
        raise UsageError("an attention bias (merged or head-budgeted cells) needs kvlocal's patched llama.cpp (patch 0007)")
    pos = np.asarray(kv.pos if pos is None else pos, dtype=np.int32)
    n = pos.shape[0]
    n_layer = len(kv.k)
    meta_dt = _META_EXT if kv.ext is not None else _META_PLAIN
    size = 12 + 4
    if n:
        k_rows = [int(np.prod(np.shape(a)[1:])) * _elem_bytes(kv.k_type) for a in kv.k]
        v_rows = [int(np.prod(np.shape(a)[1:])) * _elem_bytes(kv.v_type) for a in kv.v]
        # (a layer's header: i32 type + u64 row bytes, or i32 type + u32 elem + u32 n_embd)
        size = _row_sections(n, kv.ext is not None, k_rows, v_rows)[2]
        size += (4 if bias else 0) + (0 if kv.bias is None else sum(4 * int(np.size(b)) for b in kv.bias))
    buf = alloc(size) if alloc is not None and kv.tail is None else np.empty(size, dtype=np.uint8)
    off = 0

    def put(dtype: str, val: int) -> None:
        nonlocal off
        dt = np.dtype(dtype)
        buf[off : off + dt.itemsize].view(dt)[0] = val
        off += dt.itemsize

    put("<u4", SEQ_STATE_MAGIC)
    put("<i4", kv.seq_id)
    put("<u4", 1)
    put("<u4", n)
    if n == 0:
        return buf[:off] if kv.tail is None else np.concatenate([buf[:off], kv.tail])
    meta = buf[off : off + n * meta_dt.itemsize].view(meta_dt)
    meta["pos"] = pos
    meta["n_seq"] = 1
    meta["seq"] = kv.seq_id
    if kv.ext is not None:
        meta["ext"] = kv.ext
    off += n * meta_dt.itemsize
    put("<u4", 1 if kv.v_trans else 0)
    put("<u4", n_layer)
    for a, row in zip(kv.k, k_rows):
        put("<i4", kv.k_type)
        put("<u8", row)
        _put_rows(buf[off : off + n * row], a, kv.k_type)
        off += n * row
    el = _elem_bytes(kv.v_type)
    for a, row in zip(kv.v, v_rows):
        put("<i4", kv.v_type)
        if not kv.v_trans:
            put("<u8", row)
            _put_rows(buf[off : off + n * row], a, kv.v_type)
        else:
            n_embd_v = row // el
            put("<u4", el)
            put("<u4", n_embd_v)
            if kv.v_type == GGML_TYPE_BF16:
                _put_rows(buf[off : off + n * row], np.reshape(a, (n, n_embd_v)).T, kv.v_type)
            else:  # [element, cell] from [cell, element]
                dst = buf[off : off + n * row].view(_ARRAY_DTYPE[kv.v_type]).reshape(n_embd_v, n)
                cells = np.reshape(a, (n, n_embd_v))
                if cells.dtype == dst.dtype == np.float16:
                    transpose16(np.ascontiguousarray(cells), dst)
                else:
                    dst[:] = cells.T
        off += n * row
    if bias:
        put("<u4", 0 if kv.bias is None else 1)
    for b in kv.bias or []:
        nb = 4 * int(np.size(b))
        buf[off : off + nb].view("<f4").reshape(-1, n)[:] = np.asarray(b, dtype=np.float32).T
        off += nb
    assert off == size, (off, size)
    return buf if kv.tail is None else np.concatenate([buf, kv.tail])
