"""The native KV backend: the patched llama.cpp scores the cells and moves the kept rows on the device
that holds the cache (``llama_kv_score``, ``llama_kv_compact``: patches 0010-0011). The device computes
each query head's window attention over the cells and the value norms of the rows not scored before; the
host scorers choose from those; only queries, positions, biases, scores and indices cross. With a recall
tier, the rows an event evicts are copied to the host and the rows a question brings back are written
into free cells (``llama_kv_rows_get/set``, ``llama_kv_cells_add``: patch 0013): only those rows cross."""

from __future__ import annotations

import math

import numpy as np

from kvlocal.compress import LayerInputs, Plan
from kvlocal.runtime.backend import CacheRead, KVBackend, RowRecord
from kvlocal.runtime.seqstate import row_bytes, rows_from_bytes, rows_to_bytes


class NativeBackend(KVBackend):
    name = "native"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        c = self.ctx
        self._row_k = row_bytes(c.type_k, self.head_dim)
        self._hd_v = c.model.arch.head_dim_v
        self._row_v = row_bytes(c.type_v, self._hd_v)
        self._added_from: int | None = None  # the first position of the cells extend() added

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
        self._added_from = None
        self.record = record

    # -- the recall tier's rows: only they cross ---------------------------------------------------
    def take_rows(self, read: CacheRead, l: int, cells: np.ndarray, heads: np.ndarray):
        k, v = self.ctx.get_rows(l, cells, heads, self._row_k, self._row_v)
        self._count_host(k.nbytes + v.nbytes, k.nbytes + v.nbytes)
        return rows_from_bytes(k, self.ctx.type_k), rows_from_bytes(v, self.ctx.type_v)

    def room(self) -> int:
        return self.ctx.n_ctx - len(self.ctx.cells()[0])

    def extend(self, read: CacheRead, k: list[np.ndarray], v: list[np.ndarray]):
        """The rows are written into free cells, which take positions after every cell's (unique, as the
        record needs; the plan's compaction gives the kept ones their real positions)."""
        m, hkv = len(k[0]), self.n_head_kv
        p0 = int(read.pos.max(initial=-1)) + 1
        self.ctx.add_cells(np.arange(p0, p0 + m))
        self._added_from = p0
        idx, pos = self.ctx.cells()
        new = pos >= p0
        perm = np.empty(len(pos), np.int64)
        perm[~new] = np.arange(read.n)
        perm[new] = read.n + pos[new] - p0
        cells = np.repeat(np.flatnonzero(new)[np.argsort(pos[new])], hkv)  # [m * Hkv]: cell j's rows, head by head
        heads = np.tile(np.arange(hkv), m)
        moved = 0
        for l in range(len(self.layers)):
            rk = rows_to_bytes(k[l].reshape(m * hkv, *k[l].shape[2:]), self.ctx.type_k, self.head_dim)
            rv = rows_to_bytes(v[l].reshape(m * hkv, *v[l].shape[2:]), self.ctx.type_v, self._hd_v)
            self.ctx.set_rows(l, cells, heads, rk, rv)
            moved += rk.nbytes + rv.nbytes
        self._count_host(moved, moved)
        return CacheRead(pos.astype(np.int64), read.true, read.vnorm, read.count), perm

    def retract(self) -> None:
        if self._added_from is not None:
            self.ctx.remove(self._added_from, -1)
            self._added_from = None
