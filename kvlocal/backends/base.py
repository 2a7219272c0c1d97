"""The KV backends: where a compression event reads llama.cpp's cache and writes its plan back.

One small interface (:class:`KVBackend`), two implementations:

- :class:`~kvlocal.backends.state.StateBackend` — the cells are read to the host through llama.cpp's
  sequence state, scored there (numpy + C) and loaded back. Works on any llama.cpp build; the oracle the
  native backend is tested against.
- :class:`~kvlocal.backends.native.NativeBackend` — the patched llama.cpp scores the cells and moves
  the kept rows on the device that holds them (``llama_kv_score``, ``llama_kv_compact``); only queries,
  scores, positions and indices cross to the host, and the rows a scorer reads itself (a merge's members).

An event is ``read()`` → ``layer_inputs(read, ...)`` (what the scorers read, one
:class:`~kvlocal.compress.LayerInputs` per compressed layer) → the scorer's plan → ``apply(read, plan)``.
Both keep the same per-row record (:class:`RowRecord`): a cell has one position in llama.cpp, but after
per-head selection its rows may come from different tokens, so kvlocal remembers each row's true source
position, its token count (a merged row stands for several) and its projected value norm (CriticalKV's,
valid as long as the row is unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlocal.compress import Plan
from kvlocal.errors import UsageError
from kvlocal.runtime import (FLOAT_TYPES, clear_seq, get_blob, has_attention_bias, has_native_compression,
                             has_native_recall, read_seq, row_bytes, runtime_info, set_blob)

BACKEND_NAMES = ("auto", "native", "state")


@dataclass
class RowRecord:
    """kvlocal's record of the rows the latest plan wrote: ``pos`` ``[B]`` the unique cell positions of its
    slots, and per compressed layer, KV head and slot ``[n_layer, Hkv, B]`` the ``true`` source position
    (``-1``: empty), the projected value norm ``vnorm`` (NaN: not known) and the ``count`` of source
    tokens (0: empty). Cells added since hold one plain token each (their position is their own)."""

    pos: np.ndarray
    true: np.ndarray
    vnorm: np.ndarray
    count: np.ndarray

    @classmethod
    def empty(cls, n_layer: int, n_head_kv: int) -> "RowRecord":
        shape = (n_layer, n_head_kv, 0)
        return cls(np.zeros(0, np.int64), np.zeros(shape, np.int64), np.zeros(shape, np.float32), np.zeros(shape, np.int64))

    def copy(self) -> "RowRecord":
        return RowRecord(self.pos.copy(), self.true.copy(), self.vnorm.copy(), self.count.copy())

    @property
    def nbytes(self) -> int:
        return self.pos.nbytes + self.true.nbytes + self.vnorm.nbytes + self.count.nbytes

    def carry(self, cell_pos: np.ndarray, values: np.ndarray, fresh: np.ndarray) -> np.ndarray:
        """Per-row values ``[n_layer, Hkv, n]`` of the cells at ``cell_pos``: the value of the slot a cell
        was written to by the last plan (matched by its unique cell position), else ``fresh``."""
        out = np.array(fresh, copy=True)
        if len(self.pos):
            j = np.minimum(np.searchsorted(self.pos, cell_pos), len(self.pos) - 1)
            hit = self.pos[j] == cell_pos
            out[:, :, hit] = values[:, :, j[hit]]
        return out

    def rows(self, cell_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(true positions, value norms, counts)`` ``[n_layer, Hkv, n]`` of the cells at ``cell_pos``."""
        shape = self.true.shape[:2] + (len(cell_pos),)
        true = self.carry(cell_pos, self.true, np.broadcast_to(cell_pos.astype(np.int64), shape))
        vnorm = self.carry(cell_pos, self.vnorm, np.full(shape, np.nan, np.float32))
        count = self.carry(cell_pos, self.count, np.ones(shape, np.int64))
        return true, vnorm, count

    @classmethod
    def after(cls, plan: Plan, read: "CacheRead", count: np.ndarray | None = None) -> "RowRecord":
        """The record once ``plan`` is applied to the cells of ``read``: the slots' ``count`` (default: the
        kept rows' own, for a plan without merges) and the kept rows' value norms (forgotten for merged
        rows, whose values changed)."""
        keep = np.maximum(plan.keep, 0)
        if count is None:
            count = np.where(plan.keep >= 0, np.take_along_axis(read.count, keep, axis=2), 0)
        vnorm = np.take_along_axis(read.vnorm, keep, axis=2)
        vnorm[(plan.keep < 0) | plan.merged()] = np.nan
        return cls(plan.slot_positions().astype(np.int64), plan.positions, vnorm, count)


class Scratch:
    """Host buffers kept from one event to the next, by name. Memory a process has just been given is paid
    for page by page on first touch: a swap's union of cells and candidates, tens of MiB allocated afresh
    every answer step, spent a visible share of the swap there (docs/recall.md § Measured). A buffer
    :meth:`take` returns is valid until the next ``take`` of the same name."""

    def __init__(self):
        self._bufs: dict = {}

    def take(self, name, shape: tuple, dtype) -> np.ndarray:
        """An uninitialized array of ``shape`` and ``dtype``, in the buffer ``name`` (grown as needed)."""
        dtype = np.dtype(dtype)
        need = int(np.prod(shape)) * dtype.itemsize
        buf = self._bufs.get(name)
        if buf is None or buf.nbytes < need:
            buf = self._bufs[name] = np.empty(max(need, 5 * (0 if buf is None else buf.nbytes) // 4), np.uint8)
        return buf[:need].view(dtype).reshape(shape)


@dataclass
class CacheRead:
    """What one event read of the cache: the cells' positions ``[n]`` in cell order and, per compressed
    layer, KV head and cell ``[n_layer, Hkv, n]``, each row's true position, value norm and count. The
    state backend adds the rows themselves (``kv``, a :class:`~kvlocal.runtime.state.SeqKV`). A read
    :meth:`KVBackend.extend`-ed with rows of the recall tier says which rows came from it (``tier_ids``)."""

    pos: np.ndarray
    true: np.ndarray
    vnorm: np.ndarray
    count: np.ndarray
    kv: object = None
    groups: np.ndarray | None = None  # [n_layer, Hkv, n] rows kept or dropped together (LayerInputs.groups)
    tier_ids: np.ndarray | None = None  # [n_layer, Hkv, n] the recall tier's number of a row brought in (base + id), -1 for a device row

    @property
    def n(self) -> int:
        return len(self.pos)

    @property
    def bias(self) -> np.ndarray | None:
        """``[n_layer, Hkv, n]`` attention bias of the rows: :func:`count_bias` of their counts."""
        return count_bias(self.count)


class KVBackend:
    """The interface of a KV backend; see the module docstring.

    ``ctx``: the llama.cpp context; ``layers``: the model layers whose cache is compressed; ``wo``: the
    W_O source for value norms (None when the method needs none); ``basis``: how a quantized cache stores
    its rows (:class:`~kvlocal.runtime.kvquant.CacheBasis`). ``host_kv_bytes`` counts the K/V bytes
    events copied between llama.cpp's cache and kvlocal's memory, ``host_bytes_peak`` the largest host copy one
    event made.
    """

    name = ""

    def __init__(self, ctx, layers, n_head_kv: int, head_dim: int, basis=None, wo=None, norm_p: int = 1):
        self.ctx, self.layers, self.n_head_kv, self.head_dim = ctx, list(layers), n_head_kv, head_dim
        self.basis, self.wo, self.norm_p = basis, wo, norm_p  # norm_p: the scorer's value norm (1: L1, 2: L2)
        self.record = RowRecord.empty(len(self.layers), n_head_kv)
        self.scratch = Scratch()
        self.host_kv_bytes = 0
        self.host_bytes_peak = 0

    def prepare(self) -> None:
        """The backend's one-time work for the model, done when the engine is made instead of at its first event
        (as llama.cpp repacks weights when a model loads); none by default."""

    # -- one event ----------------------------------------------------------------------------------
    def read(self) -> CacheRead:
        """The cells as they are now, with each row's record."""
        raise NotImplementedError

    def layer_inputs(self, read: CacheRead, q: list[np.ndarray], q_pos: np.ndarray, *, n_sink: int, recent: int,
                     window_size: int | None):
        """One :class:`~kvlocal.compress.LayerInputs` per compressed layer for the scorers. ``q``: per layer
        the observation queries ``[Hq, w, d]`` after RoPE, already scaled for ``q·k/sqrt(d)``; ``q_pos`` their
        positions; ``window_size``: the queries an attention scorer reads (None: none)."""
        raise NotImplementedError

    def apply(self, read: CacheRead, plan: Plan) -> None:
        """Write ``plan`` (made on ``read``) into the cache and update the record. All or nothing."""
        raise NotImplementedError

    # -- the recall tier's rows ---------------------------------------------------------------------
    def take_rows(self, read: CacheRead, l: int, cells: np.ndarray, heads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V of KV head ``heads[i]`` in cell ``cells[i]`` (an index into ``read``) of compressed layer ``l``,
        as the cache stores them (:func:`~kvlocal.runtime.seqstate.row_format`): the rows an event evicts,
        taken before it is applied."""
        raise NotImplementedError

    def extend(self, read: CacheRead, m: int) -> tuple[CacheRead, list[np.ndarray], list[np.ndarray]]:
        """``read`` with ``m`` more cells after its own, for candidate rows from the recall tier. Returns the
        extended read (its ``pos``, and its rows where the backend holds them; the per-row arrays are the
        caller's) and per compressed layer the new cells' K and V ``[m, Hkv, ...]``
        (:func:`~kvlocal.runtime.seqstate.row_format`), uninitialized: the caller writes every row a scorer or
        the plan reads (zeroing a swap's ~40 MB of new rows cost more than copying the keys in). Nothing changes
        in llama.cpp until a plan is applied."""
        raise NotImplementedError

    # -- the cells ----------------------------------------------------------------------------------
    def use(self, ctx) -> None:
        """Read and write ``ctx``'s cells from now on (a turn read whole in a reading context, then the cells moved
        back: :mod:`kvlocal.engine.reading`). The record follows the cells: it is matched by cell position."""
        self.ctx = ctx

    def positions(self) -> np.ndarray:
        """The positions of sequence 0's cells, in cell order (the patched runtime's listing, or the
        state's header)."""
        if has_attention_bias():
            return self.ctx.cells()[1]
        return read_seq(self.ctx).pos

    def save(self) -> np.ndarray:
        """The cells as llama.cpp's sequence state (a host copy)."""
        return get_blob(self.ctx)

    def load(self, blob: np.ndarray) -> None:
        """Replace the cells by a :meth:`save`; RuntimeError (the previous cells loaded back) if llama.cpp
        refuses it."""
        previous = get_blob(self.ctx)
        clear_seq(self.ctx)
        try:
            set_blob(self.ctx, blob)
        except RuntimeError:
            clear_seq(self.ctx)
            set_blob(self.ctx, previous)
            raise

    def _read_record(self, cell_pos: np.ndarray, kv=None) -> CacheRead:
        cell_pos = np.asarray(cell_pos, dtype=np.int64)
        return CacheRead(cell_pos, *self.record.rows(cell_pos), kv=kv)

    def _count_host(self, moved: int, peak: int) -> None:
        self.host_kv_bytes += moved
        self.host_bytes_peak = max(self.host_bytes_peak, peak)


def count_bias(counts: np.ndarray) -> np.ndarray | None:
    """The attention bias of rows standing for ``counts`` tokens: ``log(count)``, ``-inf`` for an empty
    row (0); None while every row is one plain token."""
    if np.all(counts == 1):
        return None
    with np.errstate(divide="ignore"):
        return np.log(counts.astype(np.float32))


def resolve_backend(backend: str, type_k: int | None = None, type_v: int | None = None,
                    offloaded: bool = True, recall: bool = False, head_dims: tuple[int, int] | None = None,
                    remote: bool = False) -> str:
    """The KV backend an engine runs compression on: ``native`` or ``state``. UsageError, naming the fix, for
    ``native`` where it cannot run.

    ``auto`` picks native where it can run and the model is ``offloaded`` to a GPU (its cache then stays on
    the device instead of crossing PCIe twice per event), and state on the CPU, where the cache is in host
    memory either way and the host scorers measured faster (docs/engine.md, "Native backend"). ``remote``: some
    layers' cache is on an rpc-server, where native sends indices and scores, state the rows themselves, twice
    (docs/distributed.md): native too.
    ``head_dims`` (K, V; None before the model is loaded): a quantized cache's rows move on the device as the
    4-byte words their bytes are, which a row of one block (a head of 32 dimensions) is not."""
    if backend not in BACKEND_NAMES:
        raise UsageError(f"--backend {backend!r}: choose native, state or auto")
    if backend == "state":
        return "state"
    why = None
    if recall and not has_native_recall():
        why = "this llama.cpp copies no rows between the device and the recall tier (patch 0011): run `python ggml_patches/build.py`"
    elif head_dims and any(t not in (None, *FLOAT_TYPES) and row_bytes(t, d) % 4 for t, d in zip((type_k, type_v), head_dims)):
        why = f"a quantized row of {min(head_dims)} dimensions is one block, which the device cannot move as bytes"
    elif not has_native_compression():
        why = "this llama.cpp has no on-device compression (patches 0009-0010): run `python ggml_patches/build.py`"
    if why is None:
        return "native" if backend == "native" or remote or (offloaded and runtime_info().gpu_offload) else "state"
    if backend == "native":
        raise UsageError(f"--backend native: {why}; use --backend state")
    return "state"
