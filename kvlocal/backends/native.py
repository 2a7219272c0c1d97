"""The native KV backend: the patched llama.cpp scores the cells and moves the kept rows on the device
that holds the cache (``llama_kv_score``, ``llama_kv_compact``: patches 0009-0010). The device computes
each query head's window attention over the cells and the value norms of the rows not scored before; the
host scorers choose from those; only queries, positions, biases, scores and indices cross.

With a recall tier (patches 0010-0011) only the rows that move cross: an event copies the rows it evicts to the
host (``llama_kv_rows_get``), and a question scores the tier's candidate rows on the host *inside the
device's softmax* — their logsumexp goes to ``llama_kv_score`` as one more logit per query, which returns
that logit's share, so device cells and host rows get the attention of one softmax over both — and
writes only the candidates the plan keeps into their slots (``llama_kv_rows_set``).

A scorer that reads K/V itself asks for the rows it reads (:class:`~kvlocal.compress.base.RowSource`), and
those cross: a merge after CriticalKV the rows CriticalKV kept; KVSlimmer alone and DefensiveKV (a maximum
over the window, where the device gives the mean) every row. The scorers choose merges on the host; the merged
rows are summed on the device (``llama_kv_merge``, patch 0013), so none is written back from the host."""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field

import numpy as np

from kvlocal import kernels
from kvlocal.compress import LayerInputs, Plan
from kvlocal.compress.base import RowSource
from kvlocal.compress.plan import merge_values, merge_weights
from kvlocal.backends.base import CacheRead, KVBackend, RowRecord
from kvlocal.runtime import row_bytes, row_format, rows_from_bytes, rows_to_bytes


@dataclass
class NativeRows:
    """What a native event's read holds on the host: the recall tier's candidate rows, which are the read's
    cells ``n_device, n_device + 1, ...`` without being on the device (per compressed layer ``k``/``v``
    ``[m, Hkv, ...]``, :func:`~kvlocal.runtime.seqstate.row_format`; None: no candidates), and the device
    rows copied to the host so far (``fetched``: per layer, by ``cell * Hkv + head``, whether a row was copied
    and its K and V), so that no row crosses twice in one event."""

    n_device: int
    k: list[np.ndarray] | None = None
    v: list[np.ndarray] | None = None
    fetched: dict = field(default_factory=dict)


class _DeviceRowSource(RowSource):
    """:class:`~kvlocal.compress.base.RowSource` of one compressed layer of a native read. The queries are
    turned into the keys' basis only if a scorer reads rows (most events fetch none)."""

    def __init__(self, backend: "NativeBackend", read: CacheRead, l: int, q: np.ndarray, q_pos: np.ndarray):
        self.backend, self.read, self.l, self._q, self.q_pos = backend, read, l, q, q_pos

    @functools.cached_property
    def q(self) -> np.ndarray:
        return self.backend.basis.queries(self._q)

    def fetch(self, cells: np.ndarray):
        hkv, m = cells.shape
        heads = np.repeat(np.arange(hkv), m)
        k, v = self.backend.rows_of(self.read, self.l, np.maximum(cells, 0).reshape(-1), heads)
        basis = self.backend.basis
        return basis.keys(k).reshape(hkv, m, -1), basis.values(v).reshape(hkv, m, -1)


class NativeBackend(KVBackend):
    name = "native"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        c = self.ctx
        self._hd_v = c.model.arch.head_dim_v
        self._row_k, self._row_v = row_bytes(c.type_k, self.head_dim), row_bytes(c.type_v, self._hd_v)
        self._format_k, self._format_v = row_format(c.type_k, self.head_dim), row_format(c.type_v, self._hd_v)
        self._copying = threading.Lock()  # layers are planned on threads; rows leave the device one layer at a time

    def read(self) -> CacheRead:
        cells = self.ctx.cells()[1]
        return self._read_record(cells, kv=NativeRows(len(cells)))

    def layer_inputs(self, read: CacheRead, q, q_pos, *, n_sink: int, recent: int, window_size=None):
        w = window_size or 1
        qs = np.stack([qi[:, -w:] for qi in q])  # [n_layer, Hq, w, d]
        scale = 1 / math.sqrt(self.head_dim)
        bias, vnorm = read.bias, read.vnorm
        host = read.kv if read.kv.k is not None else None
        n = read.kv.n_device
        unknown = np.isnan(vnorm[:, :, :n]) & (read.true[:, :, :n] >= 0)  # (an empty row needs none)
        need = np.flatnonzero(unknown.any(axis=(0, 1))) if self.wo is not None else None
        device_bias = None if bias is None else bias[:, :, :n]
        if host is None:
            votes, norms = self.ctx.score(qs, scale, device_bias, need, norm_p=self.norm_p)
        else:
            logits = self._host_logits(self.basis.queries(qs), host, None if bias is None else bias[:, :, n:], scale)  # [L, Hq, w, m]
            with np.errstate(invalid="ignore", divide="ignore"):
                peak = logits.max(axis=3, initial=-np.inf)
                seen = np.isfinite(peak)  # (a query that sees no host row has no mass there)
                e = np.exp(logits - np.where(seen, peak, 0)[..., None])  # once: for the logsumexp and the weights
                total = e.sum(axis=3)
                lse = np.where(seen, peak + np.log(total), -np.inf)
                votes, norms, share = self.ctx.score(qs, scale, device_bias, need, outside=lse, norm_p=self.norm_p)
                host_votes = (e * np.nan_to_num(np.where(seen, share / total, 0))[..., None]).mean(axis=2)
            votes = np.concatenate([votes, host_votes.astype(np.float32)], axis=2)
            if self.wo is not None:
                self._host_vnorm(vnorm, host, read.true)
        if norms is not None:
            vnorm[:, :, need] = np.where(np.isnan(vnorm[:, :, need]), norms, vnorm[:, :, need])
        for i, il in enumerate(self.layers):
            rows = _DeviceRowSource(self, read, i, q[i], q_pos)
            yield LayerInputs(k=None, v=None, pos=read.true[i], q=qs[i], q_pos=q_pos[-w:], layer=il, n_sink=n_sink,
                              recent=recent, bias=None if bias is None else bias[i], vnorm=vnorm[i], votes=votes[i],
                              rows=rows)

    def _host_logits(self, qs: np.ndarray, host: NativeRows, bias: np.ndarray | None, scale: float) -> np.ndarray:
        """``scale * q·k + bias`` of the window queries ``qs`` (in the keys' basis) over the host rows: ``[n_layer, Hq, w, m]``."""
        n_layer, hq, w, d = qs.shape
        hkv = self.n_head_kv
        group = hq // hkv
        out = []
        for l in range(n_layer):
            keys = self.basis.keys(host.k[l].transpose(1, 0, 2))  # [Hkv, m, d] float32
            # a KV head's whole group of queries in one product: [Hkv, G*w, d] @ [Hkv, d, m]
            kq = (qs[l].reshape(hkv, group * w, d) @ keys.transpose(0, 2, 1)).reshape(hq, w, -1) * scale
            if bias is not None:
                kq = kq + np.repeat(bias[l], group, axis=0)[:, None, :]
            out.append(kq)
        return np.stack(out)

    def _host_vnorm(self, vnorm: np.ndarray, host: NativeRows, true: np.ndarray) -> None:
        """Fill in the projected value norms the host rows do not carry yet (CriticalKV's, on the host)."""
        n = host.n_device
        for i in range(len(self.layers)):
            for h in range(self.n_head_kv):
                rows = np.flatnonzero(np.isnan(vnorm[i, h, n:]) & (true[i, h, n:] >= 0))
                if len(rows):
                    vnorm[i, h, n + rows] = self._vnorm(i, h, host.v[i][rows, h])

    def _vnorm(self, i: int, h: int, v: np.ndarray) -> np.ndarray:
        """CriticalKV's projected value norms of rows ``v`` (as the cache stores them) of KV head ``h`` in
        compressed layer ``i``, on the host: L2 through W_O's d × d factor, as the state backend's (W_O is not read)."""
        group = self.ctx.model.n_head // self.n_head_kv
        il = self.layers[i]
        wo = self.wo.l2_factor(il, self.ctx.model.n_head) if self.norm_p == 2 else self.wo[il]  # [n_embd or d, Hq * d_v]
        return kernels.vnorm(self.basis.values(v).astype(np.float32), wo, h * group, group, p=self.norm_p)

    def apply(self, read: CacheRead, plan: Plan) -> None:
        """Merge rows on the device (``llama_kv_merge``): each merged slot's sum is written into its latest member's
        cell, which the plan keeps; then move the kept device rows on the device (``llama_kv_compact``), and write
        the tier's candidates the plan keeps from the host into their slots (``llama_kv_rows_set``)."""
        record = RowRecord.after(plan, read, plan.counts if plan.merges is not None else None)
        with np.errstate(divide="ignore"):
            cell_bias = np.log(record.count.astype(np.float32)) if np.any(record.count != 1) else None
        n = read.kv.n_device
        if plan.merges is not None:
            self._merge(read, plan)
            for l in range(plan.n_layer if self.wo is not None else 0):
                self._merged_vnorm(read, plan, l, record.vnorm)
        self.ctx.compact(np.where(plan.keep < n, plan.keep, -1), record.pos, cell_bias)
        for l in range(plan.n_layer):
            from_tier = plan.keep[l] >= n  # (merges are all of device rows: a tier is refused with them)
            if from_tier.any():
                h, j = np.nonzero(from_tier)
                tk, tv = self.rows_of(read, l, plan.keep[l][h, j], h)
                k, v = rows_to_bytes(tk, self.ctx.type_k, self.head_dim), rows_to_bytes(tv, self.ctx.type_v, self._hd_v)
                self.ctx.set_rows(l, j, h, k, v)
                self._count_host(k.nbytes + v.nbytes, k.nbytes + v.nbytes)
        self.record = record

    def _merged_vnorm(self, read: CacheRead, plan: Plan, l: int, vnorm: np.ndarray) -> None:
        """The merged rows' value norms in layer ``l``, from their members' rows, which the method read (no row
        crosses): the value as the device stores it (:func:`~kvlocal.compress.plan.merge_values`: the same sum,
        quantized again for a quantized cache). The device would compute them at the next event, for every
        layer of each cell that holds a merged row in some layer: most cells of a merging method."""
        for h, m in enumerate(plan.head_merges(l)):
            if not len(m["slots"]):
                continue
            cells = np.maximum(m["cells"], 0)  # [M, G]
            _, v = self.rows_of(read, l, cells.reshape(-1), np.full(cells.size, h))
            vm, _ = merge_values(m, v.reshape(*cells.shape, -1), read.count[l, h, cells], self.basis.v_codec)
            stored = rows_from_bytes(rows_to_bytes(vm, self.ctx.type_v, self._hd_v), self.ctx.type_v)
            vnorm[l, h, m["slots"]] = self._vnorm(l, h, stored)

    def _merge(self, read: CacheRead, plan: Plan) -> None:
        """Every layer's merges on the device, in one call: per merged slot its members (padded on the left to the
        widest merge) and their key and value weights (:func:`~kvlocal.compress.plan.merge_weights`)."""
        merges = [[(h, m) for h, m in enumerate(plan.head_merges(l)) if len(m["slots"])] for l in range(plan.n_layer)]
        width = max((m["cells"].shape[1] for layer in merges for _, m in layer), default=0)
        if not width:
            return
        cells, head, wk, wv = [np.zeros((0, width), np.int64)], [np.zeros(0, np.int64)], [], []
        for l, layer in enumerate(merges):
            for h, m in layer:
                left = ((0, 0), (width - m["cells"].shape[1], 0))
                k_weights, v_weights = merge_weights(m, read.count[l, h, np.maximum(m["cells"], 0)])
                cells.append(np.pad(m["cells"], left, constant_values=-1))
                head.append(np.full(len(m["cells"]), h))
                wk.append(np.pad(k_weights, left))
                wv.append(np.pad(v_weights, left))
        n_merge = [sum(len(m["slots"]) for _, m in layer) for layer in merges]
        self.ctx.merge(n_merge, np.concatenate(cells), np.concatenate(head), np.concatenate(wk), np.concatenate(wv))

    # -- rows on the host: only the ones asked for cross ------------------------------------------------
    def rows_of(self, read: CacheRead, l: int, cells: np.ndarray, heads: np.ndarray):
        """K and V of KV head ``heads[i]`` in cell ``cells[i]`` of compressed layer ``l`` of ``read``
        (:func:`~kvlocal.runtime.seqstate.row_format`): the tier's candidates from the host, device rows copied
        from the device (``llama_kv_rows_get``) once per event."""
        kv = read.kv
        (dk, sk), (dv, sv) = self._format_k, self._format_v
        k, v = np.empty((len(cells), *sk), dk), np.empty((len(cells), *sv), dv)
        host = cells >= kv.n_device
        if host.any():
            c = cells[host] - kv.n_device
            k[host], v[host] = kv.k[l][c, heads[host]], kv.v[l][c, heads[host]]
        if not host.all():
            k[~host], v[~host] = self._device_rows(kv, l, cells[~host] * self.n_head_kv + heads[~host])
        return k, v

    def _device_rows(self, kv: NativeRows, l: int, ids: np.ndarray):
        """The device rows ``ids`` (``cell * Hkv + head``) of layer ``l``: the ones not copied yet this event are."""
        hkv = self.n_head_kv
        with self._copying:
            if l not in kv.fetched:  # (np.empty: host pages are taken only for the rows copied)
                (dk, sk), (dv, sv) = self._format_k, self._format_v
                size = kv.n_device * hkv
                kv.fetched[l] = np.zeros(size, bool), np.empty((size, *sk), dk), np.empty((size, *sv), dv)
            have, k_all, v_all = kv.fetched[l]
            new = np.unique(ids[~have[ids]])
            if len(new):
                k, v = self.ctx.get_rows(l, new // hkv, new % hkv, self._row_k, self._row_v)
                self._count_host(k.nbytes + v.nbytes, k.nbytes + v.nbytes)
                k_all[new], v_all[new] = rows_from_bytes(k, self.ctx.type_k), rows_from_bytes(v, self.ctx.type_v)
                have[new] = True
        return k_all[ids], v_all[ids]

    def take_rows(self, read: CacheRead, l: int, cells: np.ndarray, heads: np.ndarray):
        return self.rows_of(read, l, cells, heads)

    def extend(self, read: CacheRead, m: int):
        """The rows stay on the host until the plan keeps them (:meth:`apply`), in :attr:`scratch` buffers:
        valid until the next ``extend``."""
        (dk, sk), (dv, sv) = self._format_k, self._format_v
        k = [self.scratch.take(("k", i), (m, self.n_head_kv, *sk), dk) for i in range(len(self.layers))]
        v = [self.scratch.take(("v", i), (m, self.n_head_kv, *sv), dv) for i in range(len(self.layers))]
        pos = np.concatenate([read.pos, np.full(m, -1, np.int64)])
        rows = NativeRows(read.kv.n_device, k, v, read.kv.fetched)
        return CacheRead(pos, read.true, read.vnorm, read.count, kv=rows), k, v
