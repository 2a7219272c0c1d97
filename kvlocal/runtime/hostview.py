"""llama.cpp's K/V cache read and written where it lies: the state backend's events without a state blob.

On the CPU (and wherever a backend's buffers are host memory) the cache's K and V tensors are ordinary
memory. The patched runtime says where (``llama_kv_host_view``, patch 0012), and :class:`HostView` lays numpy
arrays over it, per compressed layer. An event then reads the cells as views (no copy; a transposed V,
flash attention off, is turned into rows in scratch memory) and puts the plan's rows into the first cells: a
prompt's events move each head's kept rows forward where they lie (:meth:`HostView.compact`, kernels/cpu/compact.c:
a row that stays is not touched, a transposed V moves as columns); merged rows, empty slots and a recall union's
rows are gathered into scratch rows and copied in (:meth:`HostView.write`). Then ``llama_kv_compact`` with every
source ``-1`` moves no row and sets the cells' positions and biases. The state blob's way copied every cell out
and back, and built and parsed a blob each way: a second copy of the cache in host memory at every event.

Only where the sequence's cells are cells ``0..n-1`` of the cache (they are after every compaction and
prefill chunk of a one-sequence context); elsewhere, and for a BF16 cache (its rows are not numpy values),
the state backend reads and writes the blob as before.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvlocal.kernels import compact_columns, compact_rows, transpose16
from kvlocal.runtime.kvquant import FLOAT_TYPES, GGML_TYPE_BF16, GGML_TYPE_F16
from kvlocal.runtime.library import patch_functions
from kvlocal.runtime.seqstate import SeqKV, row_bytes, row_format
from kvlocal.runtime.state import CacheLost, check_positions

# KVLOCAL_STATE_IO=blob: the state backend reads and writes through the state blob even where the cache lies in
# host memory, unless told otherwise (StateBackend(in_place=...)): for comparisons of whole runs (tools/profile_prefill)
STATE_IO_ENV = "KVLOCAL_STATE_IO"


def _array(address: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of memory at ``address`` as a writable uint8 array (no copy)."""
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=np.uint8)


class HostView:
    """Numpy arrays over llama.cpp's K and V cache tensors, per compressed layer: ``k[l]`` ``[size, Hkv, row]``
    (values of an F16/F32 cache, a quantized one's raw bytes per head) and ``v[l]`` the same, or ``[Hkv * d,
    size]`` where the cache stores V transposed (``v_trans``). ``size`` is the cache's cells. Valid while the
    context is open (checked at each use)."""

    def __init__(self, ctx, k: list[np.ndarray], v: list[np.ndarray], v_trans: bool, k_type: int, v_type: int):
        self.ctx, self.k, self.v, self.v_trans, self.k_type, self.v_type = ctx, k, v, v_trans, k_type, v_type
        self.n_head_kv = k[0].shape[1]
        self._no_moves = np.zeros((0, 0, 0), np.int32)

    @classmethod
    def open(cls, ctx, n_layer: int, n_head_kv: int, head_dims: tuple[int, int]) -> "HostView | None":
        """The view of ``ctx``'s cache (its ``n_layer`` compressed layers), or None where there is none: a runtime
        without patch 0012, a cache off the host (a GPU's), a BF16 cache, a quantized row of one block (a head of 32
        dimensions)."""
        fn = patch_functions()["host_view"]
        k_type = GGML_TYPE_F16 if ctx.type_k is None else ctx.type_k
        v_type = GGML_TYPE_F16 if ctx.type_v is None else ctx.type_v
        if fn is None or GGML_TYPE_BF16 in (k_type, v_type):
            return None
        (k_dt, k_row), (v_dt, v_row) = row_format(k_type, head_dims[0]), row_format(v_type, head_dims[1])
        k_bytes, v_bytes = row_bytes(k_type, head_dims[0]), row_bytes(v_type, head_dims[1])
        if any(b % 4 for t, b in ((k_type, k_bytes), (v_type, v_bytes)) if t not in FLOAT_TYPES):
            return None  # a quantized row of one block: llama_kv_compact, which sets the cells, refuses the cache
        ks, vs = [], []
        trans = None
        for l in range(n_layer):
            kp, vp, k_stride, v_stride, vt = (ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t(),
                                              ctypes.c_size_t(), ctypes.c_int32())
            size = fn(ctx._ptr, l, ctypes.byref(kp), ctypes.byref(k_stride), ctypes.byref(vp), ctypes.byref(v_stride),
                      ctypes.byref(vt))
            if size <= 0 or not kp.value or not vp.value:
                return None  # -2: not in host memory
            trans = bool(vt.value)
            if k_stride.value != n_head_kv * k_bytes:
                return None  # padded rows: not laid out as [cell, head, row]
            ks.append(_array(kp.value, size * k_stride.value).view(k_dt).reshape(size, n_head_kv, *k_row))
            if trans:
                if v_stride.value != size * v_dt.itemsize:
                    return None
                vs.append(_array(vp.value, n_head_kv * head_dims[1] * v_stride.value).view(v_dt)
                          .reshape(n_head_kv * head_dims[1], size))
            else:
                if v_stride.value != n_head_kv * v_bytes:
                    return None
                vs.append(_array(vp.value, size * v_stride.value).view(v_dt).reshape(size, n_head_kv, *v_row))
        return cls(ctx, ks, vs, bool(trans), k_type, v_type)

    def _check_open(self) -> None:
        if not getattr(self.ctx, "_ptr", None):
            raise RuntimeError("this llama.cpp context has been closed: its cache's memory is gone")

    def read(self, pos: np.ndarray, scratch) -> SeqKV:
        """Cells ``0..n-1`` of the cache (``n = len(pos)``, their positions) as a :class:`SeqKV` of views
        (``in_place``); a transposed V is turned into rows in ``scratch`` buffers, kept between events."""
        self._check_open()
        n = len(pos)
        k = [a[:n] for a in self.k]
        if not self.v_trans:
            v = [a[:n] for a in self.v]
        else:
            v = []
            for i, a in enumerate(self.v):
                rows = scratch.take(("v_read", i), (n, a.shape[0]), a.dtype)
                if a.dtype.itemsize == 2:
                    transpose16(a[:, :n], out=rows)
                else:
                    np.copyto(rows, a[:, :n].T)
                v.append(rows.reshape(n, self.n_head_kv, a.shape[0] // self.n_head_kv))
        return SeqKV(pos=np.asarray(pos, np.int32), k=k, v=v, v_trans=self.v_trans, k_type=self.k_type,
                     v_type=self.v_type, in_place=True)

    def holds(self, kv: SeqKV) -> bool:
        """Whether ``kv``'s rows are this cache's cells (a :meth:`read`), not copies (a recall union's scratch)."""
        return kv.in_place and np.may_share_memory(kv.k[0], self.k[0])

    def compact(self, keep: np.ndarray, n: int, pos: np.ndarray, bias: np.ndarray | None) -> bool:
        """Move the rows of a plan without merges into cells ``0..B-1`` where they lie, then set the cells as
        :meth:`write` does: slot ``j`` of layer ``l``'s KV head ``h`` takes cell ``keep[l, h, j]``'s row (cells
        ``0..n-1``, as :meth:`read` gave them). Only where moving forward in place is safe for every layer and
        head — no empty slot, each head's cells rising with its slots, none before its slot (a prompt's events:
        the cells hold rising positions) — else False, with nothing changed. Rows that stay in their cell are not
        touched; a transposed V moves as columns, never turned into rows."""
        self._check_open()
        b = keep.shape[2]
        if (b and (keep.min() < 0 or keep.max() >= n or np.any(np.diff(keep, axis=2) <= 0)
                   or np.any(keep < np.arange(b)))):
            return False
        check_positions(np.asarray(pos), len(self.k[0]))
        for l, kl in enumerate(keep):
            moved = compact_rows(self.k[l], kl) and (compact_columns(self.v[l], kl) if self.v_trans
                                                     else compact_rows(self.v[l], kl))
            if not moved:  # checked above: cannot happen unless the arrays changed under us
                raise CacheLost(f"layer {l}'s rows could not be moved in place after the layers before it were")
        self._settle(pos, bias)
        return True

    def _settle(self, pos: np.ndarray, bias: np.ndarray | None) -> None:
        """The cells' positions and biases, and the cells past ``len(pos)`` freed: ``llama_kv_compact``, no row moved."""
        shape = (len(self.k), self.n_head_kv, len(pos))
        if self._no_moves.shape != shape:  # every src -1: llama_kv_compact moves no row
            self._no_moves = np.full(shape, -1, np.int32)
        try:
            self.ctx.compact(self._no_moves, pos, bias)
        except ValueError as e:
            raise CacheLost(f"{e}: the rows were written in place, the cells' positions were not") from e

    def write(self, k: list[np.ndarray], v: list[np.ndarray], pos: np.ndarray, bias: np.ndarray | None) -> None:
        """Make the sequence exactly ``B = len(pos)`` cells, ``0..B-1``: per layer the rows ``k[l]``, ``v[l]``
        ``[B, Hkv, row]`` at positions ``pos`` with the attention ``bias`` ``[n_layer, Hkv, B]`` (None: 0). The
        rows of cells the sequence held (``0..n-1``, :meth:`read`) and free cells after them are overwritten,
        then ``llama_kv_compact`` sets positions and biases and frees the cells past ``B``.
        ValueError before anything is written for positions that are not unique and non-negative or more
        cells than the cache has; :class:`CacheLost` if llama.cpp refuses the cells once the rows were written."""
        self._check_open()
        pos = np.asarray(pos)
        b = len(pos)
        check_positions(pos, len(self.k[0]))
        for dst, rows in zip(self.k, k):
            dst[:b] = rows
        for dst, rows in zip(self.v, v):
            if not self.v_trans:
                dst[:b] = rows
            elif dst.dtype.itemsize == 2:
                transpose16(rows.reshape(b, -1), out=dst[:, :b])
            else:
                np.copyto(dst[:, :b], rows.reshape(b, -1).T)
        self._settle(pos, bias)
