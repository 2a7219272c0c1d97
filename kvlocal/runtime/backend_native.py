"""The native KV backend: the patched llama.cpp scores the cells and moves the kept rows on the device
that holds the cache (``llama_kv_score``, ``llama_kv_compact``: patches 0010-0011). The device computes
each query head's window attention over the cells and the value norms of the rows not scored before; the
host scorers choose from those; only queries, positions, biases, scores and indices cross.

With a recall tier (patch 0013) only the rows that move cross: an event copies the rows it evicts to the
host (``llama_kv_rows_get``), and a question scores the tier's candidate rows on the host *inside the
device's softmax* — their logsumexp goes to ``llama_kv_score`` as one more logit per query, which returns
that logit's share, so device cells and host rows get the attention of one softmax over both — and
writes only the candidates the plan keeps into their slots (``llama_kv_rows_set``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvlocal.compress import LayerInputs, Plan, kernels
from kvlocal.runtime.backend import CacheRead, KVBackend, RowRecord
from kvlocal.runtime.seqstate import row_bytes, rows_from_bytes, rows_to_bytes


@dataclass
class HostRows:
    """Rows of the recall tier in a native event's read without being on the device: they are the read's
    cells ``n_device, n_device + 1, ...``; per compressed layer ``k``/``v`` ``[m, Hkv, ...]``
    (:func:`~kvlocal.runtime.seqstate.row_format`)."""

    n_device: int
    k: list[np.ndarray]
    v: list[np.ndarray]


class NativeBackend(KVBackend):
    name = "native"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        c = self.ctx
        self._hd_v = c.model.arch.head_dim_v
        self._row_k, self._row_v = row_bytes(c.type_k, self.head_dim), row_bytes(c.type_v, self._hd_v)

    def read(self) -> CacheRead:
        return self._read_record(self.ctx.cells()[1])

    def layer_inputs(self, read: CacheRead, q, q_pos, *, n_sink: int, recent: int, window_size=None):
        w = window_size or 1
        qs = np.stack([qi[:, -w:] for qi in q])  # [n_layer, Hq, w, d]
        scale = 1 / math.sqrt(self.head_dim)
        bias, vnorm = read.bias, read.vnorm
        host = read.kv if isinstance(read.kv, HostRows) else None
        n = host.n_device if host else read.n
        need = np.flatnonzero(np.isnan(vnorm[:, :, :n]).any(axis=(0, 1))) if self.wo is not None else None
        device_bias = None if bias is None else bias[:, :, :n]
        if host is None:
            votes, norms = self.ctx.score(qs, scale, device_bias, need)
        else:
            logits = self._host_logits(self.basis.queries(qs), host, None if bias is None else bias[:, :, n:], scale)  # [L, Hq, w, m]
            with np.errstate(invalid="ignore", divide="ignore"):
                peak = logits.max(axis=3, initial=-np.inf)
                lse = np.where(np.isfinite(peak), peak + np.log(np.exp(logits - peak[..., None]).sum(axis=3)), -np.inf)
                votes, norms, share = self.ctx.score(qs, scale, device_bias, need, outside=lse)
                host_votes = np.nan_to_num(np.exp(logits - lse[..., None]) * share[..., None]).mean(axis=2)
            votes = np.concatenate([votes, host_votes.astype(np.float32)], axis=2)
            if self.wo is not None:
                self._host_vnorm(vnorm, host, read.true)
        if norms is not None:
            vnorm[:, :, need] = np.where(np.isnan(vnorm[:, :, need]), norms, vnorm[:, :, need])
        for i, il in enumerate(self.layers):
            yield LayerInputs(k=None, v=None, pos=read.true[i], q=qs[i], q_pos=q_pos[-w:], layer=il, n_sink=n_sink,
                              recent=recent, bias=None if bias is None else bias[i], vnorm=vnorm[i], votes=votes[i])

    def _host_logits(self, qs: np.ndarray, host: HostRows, bias: np.ndarray | None, scale: float) -> np.ndarray:
        """``scale * q·k + bias`` of the window queries ``qs`` (in the keys' basis) over the host rows: ``[n_layer, Hq, w, m]``."""
        n_layer, hq = qs.shape[:2]
        group = hq // self.n_head_kv
        out = []
        for l in range(n_layer):
            keys = self.basis.keys(host.k[l].transpose(1, 0, 2))  # [Hkv, m, d] float32
            kq = np.einsum("gwd,gmd->gwm", qs[l], np.repeat(keys, group, axis=0)) * scale
            if bias is not None:
                kq = kq + np.repeat(bias[l], group, axis=0)[:, None, :]
            out.append(kq)
        return np.stack(out)

    def _host_vnorm(self, vnorm: np.ndarray, host: HostRows, true: np.ndarray) -> None:
        """Fill in the projected value norms the host rows do not carry yet (CriticalKV's, on the host)."""
        n = host.n_device
        for i, il in enumerate(self.layers):
            wo = self.wo[il]  # [n_embd, Hq * d_v]
            group = wo.shape[1] // self._hd_v // self.n_head_kv
            for h in range(self.n_head_kv):
                rows = np.flatnonzero(np.isnan(vnorm[i, h, n:]) & (true[i, h, n:] >= 0))
                if len(rows):
                    v = self.basis.values(host.v[i][rows, h]).astype(np.float32)
                    vnorm[i, h, n + rows] = kernels.vnorm_l1(v, wo, h * group, group)

    def apply(self, read: CacheRead, plan: Plan) -> None:
        record = RowRecord.after(plan, read)
        with np.errstate(divide="ignore"):
            cell_bias = np.log(record.count.astype(np.float32)) if np.any(record.count != 1) else None
        host = read.kv if isinstance(read.kv, HostRows) else None
        if host is None:
            self.ctx.compact(plan.keep, record.pos, cell_bias)
        else:  # the device rows move on the device, then the kept host rows are written into their slots
            n = host.n_device
            self.ctx.compact(np.where(plan.keep < n, plan.keep, -1), record.pos, cell_bias)
            for l in range(plan.n_layer):
                heads, slots = np.nonzero(plan.keep[l] >= n)
                if len(heads):
                    rows = plan.keep[l][heads, slots] - n
                    k = rows_to_bytes(host.k[l][rows, heads], self.ctx.type_k, self.head_dim)
                    v = rows_to_bytes(host.v[l][rows, heads], self.ctx.type_v, self._hd_v)
                    self.ctx.set_rows(l, slots, heads, k, v)
                    self._count_host(k.nbytes + v.nbytes, k.nbytes + v.nbytes)
        self.record = record

    # -- the recall tier's rows: only the ones that move cross -----------------------------------------
    def take_rows(self, read: CacheRead, l: int, cells: np.ndarray, heads: np.ndarray):
        k, v = self.ctx.get_rows(l, cells, heads, self._row_k, self._row_v)
        self._count_host(k.nbytes + v.nbytes, k.nbytes + v.nbytes)
        return rows_from_bytes(k, self.ctx.type_k), rows_from_bytes(v, self.ctx.type_v)

    def extend(self, read: CacheRead, k: list[np.ndarray], v: list[np.ndarray]):
        """The rows stay on the host until the plan keeps them (:meth:`apply`)."""
        m = len(k[0])
        pos = np.concatenate([read.pos, np.full(m, -1, np.int64)])
        return CacheRead(pos, read.true, read.vnorm, read.count, kv=HostRows(read.n, k, v))
