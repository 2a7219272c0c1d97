"""Reading and rewriting sequence 0 through llama.cpp's sequence-state blob (what the state KV backend uses).

Works on any llama.cpp build (no patch needed): ``llama_state_seq_get_data`` copies the cells of a
sequence into a host buffer, kvlocal parses it into numpy arrays (:class:`SeqKV`), and
``llama_state_seq_set_data`` loads an edited copy back. Eviction and per-KV-head rearrangement (a cell
may hold head 0's row of one token and head 1's row of another) are expressed by the arrays alone.

Blob layout of llama.cpp 0c1e57098 with kvlocal's patches (``LLAMA_STATE_SEQ_VERSION 4``: patch 0007 adds
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
from typing import Callable

import numpy as np

from kvlocal.errors import UsageError
from kvlocal.runtime.kvquant import codec, type_name
from kvlocal.runtime.library import has_attention_bias, llama_lib
from kvlocal.runtime.llama import checks_servers
from kvlocal.runtime.seqstate import SEQ_ID, SeqKV, build_blob, parse_blob

STATE_FLAGS = 0  # never LLAMA_STATE_SEQ_FLAGS_ON_DEVICE: such blobs abort the process when edited

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


@checks_servers
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


def check_positions(pos: np.ndarray, n_cells: int) -> None:
    """ValueError unless ``pos`` can be the positions of a sequence's cells in a cache of ``n_cells``: at most that
    many, each non-negative, in int32, and every cell its own."""
    n = pos.shape[0]
    if n > n_cells:
        raise ValueError(f"{n} cells do not fit in a context of {n_cells} cells")
    if n:
        if pos.min() < 0:
            raise ValueError(f"negative position {int(pos.min())} at cell {int(np.argmin(pos))}")
        if pos.max() > np.iinfo(np.int32).max:
            raise ValueError(f"position {int(pos.max())} does not fit in int32")
        s = np.sort(pos)
        dup = s[1:][s[1:] == s[:-1]]
        if dup.size:
            raise ValueError(f"duplicate positions: {np.unique(dup)[:10].tolist()} (every cell needs its own position)")


def _validate(ctx, kv: SeqKV) -> np.ndarray:
    pos = np.asarray(kv.pos)
    if pos.ndim != 1:
        raise ValueError(f"pos must be one-dimensional, got shape {pos.shape}")
    if pos.size and not np.issubdtype(pos.dtype, np.integer):
        raise ValueError(f"pos must hold integers, got {pos.dtype}")
    n = pos.shape[0]
    check_positions(pos, ctx.n_ctx)
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


@checks_servers
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


def write_seq(ctx, kv: SeqKV, previous: np.ndarray | None = None,
              alloc: Callable[[int], np.ndarray] | None = None) -> None:
    """Replace sequence 0 with exactly the cells of kv, loaded into cells 0..n-1 in kv's cell order.

    Validates first (raises ValueError, cache untouched): at most ctx.n_ctx cells, non-negative unique
    positions, one [n, n_head_kv, head_dim] array per layer for k and v, and — when this context was read
    before — the same cache types and V layout. Arrays of another float dtype are converted to the cache
    type (float32 → F16 rounds). The next decoded token must go at ``max(pos) + 1``.

    All or nothing: ``previous`` is the blob of the cells held now (taken here when not given); if
    llama.cpp refuses the new cells — or the write is interrupted — it is loaded back and the error is
    raised again; if that fails too, :class:`CacheLost`. ``alloc(nbytes)``: the buffer the blob is built in
    (llama.cpp copies it in; :func:`build_blob`'s).
    """
    pos = _validate(ctx, kv)
    buf = build_blob(kv, pos, bias=has_attention_bias(), alloc=alloc) if pos.size or kv.tail is not None else None
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
