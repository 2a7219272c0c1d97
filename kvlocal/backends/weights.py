"""Weights kvlocal reads from a model's GGUF file itself (not through llama.cpp's loaded tensors): the
state backend's CriticalKV scores values through W_O on the host. The engine reads GGUF tensors only
through here; the native backend reads W_O on the device instead (``llama_kv_score``)."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import numpy as np

from kvlocal.compress.criticalkv import l2_factor
from kvlocal.errors import UsageError
from kvlocal.models.gguf_file import dequantize_tensor, read_gguf

WO_CACHE_BYTES = 256 << 20  # the most float32 W_O kvlocal keeps per model file (KVLOCAL_WO_CACHE_MIB)


class OutputProjections:
    """W_O of a model's layers as float32 ``[D, Hq*d]`` (HF layout), dequantized on demand and kept in a
    cache of at most ``max_bytes``: all layers of a small model (SmolLM2: 38 MiB), the first that fit of a large
    one (an 8B model's 32 layers would take 2 GiB, more than the KV cache they save) — the others are dequantized
    again at each event that needs them. Once full the cache keeps what it holds: an event reads the layers in
    order, so a least-recently-used cache smaller than the model would drop each layer before it is read again
    and never hit (4 of an 8B model's 32 layers hit this way). L1 value norms read it; their factors for L2 value
    norms (:meth:`l2_factor`, d/D of W_O: 2 MiB a layer of an 8B model) are kept for every layer, and the W_O read
    to make them is not. Thread-safe;
    shared by the engines of one process (:func:`output_projections`)."""

    def __init__(self, path: str, max_bytes: int = WO_CACHE_BYTES):
        self.path, self.max_bytes = path, int(max_bytes)
        self._tensors = {t.name: t for t in read_gguf(path).tensors}
        self._cache: dict[int, np.ndarray] = {}
        self._factors: dict[tuple[int, int], np.ndarray] = {}  # (layer, Hq) -> l2_factor of its W_O
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The W_O held and the factors."""
        return self._wo_bytes() + sum(a.nbytes for a in self._factors.values())

    def _wo_bytes(self) -> int:
        """The W_O held (what ``max_bytes`` bounds)."""
        return sum(a.nbytes for a in self._cache.values())

    def fits(self, layers) -> bool:
        """Whether the float32 W_O of all these layers fit in the cache together (then each is dequantized once)."""
        names = [f"blk.{il}.attn_output.weight" for il in layers]
        return all(n in self._tensors for n in names) and \
            sum(4 * int(np.prod(self._tensors[n].shape)) for n in names) <= self.max_bytes

    def __getitem__(self, il: int) -> np.ndarray:
        return self._get(il, keep=True)

    def _get(self, il: int, keep: bool) -> np.ndarray:
        """Layer ``il``'s W_O from the cache, or dequantized — and kept if ``keep`` and it fits (the first layer
        always, however large)."""
        with self._lock:
            if il in self._cache:
                return self._cache[il]
        name = f"blk.{il}.attn_output.weight"
        if name not in self._tensors:
            raise UsageError(f"{Path(self.path).name} has no {name}: CriticalKV needs each layer's output projection")
        wo = dequantize_tensor(self._tensors[name], self.path)
        with self._lock:
            if keep and (not self._cache or self._wo_bytes() + wo.nbytes <= self.max_bytes):
                self._cache.setdefault(il, wo)
        return wo

    def l2_factor(self, il: int, n_head: int) -> np.ndarray:
        """Layer ``il``'s :func:`~kvlocal.compress.criticalkv.l2_factor` (``n_head`` query heads), computed once:
        what CriticalKV's L2 value norms read in place of W_O (``LayerInputs.wo_l2``). An 8B model's W_O does not
        stay in the cache, and its factor was computed again with it at every event. W_O read for a
        factor is not kept: L2 norms never read it again (SmolLM2's 30 layers held 38 MiB of it, an 8B model's 256)."""
        key = (il, n_head)
        with self._lock:
            factor = self._factors.get(key)
        if factor is None:
            factor = l2_factor(self._get(il, keep=False), n_head)
            with self._lock:
                factor = self._factors.setdefault(key, factor)
        return factor


@functools.lru_cache(maxsize=4)
def output_projections(path: str) -> OutputProjections:
    import os

    mib = os.environ.get("KVLOCAL_WO_CACHE_MIB")
    return OutputProjections(path, int(float(mib) * 2**20) if mib else WO_CACHE_BYTES)
