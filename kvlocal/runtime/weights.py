"""Weights kvlocal reads from a model's GGUF file itself (not through llama.cpp's loaded tensors): the
state backend's CriticalKV scores values through W_O on the host. The engine reads GGUF tensors only
through here; the native backend reads W_O on the device instead (``llama_kv_score``)."""

from __future__ import annotations

import collections
import functools
import threading
from pathlib import Path

import numpy as np

from kvlocal.errors import UsageError
from kvlocal.models.gguf_file import dequantize_tensor, read_gguf

WO_CACHE_BYTES = 256 << 20  # the most float32 W_O kvlocal keeps per model file (KVLOCAL_WO_CACHE_MIB)


class OutputProjections:
    """W_O of a model's layers as float32 ``[D, Hq*d]`` (HF layout), dequantized on demand and kept in a
    least-recently-used cache of at most ``max_bytes``: all layers of a small model (SmolLM2: 38 MiB),
    a few of a large one (an 8B model's 32 layers would take 2 GiB, more than the KV cache they save)
    — the others are dequantized again at each event that needs them. Thread-safe; shared by the
    engines of one process (:func:`output_projections`)."""

    def __init__(self, path: str, max_bytes: int = WO_CACHE_BYTES):
        self.path, self.max_bytes = path, int(max_bytes)
        self._tensors = {t.name: t for t in read_gguf(path).tensors}
        self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._cache.values())

    def __getitem__(self, il: int) -> np.ndarray:
        with self._lock:
            if il in self._cache:
                self._cache.move_to_end(il)
                return self._cache[il]
        name = f"blk.{il}.attn_output.weight"
        if name not in self._tensors:
            raise UsageError(f"{Path(self.path).name} has no {name}: CriticalKV needs each layer's output projection")
        wo = dequantize_tensor(self._tensors[name], self.path)
        with self._lock:
            self._cache[il] = wo
            while len(self._cache) > 1 and self.nbytes > self.max_bytes:
                self._cache.popitem(last=False)
        return wo


@functools.lru_cache(maxsize=4)
def output_projections(path: str) -> OutputProjections:
    import os

    mib = os.environ.get("KVLOCAL_WO_CACHE_MIB")
    return OutputProjections(path, int(float(mib) * 2**20) if mib else WO_CACHE_BYTES)
