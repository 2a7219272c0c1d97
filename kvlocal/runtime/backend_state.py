"""The state KV backend: an event reads sequence 0's cells to the host (llama.cpp's sequence state,
:mod:`kvlocal.runtime.state`), the scorers work on the K/V rows there, and the compacted cells are
loaded back. Any llama.cpp build; every method, merging and quantized caches included."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvlocal.compress import LayerInputs, Plan
from kvlocal.compress.plan import cell_rows
from kvlocal.runtime.backend import CacheRead, KVBackend, RowRecord
from kvlocal.runtime.seqstate import blob_rows
from kvlocal.runtime.state import read_seq, write_seq


class StateBackend(KVBackend):
    name = "state"

    def read(self) -> CacheRead:
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
                wo=self.wo[il] if self.wo is not None else None,
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
        buffer = lambda nbytes: self.scratch.take("blob", (nbytes,), np.uint8)  # kept between events (see below)
        # the plan's rows are gathered straight into the blob's K and V sections where the cache stores them as
        # they are (F16, F32, quantized bytes): write_seq then copies no row; the others (a transposed V, BF16, a
        # sliding-window cache's blob) into scratch rows kept between events, which write_seq copies
        width = plan.keep.shape[2]
        out = tuple(rows if rows is not None else
                    [self.scratch.take((name, i), (width, *a.shape[1:]), a.dtype) for i, a in enumerate(arrays)]
                    for rows, name, arrays in zip(blob_rows(kv, width, buffer), ("k_out", "v_out"), (kv.k, kv.v)))
        k, v, counts, bias = plan.materialize(kv.k, kv.v, read.count, self.basis.k_codec, self.basis.v_codec,
                                              dtype=None, out=out)
        record = RowRecord.after(plan, read, counts)
        # no bias section at all while every slot holds one plain token
        cell_bias = [b.T for b in bias] if np.any(counts != 1) else None
        blob = kv.blob.nbytes if kv.blob is not None else 0
        written = sum(a.nbytes for a in k) + sum(a.nbytes for a in v)
        layer_f32 = 2 * read.n * self.n_head_kv * self.head_dim * 4  # one layer's K and V while scoring
        # the blob is built in a buffer kept between events (a fresh one of 10-30 MB cost ~1 ms a MiB in page faults)
        write_seq(self.ctx, dataclasses.replace(kv, pos=record.pos.astype(np.int32), k=k, v=v, blob=None, bias=cell_bias),
                  previous=kv.blob, alloc=buffer)
        self.record = record
        self._count_host(blob + written, max(blob + layer_f32, blob + written))
