"""The native KV backend: the patched llama.cpp scores the cells and moves the kept rows on the device
that holds the cache (``llama_kv_score``, ``llama_kv_compact``: patches 0010-0011). The device computes
each query head's window attention over the cells and the value norms of the rows not scored before; the
host scorers choose from those; only queries, positions, biases, scores and indices cross."""

from __future__ import annotations

import math

import numpy as np

from kvlocal.compress import LayerInputs, Plan
from kvlocal.runtime.backend import CacheRead, KVBackend, RowRecord


class NativeBackend(KVBackend):
    name = "native"

    def read(self) -> CacheRead:
        return self._read_record(self.ctx.cells()[1])

    def layer_inputs(self, read: CacheRead, q, q_pos, *, n_sink: int, recent: int, window_size=None):
        w = window_size or 1
        qs = np.stack([qi[:, -w:] for qi in q])  # [n_layer, Hq, w, d]
        bias = read.bias
        vnorm = read.vnorm
        need = np.flatnonzero(np.isnan(vnorm).any(axis=(0, 1))) if self.wo is not None else None
        votes, norms = self.ctx.score(qs, 1 / math.sqrt(self.head_dim), bias, need)
        if norms is not None:
            vnorm[:, :, need] = np.where(np.isnan(vnorm[:, :, need]), norms, vnorm[:, :, need])
        for i, il in enumerate(self.layers):
            yield LayerInputs(k=None, v=None, pos=read.true[i], q=qs[i], q_pos=q_pos[-w:], layer=il, n_sink=n_sink,
                              recent=recent, bias=None if bias is None else bias[i], vnorm=vnorm[i], votes=votes[i])

    def apply(self, read: CacheRead, plan: Plan) -> None:
        record = RowRecord.after(plan, read)
        with np.errstate(divide="ignore"):
            cell_bias = np.log(record.count.astype(np.float32)) if np.any(record.count != 1) else None
        self.ctx.compact(plan.keep, record.pos, cell_bias)
        self.record = record
