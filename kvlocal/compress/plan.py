"""The plan of one compression event: which source cells fill which slot, per layer and KV head.

A plan is plain data (numbers only, no llama.cpp): the scorers produce it (one :class:`LayerPlan` per
layer, gathered by :func:`kvlocal.compress.plan_layers`), :meth:`Plan.materialize` turns it into the
rows to write, ``--dump-plan`` saves it as JSON.

Slots. Every layer has the same ``B`` slots (llama.cpp's cells are shared by all layers); each KV head
fills them with its entries in increasing position order. A head (of any layer) that keeps fewer than
``B`` entries leaves its *first* slots EMPTY (``keep = positions = -1``, count 0, bias ``-inf``): entries
are right-aligned, so that :meth:`Plan.slot_positions` stays strictly increasing.

Merges. A slot may hold a merge of several source cells (KVSlimmer): its key is a weighted sum of the
members' keys, its value their count-weighted mean, its count the sum of theirs, and it sits at its
latest member (``keep`` is that member, ``positions`` its position). Per layer and KV head, the merged
slots are one dict::

    {"slots": [j, ...],                     # the merged slots, increasing
     "cells": [[c1, c2, ...], ...],         # their members (source cells), in position order
     "positions": [[p1, p2, ...], ...],     # the members' source positions
     "weights": [[w1, w2, ...], ...]}       # the members' key weights (sum 1; not clipped to [0, 1])

In JSON the member lists are ragged, as above. In memory (:func:`merge_arrays`) they are numpy arrays
``[M, G]`` (``G`` = the largest group of the head), padded on the left with cell and position ``-1``
and weight 0, so that the last column is always the latest member.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

FORMAT = "kvlocal-plan"
VERSION = 2
EMPTY = -1  # keep / position of an empty slot

MERGE_KEYS = ("slots", "cells", "positions", "weights")


@dataclass
class LayerPlan:
    """One layer's share of a plan, as a scorer returns it (:meth:`kvlocal.compress.Scorer.plan_layer`).

    Parameters
    ----------
    keep : np.ndarray
        ``[Hkv, B]`` int64 source cells per slot, each head's in increasing position order; a head with
        fewer entries than ``B`` has ``-1`` (empty) in its first slots.
    counts : np.ndarray, optional
        ``[Hkv, B]`` int64 source tokens per slot (0 for empty slots); ``None``: 1 per entry.
    merges : list, optional
        Per KV head, the merged slots of this layer (the module docstring's dict); ``None``: no merges.
    """

    keep: np.ndarray
    counts: np.ndarray | None = None
    merges: list | None = None

    def remap(self, cells: np.ndarray) -> "LayerPlan":
        """This plan with its cells read through ``cells`` ``[Hkv, n']``: for a plan made on a subset of
        the rows, where row ``r`` of head ``h`` is source cell ``cells[h, r]`` (``-1`` stays ``-1``)."""
        cells = np.asarray(cells, dtype=np.int64)

        def through(h: int, idx: np.ndarray) -> np.ndarray:
            return np.where(idx >= 0, cells[h][np.maximum(idx, 0)], EMPTY)

        keep = np.stack([through(h, row) for h, row in enumerate(self.keep)]) if len(self.keep) else self.keep
        merges = None
        if self.merges is not None:
            merges = [dict(m, cells=through(h, m["cells"])) for h, m in enumerate(map(merge_arrays, self.merges))]
        return LayerPlan(keep=keep, counts=self.counts, merges=merges)


def merge_arrays(head: dict) -> dict:
    """One head's merge dict as arrays: ``slots`` [M] int64, ``cells``/``positions`` [M, G] int64 and
    ``weights`` [M, G] float64, padded on the left (``-1``, ``-1``, 0). Accepts ragged lists (JSON)."""
    slots = np.asarray(head["slots"], dtype=np.int64).reshape(-1)
    if isinstance(head["cells"], np.ndarray) and head["cells"].ndim == 2:
        return {"slots": slots, "cells": head["cells"].astype(np.int64, copy=False),
                "positions": np.asarray(head["positions"], dtype=np.int64),
                "weights": np.asarray(head["weights"], dtype=np.float64)}
    width = max((len(c) for c in head["cells"]), default=0)
    out = {"slots": slots}
    for key, fill, dtype in (("cells", EMPTY, np.int64), ("positions", EMPTY, np.int64), ("weights", 0.0, np.float64)):
        a = np.full((len(slots), width), fill, dtype=dtype)
        for i, row in enumerate(head[key]):  # JSON input only: the scorers build arrays directly
            if len(row):
                a[i, width - len(row):] = row
        out[key] = a
    return out


@dataclass
class Plan:
    """Per layer, the source cells that fill the ``B`` slots of every KV head (see the module docstring).

    Slot ``j`` of KV head ``h`` in layer ``l`` receives the K/V rows of source cell ``keep[l, h, j]``,
    whose (source) position is ``positions[l, h, j]``; or, if ``j`` is listed in ``merges[l][h]``, the
    merge of that slot's members. Different heads and layers may hold different tokens in the same
    slot: attention is computed per head, so a slot is just a row.

    Parameters
    ----------
    keep : np.ndarray
        ``[n_layer, Hkv, B]`` int64 source cell indices (cell order of the cache being compressed), ``-1``
        for an empty slot; a list of per-layer ``[Hkv, B]`` arrays is stacked.
    positions : np.ndarray
        ``[n_layer, Hkv, B]`` int64 source positions of the entries (``-1`` where empty); per head, empty
        slots first, then strictly increasing positions.
    counts : np.ndarray, optional
        ``[n_layer, Hkv, B]`` int64: how many source tokens each slot stands for (its attention bias is
        ``log(count)``), 0 for empty slots. ``None``: 1 for every entry.
    merges : list, optional
        Per layer, ``None`` or per KV head the merge dict of the module docstring (stored as
        :func:`merge_arrays`). ``None``: no merges.
    """

    keep: np.ndarray
    positions: np.ndarray
    counts: np.ndarray | None = None
    merges: list | None = None

    def __post_init__(self) -> None:
        self.keep = _stack(self.keep, "keep")
        self.positions = _stack(self.positions, "positions")
        if self.keep.shape != self.positions.shape:
            raise ValueError(f"keep {self.keep.shape} and positions {self.positions.shape} differ")
        empty = self.keep == EMPTY
        if (self.keep < EMPTY).any() or (self.positions < EMPTY).any() or not np.array_equal(empty, self.positions < 0):
            raise ValueError("an empty slot has keep = positions = -1, and only an empty slot has either negative")
        if self.n_slots > 1:
            ordered = (np.diff(self.positions, axis=2) > 0) | empty[..., 1:]  # (an empty slot's predecessor is empty)
            bad = ~np.all(ordered & (empty[..., 1:] <= empty[..., :-1]), axis=(1, 2))
            if bad.any():
                raise ValueError(f"layer {int(np.flatnonzero(bad)[0])}: each head's empty slots must come first, "
                                 "then strictly increasing positions")
        if self.counts is not None:
            self.counts = _stack(self.counts, "counts")
            if self.counts.shape != self.keep.shape:
                raise ValueError(f"counts {self.counts.shape} and keep {self.keep.shape} differ")
            if not np.array_equal(self.counts == 0, empty) or (self.counts < 0).any():
                raise ValueError("counts must be 0 exactly at the empty slots and >= 1 elsewhere")
        if self.merges is not None:
            self.merges = [self._check_merges(il, m) for il, m in enumerate(self.merges)]
            if len(self.merges) != self.n_layer:
                raise ValueError(f"merges given for {len(self.merges)} layers, keep for {self.n_layer}")

    def _check_merges(self, il: int, per_head: list | None) -> list | None:
        if per_head is None:
            return None
        if len(per_head) != self.n_kv:
            raise ValueError(f"layer {il}: merges given for {len(per_head)} KV heads, not {self.n_kv}")
        out = [merge_arrays(m) for m in per_head]
        for h, m in enumerate(out):
            slots, cells, pos, w = (m[key] for key in MERGE_KEYS)
            if not len(slots):
                continue
            if slots.min() < 0 or slots.max() >= self.n_slots or not (cells.shape == pos.shape == w.shape):
                raise ValueError(f"layer {il} head {h}: merge slots out of range or member arrays of different shapes")
            if (not np.array_equal(self.keep[il, h, slots], cells[:, -1])
                    or not np.array_equal(self.positions[il, h, slots], pos[:, -1])):
                raise ValueError(f"layer {il} head {h}: a merged slot must hold its latest member (keep, position)")
            if not np.allclose(w.sum(axis=1), 1.0, atol=1e-6):
                raise ValueError(f"layer {il} head {h}: the key weights of a merged slot must sum to 1")
        return out

    @classmethod
    def from_layers(cls, layers: list[LayerPlan], pos) -> "Plan":
        """Plan from one :class:`LayerPlan` per layer and the source positions of the cells: one ``[n]``
        array for all layers, or one entry per layer (``[n]`` or ``[Hkv, n]``). ``B`` is the most entries
        any head of any layer keeps; heads with fewer get empty slots in front."""
        if isinstance(pos, np.ndarray):
            shared = pos.ndim == 1
        else:  # a list of positions, or of per-layer entries (np.ndim of the list would copy them all into one array)
            shared = len(pos) == 0 or np.ndim(pos[0]) == 0
        if not shared and len(pos) != len(layers):
            raise ValueError(f"positions given for {len(pos)} layers, plans for {len(layers)}")
        width = max((lp.keep.shape[1] for lp in layers), default=0)
        pads = [width - lp.keep.shape[1] for lp in layers]
        keep = [np.pad(k, ((0, 0), (pad, 0)), constant_values=EMPTY) if pad else k
                for k, pad in zip((np.asarray(lp.keep, dtype=np.int64) for lp in layers), pads)]
        per_layer = [np.asarray(pos if shared else pos[il], dtype=np.int64) for il in range(len(layers))]
        per_layer = [np.broadcast_to(p, (k.shape[0], p.shape[-1])) for p, k in zip(per_layer, keep)]
        if keep and len({p.shape for p in per_layer}) == 1 and len({k.shape for k in keep}) == 1:
            # every layer's cells alike (an event's): one gather for all layers, not one per layer
            keep = np.stack(keep)
            at = (per_layer[0][0][np.maximum(keep, 0)] if shared else
                  np.take_along_axis(np.stack(per_layer), np.maximum(keep, 0), axis=2))
            positions = np.where(keep >= 0, at, EMPTY)
        else:
            positions = [np.where(k >= 0, np.take_along_axis(p, np.maximum(k, 0), axis=1), EMPTY)
                         for k, p in zip(keep, per_layer)]
        any_counts = any(lp.counts is not None for lp in layers)
        counts = [(k >= 0).astype(np.int64) if lp.counts is None else
                  np.pad(lp.counts, ((0, 0), (pad, 0))) if pad else lp.counts
                  for k, lp, pad in zip(keep, layers, pads)] if any_counts else None
        merges = [None if lp.merges is None else [dict(m, slots=m["slots"] + pad) for m in map(merge_arrays, lp.merges)]
                  for lp, pad in zip(layers, pads)]
        any_merges = any(m is not None for m in merges)
        return cls(keep=keep, positions=positions, counts=counts,
                   merges=merges if any_merges else None)

    @classmethod
    def from_keep(cls, keep, pos) -> "Plan":
        """Plan from the kept cells of every layer (``[Hkv, B]`` each, ``-1`` = empty) and the source
        positions (as :meth:`from_layers`)."""
        return cls.from_layers([LayerPlan(keep=np.asarray(k)) for k in keep], pos)

    @property
    def n_layer(self) -> int:
        return self.keep.shape[0]

    @property
    def n_kv(self) -> int:
        return self.keep.shape[1]

    @property
    def n_slots(self) -> int:
        return self.keep.shape[2]

    def slot_positions(self) -> np.ndarray:
        """``[B]`` int64: the position llama.cpp gets for each slot (cell) after the plan is applied.

        A llama.cpp cell has one position, shared by every layer and head, and it serves two purposes
        only: the causal mask (a query at ``p`` sees cells with ``pos <= p``) and "the next token goes
        at max stored position + 1" (keys are already rotated, so it plays no part in RoPE). Slot ``j``
        therefore gets the largest source position among the entries it holds, over all layers and
        heads (empty slots, ``-1``, never attain it): every later query sees every kept entry exactly
        when it would have seen the source token, and the next token lands after all of them. The
        maximum increases strictly along the slots: the head attaining it at slot ``j`` has, its
        entries being right-aligned, an entry at every later slot ``j'``, with a larger position.
        """
        if self.n_layer == 0 or self.n_kv == 0:
            return np.zeros(self.n_slots, dtype=np.int64)
        return self.positions.max(axis=(0, 1))

    def merged(self) -> np.ndarray:
        """``[n_layer, Hkv, B]`` True for the slots filled by a merge."""
        out = np.zeros(self.keep.shape, dtype=bool)
        for il in range(self.n_layer if self.merges is not None else 0):
            for h, m in enumerate(self.head_merges(il)):
                out[il, h, m["slots"]] = True
        return out

    def head_merges(self, il: int) -> list[dict]:
        """Layer ``il``'s merge dicts, one per KV head (empty ones for a layer without merges)."""
        heads = self.merges[il] if self.merges is not None and self.merges[il] is not None else None
        empty = {"slots": np.zeros(0, np.int64)}
        return heads if heads is not None else [empty] * self.n_kv

    def materialize(self, k, v, counts_in=None, k_codec=None, v_codec=None, dtype=np.float32, out=None):
        """The rows the cells get: ``(k_out, v_out, counts_out, bias_out)``.

        k, v: per layer ``[n, Hkv, d]`` source rows (cell-major, as the state backend reads them; float16
        or float32); counts_in: ``[n_layer, Hkv, n]`` int64 source counts (``None``: all 1). Returns
        per-layer lists ``k_out[l]``, ``v_out[l]`` ``[B, Hkv, d]`` of ``dtype`` (float32; None: the
        source's, which spares the state backend converting every row twice), ``counts_out``
        ``[n_layer, Hkv, B]`` int64 (0 for empty slots) and ``bias_out`` float32 ``log(count)`` (``-inf``
        for empty slots). A plain slot copies its cell's rows; a merged slot gets the key ``Σ w_i k_i``
        (float32) and the value ``Σ c_i v_i / Σ c_i`` (count-weighted mean: the cache stores means with a
        ``log(count)`` bias, equivalent to AsymKV's summed values, see kvlocal/reference/cache.py) and
        count ``Σ c_i``; an empty slot gets zeros. ``counts_out`` equals :attr:`counts` when ``counts_in``
        are the counts the scorers saw (``LayerInputs.counts``). ``out``: ``(k, v)``, per layer arrays (of the sources'
        dtypes, ``dtype=None``) to fill instead of new ones — or None for new ones — e.g. where the cache's blob
        takes them.

        Rows of a quantized cache: k and v hold each head's raw bytes (uint8 ``[n, Hkv, bytes]``) and
        ``k_codec``/``v_codec`` (:class:`~kvlocal.runtime.kvquant.RowCodec`) decode them. Plain slots then
        copy the bytes (no added error; the outputs stay uint8), merged ones are combined from the decoded
        rows and quantized again; zero bytes are a zero row in every such format.
        """
        if out is not None and dtype is not None:
            raise ValueError("materialize(out=...) fills arrays of the sources' dtypes: pass dtype=None")
        n_layer, hkv, width = self.keep.shape
        heads = np.arange(hkv)[:, None]
        k_out, v_out = [], []
        counts_out = np.zeros((n_layer, hkv, width), dtype=np.int64)
        for il in range(n_layer):
            kl, vl = np.asarray(k[il]), np.asarray(v[il])  # [n, Hkv, d]
            cin = np.ones((hkv, kl.shape[0]), np.int64) if counts_in is None else np.asarray(counts_in[il])
            keep = self.keep[il]
            filled = keep >= 0
            idx = np.maximum(keep, 0)
            ko, vo = (cell_rows(a, idx.T, heads.T, None if dst is None else dst[il])  # [width, Hkv, ...]
                      for a, dst in zip((kl, vl), out or (None, None)))
            if dtype is not None:
                ko = ko if k_codec else ko.astype(dtype, copy=False)
                vo = vo if v_codec else vo.astype(dtype, copy=False)
            ko[~filled.T] = 0
            vo[~filled.T] = 0
            c = np.where(filled, cin[heads, idx], 0)
            for h, m in enumerate(self.head_merges(il)):
                if not len(m["slots"]):
                    continue
                cells = np.maximum(m["cells"], 0)  # [M, G]
                km, vm, total = merge_rows(m, kl[cells, h], vl[cells, h], cin[h, cells], k_codec, v_codec)
                ko[m["slots"], h] = km
                vo[m["slots"], h] = vm
                c[h, m["slots"]] = total
            counts_out[il] = c
            k_out.append(ko)
            v_out.append(vo)
        with np.errstate(divide="ignore"):
            bias_out = np.log(counts_out.astype(np.float32))  # log 0 = -inf
        return k_out, v_out, counts_out, bias_out

    # -- the --dump-plan format ----------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready dict: per layer and KV head, the source cells, positions, counts and merges."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "n_layer": self.n_layer,
            "n_kv_head": self.n_kv,
            "n_slots": self.n_slots,
            "slot_positions": self.slot_positions().tolist(),
            "layers": [
                {
                    "keep": k.tolist(),
                    "positions": p.tolist(),
                    "counts": None if self.counts is None else self.counts[il].tolist(),
                    "merges": None if self.merges is None or self.merges[il] is None
                    else [_merges_json(m) for m in self.merges[il]],
                }
                for il, (k, p) in enumerate(zip(self.keep, self.positions))
            ],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} document "
                             f"(format={d.get('format')!r}, version={d.get('version')!r})")
        layers = d["layers"]
        shape = (len(layers), int(d["n_kv_head"]), int(d["n_slots"]))

        def arr(key):
            return np.asarray([layer[key] for layer in layers], dtype=np.int64).reshape(shape)

        counts = arr("counts") if layers and layers[0]["counts"] is not None else None
        merges = [layer["merges"] for layer in layers]
        return cls(keep=arr("keep"), positions=arr("positions"), counts=counts,
                   merges=merges if any(m is not None for m in merges) else None)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def _stack(x, what: str) -> np.ndarray:
    if isinstance(x, (list, tuple)):
        x = np.stack(x) if len(x) else np.zeros((0, 0, 0))
    a = np.asarray(x, dtype=np.int64)
    if a.ndim != 3:
        raise ValueError(f"{what} must be [n_layer, Hkv, B] (or a list of [Hkv, B]), got shape {a.shape}")
    return a


def _merges_json(head: dict) -> dict:
    """One head's merge arrays as JSON lists, the member lists ragged (padding dropped)."""
    present = head["cells"] >= 0
    out = {"slots": head["slots"].tolist()}
    for key in MERGE_KEYS[1:]:
        out[key] = [row[mask].tolist() for row, mask in zip(head[key], present)]
    return out


def cell_rows(a: np.ndarray, cells, heads, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``a[cells, heads]`` of cell-major rows ``a`` ``[n, Hkv, ...]`` (``cells``, ``heads``: index arrays that
    broadcast together; the result has their shape, then a row's), as one ``np.take`` of ``[n * Hkv, ...]`` rows — a
    fraction of what numpy's indexing by two arrays costs at an event's sizes. ``out``: the array to write them
    into (checked here, as ``np.take`` would check them only by gathering into a temporary first, which is slower)."""
    rows = np.asarray(cells) * a.shape[1] + np.asarray(heads)
    flat = a.reshape(-1, *a.shape[2:])
    if out is None:
        return np.take(flat, rows, axis=0)
    if rows.size and (rows.min() < 0 or rows.max() >= len(flat)):
        raise IndexError(f"cell_rows: a row outside the {a.shape[0]} cells x {a.shape[1]} heads")
    return np.take(flat, rows, axis=0, out=out, mode="wrap")


def merge_rows(m: dict, k: np.ndarray, v: np.ndarray, counts: np.ndarray, k_codec=None, v_codec=None):
    """One head's merged slots from its members' rows: ``m`` the head's merge arrays (:func:`merge_arrays`),
    ``k``/``v`` ``[M, G, d or bytes]`` the rows of ``m["cells"]`` (any row where a cell is ``-1``), ``counts``
    ``[M, G]`` theirs. Returns ``(k [M, ...], v [M, ...], count [M])``: the key ``Σ w_i k_i``, the value
    ``Σ (c_i / Σ c) v_i`` (:func:`merge_values`), float32 — or quantized again by the codecs of a quantized cache.
    The arithmetic is the native backend's (``llama_kv_merge``, :func:`merge_sum`), so that both backends write
    the same rows."""
    wk, _ = merge_weights(m, counts)
    km = merge_sum(wk, _decoded(k, k_codec))
    vm, total = merge_values(m, v, counts, v_codec)
    return (k_codec.encode(km) if k_codec else km), vm, total


def merge_values(m: dict, v: np.ndarray, counts: np.ndarray, v_codec=None):
    """The values of :func:`merge_rows` alone: ``(v [M, ...], count [M])``."""
    _, wv = merge_weights(m, counts)
    vm = merge_sum(wv, _decoded(v, v_codec))
    return (v_codec.encode(vm) if v_codec else vm), np.where(m["cells"] >= 0, counts, 0).sum(axis=1)


def merge_weights(m: dict, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The weights of one head's merges, ``[M, G]`` float64: the keys' (``m["weights"]``, 0 for padding) and the
    values' ``c_i / Σ c`` (the count-weighted mean)."""
    present = m["cells"] >= 0
    cm = np.where(present, counts, 0)
    return np.where(present, m["weights"], 0.0), cm / cm.sum(axis=1, keepdims=True)


def merge_sum(w: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``Σ_g w[m, g] rows[m, g]`` ``[M, d]`` as ggml sums a merge (``llama_kv_merge``): float32 weights and
    products, added member after member in float32."""
    products = w.astype(np.float32)[..., None] * rows.astype(np.float32, copy=False)
    total = products[:, 0].copy() if products.shape[1] else np.zeros((len(products), rows.shape[-1]), np.float32)
    for g in range(1, products.shape[1]):
        total += products[:, g]
    return total


def _decoded(rows: np.ndarray, codec) -> np.ndarray:
    """Cache rows as float32 values: decoded by the codec of a quantized cache, else converted."""
    return codec.decode(rows) if codec else rows.astype(np.float32)
