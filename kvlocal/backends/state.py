"""The state KV backend: the scorers work on sequence 0's K/V rows on the host and the plan's rows are
written back. Where the cache lies in host memory (the CPU's) and the runtime says where (patch 0012), the
rows are read and written in place (:class:`~kvlocal.runtime.hostview.HostView`); elsewhere they cross as
llama.cpp's sequence state (:mod:`kvlocal.runtime.state`), which any llama.cpp build has. Every method,
merging and quantized caches included."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from kvlocal.compress import LayerInputs, Plan
from kvlocal.compress.plan import cell_rows
from kvlocal.backends.base import CacheRead, KVBackend, RowRecord, count_bias
from kvlocal.runtime import STATE_IO_ENV, HostView, blob_rows, read_seq, write_seq


class StateBackend(KVBackend):
    name = "state"

    def __init__(self, ctx, layers, n_head_kv: int, head_dim: int, basis=None, wo=None, norm_p: int = 1,
                 in_place: bool | None = None):
        """``in_place``: False reads and writes through the state blob even where the cache lies in host memory
        (None: unless ``KVLOCAL_STATE_IO=blob``); where it does not, the blob either way."""
        super().__init__(ctx, layers, n_head_kv, head_dim, basis=basis, wo=wo, norm_p=norm_p)
        arch = ctx.model.arch
        if in_place is None:
            in_place = os.environ.get(STATE_IO_ENV) != "blob"
        self.view = HostView.open(ctx, len(self.layers), n_head_kv, (arch.head_dim_k, arch.head_dim_v)) if in_place else None

    def use(self, ctx) -> None:
        super().use(ctx)
        if self.view is not None:  # (a context like the first: its cache is in host memory too)
            arch = ctx.model.arch
            self.view = HostView.open(ctx, len(self.layers), self.n_head_kv, (arch.head_dim_k, arch.head_dim_v))

    @property
    def in_place(self) -> bool:
        """Whether events read and write the cache where it lies (else through the state blob)."""
        return self.view is not None

    def prepare(self) -> None:
        """W_O's factor for L2 value norms of every compressed layer (what :meth:`layer_inputs` hands the scorers), or
        for L1 W_O itself where all layers fit the W_O cache: once per model in a process (the engines of a server or
        an eval share them)."""
        if self.wo is None:
            return
        if self.norm_p == 2:
            for il in self.layers:
                self.wo.l2_factor(il, self.ctx.model.n_head)
        elif self.wo.fits(self.layers):
            for il in self.layers:
                self.wo[il]  # dequantized into the cache

    def read(self) -> CacheRead:
        if self.view is not None:
            cells, pos = self.ctx.cells()
            if not len(cells) or cells[-1] == len(cells) - 1:  # cells 0..n-1 (listed in rising order)
                return self._read_record(pos, kv=self.view.read(pos, self.scratch))
        kv = read_seq(self.ctx)
        return self._read_record(kv.pos, kv=kv)

    def layer_inputs(self, read: CacheRead, q, q_pos, *, n_sink: int, recent: int, window_size=None):
        kv, basis, bias = read.kv, self.basis, read.bias
        for i, il in enumerate(self.layers):  # i: index in the compressed cache, il: the model's layer
            k, v = kv.k[i].transpose(1, 0, 2), kv.v[i].transpose(1, 0, 2)
            yield LayerInputs(
                # [Hkv, n, d], in the stored basis: an F16 cache's as they are (views of its cells: the scorers
                # convert the rows they read), a quantized cache's decoded to float32
                k=k if k.dtype == np.float16 and basis.k_codec is None else basis.keys(k),
                # as the model computed them; an F16 cache's as they are
                v=v if v.dtype == np.float16 and basis.v_codec is None else basis.values(v),
                pos=read.true[i],  # [Hkv, n], -1 for the empty rows of a head
                q=basis.queries(q[i]),  # in the keys' basis
                q_pos=q_pos,
                # L2 value norms read W_O's factor, kept for every layer: W_O itself, dequantized again at every
                # event where it does not stay in the cache (a large model's), is then not read
                wo=self.wo[il] if self.wo is not None and self.norm_p != 2 else None,
                wo_l2=self.wo.l2_factor(il, q[i].shape[0]) if self.wo is not None and self.norm_p == 2 else None,
                layer=il,
                n_sink=n_sink,
                recent=recent,  # the probe is not cached: protect the most recent rows instead
                bias=None if bias is None else bias[i],  # log(count) of merged rows, -inf for empty ones
                vnorm=read.vnorm[i],  # CriticalKV fills in the ones it computes
                groups=None if read.groups is None else read.groups[i],
            )

    def take_rows(self, read: CacheRead, l: int, cells: np.ndarray, heads: np.ndarray):
        return cell_rows(read.kv.k[l], cells, heads), cell_rows(read.kv.v[l], cells, heads)

    def extend(self, read: CacheRead, m: int):
        """The new cells join the host copy without a position of their own (-1). The union's rows are
        :attr:`scratch` buffers: valid until the next ``extend``."""
        kv, n = read.kv, read.n

        def grown(name, rows):  # [n + m, Hkv, ...]: the cells, then m rows the caller writes
            out = self.scratch.take(name, (n + m, *rows.shape[1:]), rows.dtype)
            out[:n] = rows
            return out

        k = [grown(("k", i), a) for i, a in enumerate(kv.k)]
        v = [grown(("v", i), a) for i, a in enumerate(kv.v)]
        pos = np.concatenate([read.pos, np.full(m, -1, np.int64)])
        union = dataclasses.replace(kv, k=k, v=v, pos=pos.astype(np.int32))
        return dataclasses.replace(read, pos=pos, kv=union), [a[n:] for a in k], [a[n:] for a in v]

    def apply(self, read: CacheRead, plan: Plan) -> None:
        """Write the plan's rows into the cells: kept rows as they are, merged ones combined
        (:meth:`Plan.materialize`), each with its bias (``log(count)``, ``-inf`` for an empty slot)."""
        kv = read.kv
        if kv.in_place:
            return self._apply_in_place(read, plan)
        buffer = lambda nbytes: self.scratch.take("blob", (nbytes,), np.uint8)  # kept between events (see below)
        # the plan's rows are gathered straight into the blob's K and V sections where the cache stores them as
        # they are (F16, F32, quantized bytes): write_seq then copies no row; the others (a transposed V, BF16, a
        # sliding-window cache's blob) into scratch rows kept between events, which write_seq copies
        width = plan.keep.shape[2]
        out = tuple(rows if rows is not None else self._out_rows(name, arrays, width)
                    for rows, name, arrays in zip(blob_rows(kv, width, buffer), ("k_out", "v_out"), (kv.k, kv.v)))
        k, v, counts, bias = plan.materialize(kv.k, kv.v, read.count, self.basis.k_codec, self.basis.v_codec,
                                              dtype=None, out=out)
        record = RowRecord.after(plan, read, counts)
        # no bias section at all while every slot holds one plain token
        cell_bias = [b.T for b in bias] if np.any(counts != 1) else None
        blob = kv.blob.nbytes if kv.blob is not None else 0
        written = sum(a.nbytes for a in k) + sum(a.nbytes for a in v)
        layer_f32 = self._scoring_bytes(read)
        # the blob is built in a buffer kept between events (a fresh one of 10-30 MB is paid for in page faults)
        write_seq(self.ctx, dataclasses.replace(kv, pos=record.pos.astype(np.int32), k=k, v=v, blob=None, bias=cell_bias),
                  previous=kv.blob, alloc=buffer)
        self.record = record
        self._count_host(blob + written, max(blob + layer_f32, blob + written))

    def _apply_in_place(self, read: CacheRead, plan: Plan) -> None:
        """:meth:`apply` for a read of the cache where it lies: a plan of the cells' own rows moves them forward in
        place where that is safe (:meth:`HostView.compact`: a prompt's events); other plans (merged rows, empty
        slots, a recall union's rows) are gathered into scratch rows kept between events and written into the
        first cells (:meth:`HostView.write`)."""
        kv, width = read.kv, plan.keep.shape[2]
        if self.view.holds(kv) and not plan.merged().any():  # rows that are cells as they are: moved where they lie
            record = RowRecord.after(plan, read)
            if self.view.compact(plan.keep, read.n, record.pos, count_bias(record.count)):
                self.record = record
                row = kv.k[0][0].nbytes + kv.v[0][0].nbytes  # one cell's K and V, every KV head
                moved = int(np.count_nonzero(plan.keep != np.arange(width))) * row // self.n_head_kv
                v_rows = sum(a.nbytes for a in kv.v) if self.view.v_trans else 0  # a transposed V, as rows
                self._count_host(moved, v_rows + self._scoring_bytes(read))
                return
        out = (self._out_rows("k_out", kv.k, width), self._out_rows("v_out", kv.v, width))
        k, v, counts, bias = plan.materialize(kv.k, kv.v, read.count, self.basis.k_codec, self.basis.v_codec,
                                              dtype=None, out=out)
        record = RowRecord.after(plan, read, counts)
        self.view.write(k, v, record.pos, np.stack(bias) if np.any(counts != 1) else None)
        self.record = record
        written = sum(a.nbytes for a in k) + sum(a.nbytes for a in v)
        self._count_host(written, written + self._scoring_bytes(read))

    def _out_rows(self, name: str, arrays: list[np.ndarray], width: int) -> list[np.ndarray]:
        """Per layer ``width`` rows shaped as ``arrays``' (K or V of the cells), scratch kept between events: where a
        plan's rows are gathered before they are written."""
        return [self.scratch.take((name, i), (width, *a.shape[1:]), a.dtype) for i, a in enumerate(arrays)]

    def _scoring_bytes(self, read: CacheRead) -> int:
        """One layer's K and V as float32, which a scorer may hold while it reads them."""
        return 2 * read.n * self.n_head_kv * self.head_dim * 4
