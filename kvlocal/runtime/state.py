"""The "state" KV backend: read and rewrite sequence 0 through llama.cpp's sequence-state blob.

Works on any llama.cpp build (no patch needed): ``llama_state_seq_get_data`` copies the cells of a
sequence into a host buffer, kvlocal parses it into numpy arrays (:class:`SeqKV`), and
``llama_state_seq_set_data`` loads an edited copy back. Eviction and per-KV-head rearrangement (a cell
may hold head 0's row of one token and head 1's row of another) are expressed by the arrays alone.

Blob layout of llama.cpp 0c1e57098 with kvlocal's patches (``LLAMA_STATE_SEQ_VERSION 4``: patch 0006 adds
the per-head attention bias) for a plain ``llama_kv_cache``, all integers little-endian, no padding
(src/llama-context.cpp ``state_seq_get_data``, src/llama-kv-cache.cpp ``state_write`` /
``state_write_meta`` / ``state_write_data``)::

    u32 magic 0xaf143cd8 · i32 seq_id · u32 n_stream
    per stream: u32 cell_count                      (0: nothing else for this stream)
      meta, per cell in cell-index order:
        i32 pos · u32 n_seq_id (=1) · [i32 x, i32 y, i32 tok if the cache keeps cell ext] · i32 seq_id
      u32 v_trans · u32 n_layer
      per layer: i32 k_type · u64 k_row_bytes · cell_count rows of K  (row = n_embd_k_gqa elements,
                 head-major: [n_head_kv, head_dim])
      v_trans = 0 (flash attention on), per layer:
                 i32 v_type · u64 v_row_bytes · cell_count rows of V
      v_trans = 1 (flash attention off), per layer:
                 i32 v_type · u32 v_elem_bytes · u32 n_embd_v_gqa ·
                 for each element j < n_embd_v_gqa: the cell_count values of element j
      u32 has_bias (0: no cell holds a bias, nothing follows)
      has_bias = 1, per layer: n_head_kv rows of cell_count f32 (each KV head's bias of every cell)

Cells are read back in blob order into free cells found from the cache head: after this module's
:func:`write_seq` (which empties the sequence and resets the head) blob cell ``i`` is cache cell ``i``.
Rows are raw ggml rows: F16, F32 and BF16 caches are parsed into arrays of values; quantized ones (q8_0,
q4_0, ...) into arrays of each head's raw bytes, which eviction copies untouched (:mod:`.kvquant` reads
them: blocks, and the Walsh–Hadamard rotation llama.cpp stores them in).

Caveats:

- ``llama_memory_seq_add`` re-rotates keys lazily at the next decode and the blob does not carry the
  pending shift: reading between a ``seq_add`` and the next decode gives keys rotated at the old
  positions labelled with the new ones. kvlocal keeps original positions and does not shift.
- set_data validates almost nothing, so :func:`write_seq` validates (unique, non-negative positions,
  shapes, cell count) before it touches the cache. A SeqKV whose cache types or V layout differ from
  the context's (read from another context) fails inside llama.cpp after the sequence was emptied.
- An interleaved sliding-window memory (Gemma 3: ``llama_kv_cache_iswa``) writes its full-attention
  cache (the layers of ``ArchInfo.full_layers``) and then its sliding-window cache in the same layout.
  The first is parsed; the second is kept as raw bytes (:attr:`SeqKV.tail`) and written back unchanged:
  llama.cpp bounds that cache itself. Other memories (hybrid, recurrent) are refused.
- :func:`write_seq` is all or nothing: when llama.cpp refuses the new cells, the previous ones are
  loaded back and the error says so; if even that fails, :class:`CacheLost` is raised.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import numpy as np

from kvlocal.errors import UsageError
from kvlocal.runtime.kvquant import codec, type_name
from kvlocal.runtime.library import has_attention_bias, llama_lib

SEQ_STATE_MAGIC = 0xAF143CD8
SEQ_ID = 0
STATE_FLAGS = 0  # never LLAMA_STATE_SEQ_FLAGS_ON_DEVICE: such blobs abort the process when edited

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


@dataclass(frozen=True)
class _Geometry:
    """What a context's cache looks like, learned from its last non-empty read (checked before a write)."""

    k_type: int
    v_type: int
    v_trans: bool
    k_shape: tuple  # per layer (n_head_kv, head_dim)
    v_shape: tuple
    has_ext: bool


_GEOMETRY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _layout(kv: SeqKV) -> tuple:
    """The fields of :class:`_Geometry` that kv implies."""
    k_shape = tuple(tuple(np.shape(a)[1:]) for a in kv.k)
    v_shape = tuple(tuple(np.shape(a)[1:]) for a in kv.v)
    return (kv.k_type, kv.v_type, bool(kv.v_trans), k_shape, v_shape, kv.ext is not None)


def _u8_ptr(buf: np.ndarray):
    return buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


# -- reading ----------------------------------------------------------------------------------------


def _check_open(ctx) -> None:
    if not getattr(ctx, "_ptr", None):
        raise UsageError("this llama.cpp context has been closed")


def get_blob(ctx) -> np.ndarray:
    """The raw sequence-state blob of sequence 0 (uint8 array), flags 0 (host copy)."""
    _check_open(ctx)
    lib = llama_lib()
    size = lib.llama_state_seq_get_size_ext(ctx._ptr, SEQ_ID, STATE_FLAGS)
    if size == 0:
        raise RuntimeError("llama_state_seq_get_size failed (llama.cpp logged the reason)")
    buf = np.empty(size, dtype=np.uint8)
    n = lib.llama_state_seq_get_data_ext(ctx._ptr, _u8_ptr(buf), size, SEQ_ID, STATE_FLAGS)
    if n != size:
        raise RuntimeError(f"llama_state_seq_get_data wrote {n} bytes, expected {size}")
    return buf


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
            v_list.append(np.ascontiguousarray(vt.T).reshape(n, n_head_kv, n_embd_v // n_head_kv))
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


def read_seq(ctx) -> SeqKV:
    """K, V and positions of every cell of sequence 0 of a :class:`~kvlocal.runtime.Context`.

    For an iSWA memory (Gemma 3) the arrays hold the full-attention layers (``arch.full_layers``, in that
    order) and ``tail`` the sliding-window cache. Raises UsageError for a cache type kvlocal cannot rewrite
    or a memory that is neither a KV cache nor an iSWA one.
    """
    arch = ctx.model.arch
    blob = get_blob(ctx)
    kv = parse_blob(blob, len(arch.full_layers), arch.n_head_kv, swa=arch.has_swa, bias=has_attention_bias())
    kv.blob = blob
    if kv.n:
        _GEOMETRY[ctx] = _Geometry(*_layout(kv))
    return kv


# -- writing ----------------------------------------------------------------------------------------


def _validate(ctx, kv: SeqKV) -> np.ndarray:
    pos = np.asarray(kv.pos)
    if pos.ndim != 1:
        raise ValueError(f"pos must be one-dimensional, got shape {pos.shape}")
    if pos.size and not np.issubdtype(pos.dtype, np.integer):
        raise ValueError(f"pos must hold integers, got {pos.dtype}")
    n = pos.shape[0]
    if n > ctx.n_ctx:
        raise ValueError(f"{n} cells do not fit in a context of {ctx.n_ctx} cells")
    if n:
        if pos.min() < 0:
            raise ValueError(f"negative position {int(pos.min())} at cell {int(np.argmin(pos))}")
        if pos.max() > np.iinfo(np.int32).max:
            raise ValueError(f"position {int(pos.max())} does not fit in int32")
        s = np.sort(pos)
        dup = s[1:][s[1:] == s[:-1]]
        if dup.size:
            raise ValueError(f"duplicate positions: {np.unique(dup)[:10].tolist()} (every cell needs its own position)")
    if n == 0:
        return pos.astype(np.int32)
    n_layer, n_head_kv = len(ctx.model.arch.full_layers), ctx.model.arch.n_head_kv
    if ctx.model.arch.has_swa and kv.tail is None:
        raise ValueError("this context's memory has a sliding-window cache: kv.tail must hold it (from read_seq)")
    if len(kv.k) != n_layer or len(kv.v) != n_layer:
        raise ValueError(f"k and v need one array per layer ({n_layer}), got {len(kv.k)} and {len(kv.v)}")
    for name, arrays, t in (("k", kv.k, kv.k_type), ("v", kv.v, kv.v_type)):
        if not 0 <= t < 64:
            raise ValueError(f"{name}_type {t} is not a ggml type")
        quantized = codec(t) is not None  # UsageError for a type kvlocal cannot rewrite
        if quantized and name == "v" and kv.v_trans:
            raise ValueError("a quantized V cache is never transposed (llama.cpp needs flash attention for it)")
        for il, a in enumerate(arrays):
            shape = np.shape(a)
            if len(shape) != 3 or shape[0] != n or shape[1] != n_head_kv:
                raise ValueError(f"{name}[{il}] has shape {shape}, expected ({n}, {n_head_kv}, head_dim)")
            if shape != np.shape(arrays[0]):
                raise ValueError(f"{name}[{il}] has shape {shape}, {name}[0] has {np.shape(arrays[0])}")
            dt = np.asarray(a).dtype
            if quantized and dt != np.uint8:
                raise ValueError(f"{name}[{il}] of a {type_name(t)} cache must hold raw rows (uint8), got {dt}")
            if not quantized and not np.issubdtype(dt, np.floating):
                raise ValueError(f"{name}[{il}] must be floating point, got {dt}")
    if kv.ext is not None and np.shape(kv.ext) != (n, 3):
        raise ValueError(f"ext has shape {np.shape(kv.ext)}, expected ({n}, 3)")
    if kv.bias is not None:
        if len(kv.bias) != n_layer or any(np.shape(b) != (n, n_head_kv) for b in kv.bias):
            raise ValueError(f"bias needs one [{n}, {n_head_kv}] array per layer ({n_layer}), "
                             f"got {[np.shape(b) for b in kv.bias]}")
        if any(np.isnan(b).any() or (np.asarray(b) == np.inf).any() for b in kv.bias):
            raise ValueError("bias must be finite or -inf (an unused row), not NaN or +inf")
    geo = _GEOMETRY.get(ctx)
    if geo is not None:  # the context's own layout, known from a read: refuse before emptying the cache
        got = _layout(kv)
        want = (geo.k_type, geo.v_type, geo.v_trans, geo.k_shape, geo.v_shape, geo.has_ext)
        if got != want:
            names = ("k_type", "v_type", "v_trans", "k row shapes", "v row shapes", "cell ext")
            diff = [f"{nm} {g} (context: {w})" for nm, g, w in zip(names, got, want) if g != w]
            raise ValueError("this SeqKV does not match the context's cache: " + "; ".join(diff))
    return pos.astype(np.int32)


def _put_rows(dst: np.ndarray, a: np.ndarray, t: int) -> None:
    """Write [n, ...] values (raw bytes for a quantized type) as rows of ggml type t into the uint8 view dst."""
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


def build_blob(kv: SeqKV, pos: np.ndarray | None = None, bias: bool = True) -> np.ndarray:
    """The sequence-state blob for kv (the inverse of :func:`parse_blob`), without validation. ``bias``:
    write the patched runtime's attention-bias section (``kv.bias`` must be None without it)."""
    if kv.bias is not None and not bias:
        raise UsageError("an attention bias (merged or head-budgeted cells) needs kvlocal's patched llama.cpp (patch 0006)")
    pos = np.asarray(kv.pos if pos is None else pos, dtype=np.int32)
    n = pos.shape[0]
    n_layer = len(kv.k)
    meta_dt = _META_EXT if kv.ext is not None else _META_PLAIN
    size = 12 + 4
    if n:
        size += n * meta_dt.itemsize + 8
        k_rows = [int(np.prod(np.shape(a)[1:])) * _elem_bytes(kv.k_type) for a in kv.k]
        v_rows = [int(np.prod(np.shape(a)[1:])) * _elem_bytes(kv.v_type) for a in kv.v]
        size += sum(12 + n * r for r in k_rows)
        size += sum(12 + n * r for r in v_rows)  # i32 type + u64 row bytes, or i32 type + u32 elem + u32 n_embd
        size += (4 if bias else 0) + (0 if kv.bias is None else sum(4 * int(np.size(b)) for b in kv.bias))
    buf = np.empty(size, dtype=np.uint8)
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
            else:  # [element, cell]: one strided copy from [cell, element]
                dst = buf[off : off + n * row].view(_ARRAY_DTYPE[kv.v_type]).reshape(n_embd_v, n)
                dst[:] = np.reshape(a, (n, n_embd_v)).T
        off += n * row
    if bias:
        put("<u4", 0 if kv.bias is None else 1)
    for b in kv.bias or []:
        nb = 4 * int(np.size(b))
        buf[off : off + nb].view("<f4").reshape(-1, n)[:] = np.asarray(b, dtype=np.float32).T
        off += nb
    assert off == size, (off, size)
    return buf if kv.tail is None else np.concatenate([buf, kv.tail])


def set_blob(ctx, buf: np.ndarray) -> None:
    """Load a sequence-state blob into sequence 0 (flags 0). Raises RuntimeError when llama.cpp refuses it
    (the sequence is then empty: llama.cpp clears a failed restore)."""
    _check_open(ctx)
    lib = llama_lib()
    n = lib.llama_state_seq_set_data_ext(ctx._ptr, _u8_ptr(buf), buf.size, SEQ_ID, STATE_FLAGS)
    if n != buf.size:
        raise RuntimeError(
            f"llama_state_seq_set_data refused the rewritten cache ({n} of {buf.size} bytes read; llama.cpp logged "
            "the reason, e.g. a K/V type or layout that differs from this context's)"
        )


class CacheLost(RuntimeError):
    """A rewrite failed and the previous cells could not be loaded back: the sequence is empty and the
    context must not be decoded in again (the engine marks itself unusable)."""


def clear_seq(ctx) -> None:
    """Empty sequence 0 and, in a single-sequence context, move the cache head back to cell 0 so that the
    next load fills cells 0..n-1 in blob order."""
    _check_open(ctx)
    lib = llama_lib()
    if not lib.llama_memory_seq_rm(ctx._mem, SEQ_ID, -1, -1):
        raise RuntimeError("llama_memory_seq_rm(0, -1, -1) failed")
    if lib.llama_n_seq_max(ctx._ptr) == 1:
        lib.llama_memory_clear(ctx._mem, False)  # nothing is left; only resets the head (no data cleared)


def write_seq(ctx, kv: SeqKV, previous: np.ndarray | None = None) -> None:
    """Replace sequence 0 with exactly the cells of kv, loaded into cells 0..n-1 in kv's cell order.

    Validates first (raises ValueError, cache untouched): at most ctx.n_ctx cells, non-negative unique
    positions, one [n, n_head_kv, head_dim] array per layer for k and v, and — when this context was read
    before — the same cache types and V layout. Arrays of another float dtype are converted to the cache
    type (float32 → F16 rounds). The next decoded token must go at ``max(pos) + 1``.

    All or nothing: ``previous`` is the blob of the cells held now (taken here when not given); if
    llama.cpp refuses the new cells — or the write is interrupted — it is loaded back and the error is
    raised again; if that fails too, :class:`CacheLost`.
    """
    pos = _validate(ctx, kv)
    buf = build_blob(kv, pos, bias=has_attention_bias()) if pos.size or kv.tail is not None else None
    if previous is None:
        previous = get_blob(ctx)
    clear_seq(ctx)
    try:
        if buf is not None:
            set_blob(ctx, buf)
    except BaseException as e:
        try:
            clear_seq(ctx)
            set_blob(ctx, previous)
        except Exception as again:
            raise CacheLost(f"{e}; restoring the previous cells failed too ({again}): the cache is empty") from e
        if isinstance(e, RuntimeError):
            raise RuntimeError(f"{e}; the previous cells were loaded back") from e
        raise
