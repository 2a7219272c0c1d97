"""The scorer contract, the inputs of one layer, and per-head selection.

Every eviction method is a :class:`Scorer`: a dataclass whose fields are its hyperparameters (with
defaults) and whose methods turn the :class:`LayerInputs` of one layer into a score per (KV head, cell),
higher = keep. Behaviours compose by wrapping, as in kvpress: ``CriticalKV(SnapKV())``. numpy in, numpy
out; the hot loops run in ``kvlocal._kernels`` (:mod:`kvlocal.kernels`). No torch, no llama.cpp.

The contract, documented once:

``score(layer) -> [Hkv, n] float32``
    Budget-free importance of every cell, higher = keep. ``+inf`` for cells the method protects
    (attention sinks, the observation window: :meth:`LayerInputs.protected`), ``-inf`` for empty rows
    (:attr:`LayerInputs.live`). Budget allocation (AdaKV) reads these scores.
``rerank(layer, scores, budgets) -> [Hkv, n] float32``
    The ranking whose per-head top ``budgets[h]`` is the kept set, given ``scores = score(layer)`` and
    the per-head budgets ``[Hkv]``. The default returns ``scores``; CriticalKV's two-stage selection
    depends on the budget and lives here.
``keep(layer, budget) -> [Hkv, B] int64``
    The cells every KV head keeps, sorted by position (:func:`select`): ``min(budget, live rows)`` per
    head for a uniform budget; a head that keeps fewer than ``B`` has ``-1`` (empty) in its first slots.
``max_slots(budget) -> int``
    The most cells a plan at ``budget`` may need (what an engine allocates): ``budget``, or more for
    head budgets (AdaKV: ``int(max_share * budget)``). ``budget_for_cells(cells)`` is its inverse: the
    per-head budget an engine plans with so that a ``--budget`` of cells is the memory every method uses.
``plan_layer(layer, budget) -> LayerPlan``
    The layer's part of the plan (:class:`~kvlocal.compress.plan.LayerPlan`): kept cells, counts and
    merges. The default wraps :meth:`keep`; merging methods (KVSlimmer) override it.

Empty rows (a head that holds fewer entries than the cache has cells) are never kept, get no
attention and are neither sinks nor in the recent span (:attr:`LayerInputs.live`).

Cells are in llama.cpp's cell order, which is **not** position order (after a removal new tokens fill
the holes first); everything that depends on order (pooling, ties, the result) goes by position.
These are the conventions of the PyTorch reference (``kvlocal.reference.compress``), whose kept sets
``tests/compress/test_compress.py`` checks these scorers against, exactly.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from kvlocal import kernels
from kvlocal.compress import numpy_kernels
from kvlocal.kernels import native_scoring
from kvlocal.compress.plan import EMPTY, LayerPlan, Plan


@dataclass
class LayerInputs:
    """What a scorer reads for one layer at a compression event.

    Parameters
    ----------
    k, v : np.ndarray or None
        ``[Hkv, n, d]`` float32 keys (after RoPE) and values of the ``n`` cells, in cell order (either may be
        float16, an F16 cache's rows: exact, a scorer converts the rows it reads — the kernels read such keys
        and values as the cache's cells, with no float32 copy of the layer). They may be views of llama.cpp's
        own cache (the state backend in place): valid during the event only — copy what outlives it. None
        where they stay on the device (the native backend): then ``votes`` and ``pos`` ``[Hkv, n]``
        are given, for CriticalKV every ``vnorm`` it ranks, and ``rows`` brings the rows a scorer reads
        (:meth:`take`, :meth:`loaded`).
    pos : np.ndarray
        ``[n]`` int positions of the cells (all KV heads of a cell share it in llama.cpp), or
        ``[Hkv, n]`` when the engine tracks a source position per head. Not sorted; distinct per head
        among live rows; ``-1`` for an empty row.
    q : np.ndarray, optional
        ``[Hq, w, d]`` float32 observation queries after RoPE (the last prompt tokens, or a question
        probe); ``Hq`` a multiple of ``Hkv``, query head ``h`` reads KV head ``h // (Hq/Hkv)``.
    q_pos : np.ndarray, optional
        ``[w]`` int positions of the queries. A query at ``p`` sees the cells with ``pos <= p``.
    wo : np.ndarray, optional
        ``[D, Hq*d]`` float32 output projection of the layer, HF layout (``o_proj.weight``: query head
        ``h`` uses columns ``h*d:(h+1)*d``). CriticalKV only.
    layer : int
        Layer index (for messages and for methods that depend on depth).
    n_sink : int
        Attention sinks: cells at positions ``< n_sink`` are protected (StreamingLLM; 4 as in kvpress).
    recent : int, optional
        The protected recent span. ``None`` (default, the reference's rule): every cell at or after the
        first observation query (``pos >= min(q_pos)``) is protected: with the last ``w`` prompt tokens
        as queries, exactly those ``w`` cells; with a question probe whose tokens are not cached,
        none. An int ``W``: the ``W`` most recent positions (of each head) are protected instead,
        whatever the queries (e.g. the tail of a chunk scored by a probe).
    bias : np.ndarray, optional
        ``[Hkv, n]`` float32 additive attention-logit bias: ``log(count)`` for a row that stands for
        ``count`` source tokens (a merge), 0 for a plain token, ``-inf`` for an EMPTY row (a dead slot:
        AdaKV gave that head fewer entries, or the head holds fewer live rows), whose ``pos`` is ``-1``.
        ``None``: 0 everywhere (then rows with ``pos = -1`` are the empty ones). Empty rows are never
        kept, get no attention, and are neither sinks nor recent (:attr:`live`, :attr:`counts`).
    vnorm : np.ndarray, optional
        ``[Hkv, n]`` float32 projected value norms already known (CriticalKV; NaN = not known). They
        depend only on a cell's value row and ``W_O``, so an engine can carry them from one event to
        the next for the cells that stay. CriticalKV computes the missing ones it needs and writes them
        into this array (in place); ``None``: computed every time.
    votes : np.ndarray, optional
        ``[Hq, n]`` float32 window attention already computed where K lives (the native backend's
        ``llama_kv_score``): each query head's softmax attention over the cells, averaged over the
        observation queries ``q`` — what :func:`window_votes` returns. Attention scorers use it in place of
        computing it from ``k``.
    groups : np.ndarray, optional
        ``[Hkv, n]`` int: rows that are kept or dropped together share a group id (``-1``: a row on its
        own). A grouped row ranks with the best score of its group, so a group's rows come back as one
        span (the recall tier's pages of evicted rows, :mod:`kvlocal.recall`).
    rows : RowSource, optional
        Where ``k`` is None: how the rows come to the host on demand (the native backend copies only the
        rows a scorer reads, e.g. the ones a merge combines).
    wo_l2 : np.ndarray, optional
        ``[min(d, D), Hq*d]`` float32: ``wo``'s factor for L2 value norms
        (:func:`kvlocal.compress.criticalkv.l2_factor`), where an engine keeps it: CriticalKV with
        ``value_norm="l2"`` reads it in place of ``wo``, which may then be None (the same norms).
    """

    k: np.ndarray
    v: np.ndarray
    pos: np.ndarray
    q: np.ndarray | None = None
    q_pos: np.ndarray | None = None
    wo: np.ndarray | None = None
    layer: int = 0
    n_sink: int = 4
    recent: int | None = None
    bias: np.ndarray | None = None
    vnorm: np.ndarray | None = None
    votes: np.ndarray | None = None
    groups: np.ndarray | None = None
    rows: "RowSource | None" = None
    wo_l2: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.pos = np.asarray(self.pos, dtype=np.int64)
        if self.k is None:
            if self.votes is None or self.pos.ndim != 2 or self.q is None:
                raise ValueError(f"layer {self.layer}: without k, give votes, q and pos [Hkv, n]")
            (hkv, n), d = self.pos.shape, self.q.shape[2]
            if self.votes.shape != (self.q.shape[0], n):
                raise ValueError(f"layer {self.layer}: votes {self.votes.shape} must be [Hq, {n}]")
        elif self.k.ndim != 3 or self.v.shape[:2] != self.k.shape[:2]:
            raise ValueError(f"layer {self.layer}: k {self.k.shape} and v {self.v.shape} must be [Hkv, n, d]")
        else:
            hkv, n, d = self.k.shape
        if self.pos.shape not in ((n,), (hkv, n)):
            raise ValueError(f"layer {self.layer}: pos {self.pos.shape} must be [{n}] or [{hkv}, {n}]")
        if (self.q is None) != (self.q_pos is None):
            raise ValueError(f"layer {self.layer}: give both q and q_pos, or neither")
        if self.q is not None:
            self.q_pos = np.asarray(self.q_pos, dtype=np.int64).reshape(-1)
            if self.q.ndim != 3 or self.q.shape[2] != d or self.q.shape[0] % hkv or self.q.shape[1] != len(self.q_pos):
                raise ValueError(f"layer {self.layer}: q {self.q.shape} must be [Hq, w, {d}] with Hq a multiple of "
                                 f"{hkv} and w = len(q_pos) = {len(self.q_pos)}")
        if self.pos.size and self.pos.min() < EMPTY:
            raise ValueError(f"layer {self.layer}: positions must be >= 0, or -1 for an empty row")
        if self.bias is not None:
            self.bias = np.ascontiguousarray(np.broadcast_to(self.bias, (hkv, n)), dtype=np.float32)
            # finite exactly where live, and the others -inf (not NaN or +inf): two passes, the rows of an answer
            # step's union are checked for every layer at every swap
            empty = self.pos_h < 0
            if not np.array_equal(np.isfinite(self.bias), ~empty) or not (self.bias[empty] == -np.inf).all():
                raise ValueError(f"layer {self.layer}: bias must be finite (log(count)) for live rows and -inf "
                                 "exactly for the empty rows (pos -1)")
        if self.vnorm is not None and (self.vnorm.shape != (hkv, n) or self.vnorm.dtype != np.float32):
            raise ValueError(f"layer {self.layer}: vnorm must be float32 [{hkv}, {n}], "
                             f"got {self.vnorm.dtype} {self.vnorm.shape}")

    def detached(self) -> "LayerInputs":
        """A copy whose ``k`` and ``v`` no longer alias the cache (see ``k, v``): for keeping past the event."""
        return dataclasses.replace(self, k=None if self.k is None else np.array(self.k),
                                   v=None if self.v is None else np.array(self.v))

    @property
    def n_kv(self) -> int:
        return self.k.shape[0] if self.k is not None else self.pos.shape[0]

    @property
    def n(self) -> int:
        return self.k.shape[1] if self.k is not None else self.pos.shape[1]

    @property
    def n_head(self) -> int:
        if self.q is None:
            raise ValueError(f"layer {self.layer}: no observation queries")
        return self.q.shape[0]

    @property
    def pos_h(self) -> np.ndarray:
        """Positions per KV head ``[Hkv, n]`` (a read-only broadcast of ``pos`` when it is ``[n]``)."""
        return np.broadcast_to(self.pos, (self.n_kv, self.n))

    @property
    def live(self) -> np.ndarray:
        """``[Hkv, n]`` True for the rows that hold a token (``pos >= 0``; the others are empty)."""
        return self.pos_h >= 0

    @property
    def n_live(self) -> np.ndarray:
        """``[Hkv]`` int64 live rows per head."""
        return self.live.sum(axis=1)

    @property
    def counts(self) -> np.ndarray:
        """``[Hkv, n]`` int64 source tokens per row: ``rint(exp(bias))``, 1 without a bias, 0 for empty rows."""
        if self.bias is None:
            return self.live.astype(np.int64)
        with np.errstate(over="ignore"):
            return np.where(self.live, np.rint(np.exp(self.bias)), 0).astype(np.int64)

    def window_mask(self, q_pos: np.ndarray | None = None) -> np.ndarray:
        """``[Hkv, n]`` True for the live cells of the observation window (see ``window``).

        ``q_pos`` are the queries actually used (a scorer may use only the last ones); default all.
        """
        pos = self.pos_h
        if self.recent is not None:
            if self.recent <= 0 or self.n == 0:
                return np.zeros(pos.shape, dtype=bool)
            recent = np.sort(pos, axis=1)[:, max(0, self.n - self.recent)][:, None]  # empty rows (-1) sort first
            return (pos >= recent) & self.live
        q_pos = self.q_pos if q_pos is None else q_pos
        if q_pos is None or len(q_pos) == 0:
            return np.zeros(pos.shape, dtype=bool)
        return (pos >= int(np.min(q_pos))) & self.live

    def protected(self, q_pos: np.ndarray | None = None) -> np.ndarray:
        """``[Hkv, n]`` True for the live cells no method may evict: sinks and the window (:meth:`window_mask`)."""
        return ((self.pos_h < self.n_sink) & self.live) | self.window_mask(q_pos)

    def take(self, cells: np.ndarray) -> "LayerInputs":
        """These inputs restricted to the rows ``cells`` ``[Hkv, m]`` of each head (``-1``: an empty row).

        Known ``vnorm`` are copied (a scorer filling in norms of the subset does not write back here). Inputs
        without ``k`` but with :attr:`rows` get the subset's rows from there, and all the observation queries.
        """
        cells = np.asarray(cells, dtype=np.int64)
        heads, filled, idx = np.arange(self.n_kv)[:, None], cells >= 0, np.maximum(cells, 0)

        def rows(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.where(filled[..., None], a[heads, idx], 0).astype(a.dtype)

        fetched = {}
        if self.k is None and self.rows is not None:
            k, v = self.rows.fetch(cells)
            fetched = dict(k=np.where(filled[..., None], k, 0), v=np.where(filled[..., None], v, 0),
                           q=self.rows.q, q_pos=self.rows.q_pos, rows=None)

        votes = None
        if self.votes is not None:  # [Hq, n]: query head h reads KV head h // G
            group = self.votes.shape[0] // self.n_kv
            qf, qi = np.repeat(filled, group, axis=0), np.repeat(idx, group, axis=0)
            votes = np.where(qf, np.take_along_axis(self.votes, qi, axis=1), 0).astype(np.float32)

        bias = None
        if self.bias is not None or not filled.all():
            bias = np.zeros(cells.shape, np.float32) if self.bias is None else self.bias[heads, idx]
            bias = np.where(filled, bias, -np.inf).astype(np.float32)
        groups = None if self.groups is None else np.where(filled, self.groups[heads, idx], -1)
        return dataclasses.replace(
            self, **{"k": rows(self.k), "v": rows(self.v), **fetched}, pos=np.where(filled, self.pos_h[heads, idx], EMPTY),
            bias=bias, votes=votes, groups=groups,
            vnorm=None if self.vnorm is None else np.where(filled, self.vnorm[heads, idx], np.nan).astype(np.float32))

    def loaded(self) -> "LayerInputs":
        """These inputs with every row's K and V on the host (fetched from :attr:`rows` where ``k`` is None)."""
        if self.k is not None:
            return self
        if self.rows is None:
            raise ValueError(f"layer {self.layer}: this scorer reads K and V, and these inputs have no rows")
        return self.take(np.broadcast_to(np.arange(self.n), (self.n_kv, self.n)))


class RowSource:
    """The rows of inputs whose K/V stay on the device (:attr:`LayerInputs.rows`): :meth:`fetch` copies the
    rows asked for to the host; ``q``/``q_pos`` are all the observation queries in the keys' basis (a scorer
    that reads the rows reads these, where the device scored the last ``window_size``)."""

    q: np.ndarray
    q_pos: np.ndarray

    def fetch(self, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V ``[Hkv, m, d]`` float32 (keys in their stored basis) of the rows ``cells`` ``[Hkv, m]`` (-1: any
        row; the caller masks it)."""
        raise NotImplementedError


def check_window_params(window_size: int, kernel_size: int, pooling: str) -> None:
    """ValueError for an observation window or pooling kernel an attention scorer cannot use."""
    if window_size < 1:
        raise ValueError(f"window_size must be >= 1, got {window_size}")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd and >= 1, got {kernel_size}")
    if pooling not in kernels.POOL_KINDS:
        raise ValueError(f"pooling must be one of {sorted(kernels.POOL_KINDS)}, got {pooling!r}")


def window_votes(q, q_pos, k, pos, bias=None) -> np.ndarray:
    """:func:`kvlocal.kernels.window_votes`, or its numpy definition where that is faster (:func:`native_scoring`)."""
    return (kernels.window_votes if native_scoring() else numpy_kernels.window_votes)(q, q_pos, k, pos, bias)


def vnorm(v, wo, first_head, n_group, rows=None, p=1) -> np.ndarray:
    """:func:`kvlocal.kernels.vnorm`, or its numpy definition where that is faster (:func:`native_scoring`)."""
    return (kernels.vnorm if native_scoring() else numpy_kernels.vnorm)(v, wo, first_head, n_group, rows, p)



def order_by_pos(pos: np.ndarray, n_kv: int, descending: bool = False) -> np.ndarray:
    """``[n_kv, n]`` cell indices in position order per head (stable); ``pos``: [n] (sorted once) or [n_kv, n]."""
    order = np.argsort(-pos if descending else pos, axis=-1, kind="stable")
    return np.broadcast_to(order, (n_kv, pos.shape[-1])) if pos.ndim == 1 else order


def top_cells(scores: np.ndarray, k: int, pos: np.ndarray) -> np.ndarray:
    """Per head, the ``k`` best cells of ``scores`` [Hkv, n], ties to the later position: ``[Hkv, k]``.

    ``pos``: [n] or [Hkv, n]. ``kernels.topk`` breaks ties towards the lower index, so the scores are
    handed to it with the cells in *descending* position order: its lower index is then the later
    position, the reference's tie-break (protected cells all score +inf; when a budget is below their
    number, the most recent survive). The result is in no particular order.
    """
    if k == 0:  # (kernels.topk cannot take rows of length 0)
        return np.zeros((scores.shape[0], 0), dtype=np.int64)
    desc = order_by_pos(np.asarray(pos), scores.shape[0], descending=True)  # [Hkv, n]
    idx = kernels.topk(np.take_along_axis(scores, desc, axis=1), k)  # [Hkv, k] into desc
    return np.take_along_axis(desc, idx.astype(np.int64), axis=1)


def top_cells_per_head(scores: np.ndarray, ks: np.ndarray, pos: np.ndarray) -> list[np.ndarray]:
    """:func:`top_cells` with a different ``ks[h]`` per head: one array of cells per head, in no order."""
    pos = np.broadcast_to(np.asarray(pos), scores.shape)
    out: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * scores.shape[0]
    for k in np.unique(ks):  # one top-k for all heads that share a k
        heads = np.flatnonzero(ks == k)
        for h, cells in zip(heads, top_cells(scores[heads], int(k), pos[heads])):
            out[h] = cells
    return out


def group_max(scores: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
    """``scores`` [Hkv, n] with every grouped row (``groups >= 0``) raised to the best score of its group."""
    if groups is None or not (groups >= 0).any():
        return scores
    out = np.array(scores, dtype=np.float32, copy=True)
    for h in range(out.shape[0]):
        g = groups[h]
        rows = np.flatnonzero(g >= 0)
        if not len(rows):
            continue
        ids, inv = np.unique(g[rows], return_inverse=True)
        best = np.full(len(ids), -np.inf, np.float32)
        np.maximum.at(best, inv, out[h, rows])
        out[h, rows] = np.where(out[h, rows] == -np.inf, -np.inf, best[inv])  # an empty row stays empty
    return out


def select(scores: np.ndarray, budget, pos: np.ndarray, live: np.ndarray | None = None) -> np.ndarray:
    """Per-head top of ``scores`` [Hkv, n]: kept cell indices ``[Hkv, B]``, each head's sorted by position.

    ``budget``: one int or ``[Hkv]`` per-head budgets. Head ``h`` keeps ``min(budget[h], live[h].sum())``
    cells (``live``: [Hkv, n], default all; empty rows are never kept). ``B`` is the most any head
    keeps; a head that keeps fewer has its cells in the last slots and ``-1`` in the first ones. Ties
    go to the later position; ``pos``: [n] or [Hkv, n]. Scores must not be NaN.
    """
    scores = np.asarray(scores, dtype=np.float32)
    hkv, n = scores.shape
    pos = np.broadcast_to(np.asarray(pos, dtype=np.int64), (hkv, n))
    n_live = np.full(hkv, n) if live is None else live.sum(axis=1)
    if live is not None:
        scores = np.where(live, scores, -np.inf)
    budgets = np.clip(np.broadcast_to(np.asarray(budget, dtype=np.int64), (hkv,)), 0, n_live)
    width = int(budgets.max(initial=0))
    out = np.full((hkv, width), EMPTY, dtype=np.int64)
    for h, cells in enumerate(top_cells_per_head(scores, budgets, pos)):
        out[h, width - len(cells):] = cells[np.argsort(pos[h, cells], kind="stable")]
    return out


class Scorer:
    """Base class of the eviction scorers; the contract is in the module docstring.

    Capabilities — what a method asks of the engine, derived from the classes (a scorer that has one says
    so with a class attribute; a wrapper has it when a part it wraps has it). The registries in
    :mod:`kvlocal.compress` (``WO_METHODS``, ``BIAS_METHODS``, ``MERGING_METHODS``) are computed from these.
    """

    PARTS = ("press", "merger")  # the fields of a wrapper that hold another scorer

    def _parts_have(self, capability: str) -> bool:
        return any(getattr(getattr(self, part, None), capability, False) for part in self.PARTS)

    @property
    def needs_wo(self) -> bool:
        """Weighs entries by their value through ``W_O`` (``LayerInputs.wo``, read from the GGUF)."""
        return self._parts_have("needs_wo")

    @property
    def needs_bias(self) -> bool:
        """Its plans need llama.cpp's per-head attention bias (patch 0007): merged slots (``log(count)``)
        or heads that keep different numbers of rows (``-inf`` for the surplus slots)."""
        return self._parts_have("needs_bias")

    @property
    def merges(self) -> bool:
        """Its plans hold merged slots: rows that stand for several tokens."""
        return self._parts_have("merges")

    def score(self, layer: LayerInputs) -> np.ndarray:
        raise NotImplementedError

    def rerank(self, layer: LayerInputs, scores: np.ndarray, budgets: np.ndarray) -> np.ndarray:
        return scores

    def keep(self, layer: LayerInputs, budget: int) -> np.ndarray:
        budgets = np.minimum(max(int(budget), 0), layer.n_live)
        return select(group_max(self.rerank(layer, self.score(layer), budgets), layer.groups), budgets, layer.pos,
                      layer.live)

    def max_slots(self, budget: int) -> int:
        """The most slots (cells) a plan at ``budget`` may have: the budget, unless heads share it unevenly."""
        return int(budget)

    def budget_for_cells(self, cells: int) -> int:
        """The largest per-head budget whose plans fit in ``cells`` slots (the inverse of :meth:`max_slots`)."""
        return int(cells)

    def plan_layer(self, layer: LayerInputs, budget: int) -> LayerPlan:
        """:meth:`keep` as a :class:`LayerPlan`; the kept rows' counts are carried where any is not 1."""
        keep = self.keep(layer, budget)
        return LayerPlan(keep=keep, counts=kept_counts(layer, keep))


def kept_counts(layer: LayerInputs, keep: np.ndarray) -> np.ndarray | None:
    """``[Hkv, B]`` counts of the kept cells ``keep`` (0 for ``-1``), or ``None`` if every live row counts 1."""
    if layer.bias is None or not (layer.bias > 0).any():  # (log(count) > 0 only where a row stands for several)
        return None
    counts = layer.counts
    if np.all(counts[layer.live] == 1):
        return None
    return np.where(keep >= 0, np.take_along_axis(counts, np.maximum(keep, 0), axis=1), 0)


def plan_layers(scorer: Scorer, layers: Iterable[LayerInputs], budget: int, workers: int = 1) -> Plan:
    """The :class:`~kvlocal.compress.plan.Plan` of one compression event: ``scorer.plan_layer`` for every layer.

    ``B`` is the most entries any head of any layer keeps (``<= budget`` for uniform methods, ``<=
    int(max_share * budget)`` for AdaKV); heads with fewer get empty slots in front. ``layers`` may be
    a generator: at most ``2 * workers`` layers' inputs are held at a time (only their positions are kept).
    ``workers > 1`` plans that many layers at once on threads — the C kernels release the GIL, so one
    layer's kernels run while another's numpy work does; layers are independent, so the plan is the same.
    Twice as many layers as workers are queued, so that a worker finding its layer done takes the next at once
    instead of waiting for this thread to make its inputs (docs/engine.md § Then: the workers kept busy).
    """
    plans, positions = [], []
    if workers <= 1:
        for layer in layers:
            plans.append(scorer.plan_layer(layer, budget))
            positions.append(layer.pos_h)
        return Plan.from_layers(plans, positions)
    pending: collections.deque = collections.deque()
    pool = _planning_pool(workers)
    try:
        for layer in layers:
            if len(pending) == 2 * workers:
                plans.append(pending.popleft().result())
            pending.append(pool.submit(scorer.plan_layer, layer, budget))
            positions.append(layer.pos_h)
        plans.extend(f.result() for f in pending)
    finally:  # an error: the layers already queued finish before it propagates (their inputs alias the cache)
        concurrent.futures.wait(pending)
    return Plan.from_layers(plans, positions)


_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads: it starts its own pools
    os.register_at_fork(after_in_child=_POOLS.clear)


def _planning_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The threads that plan layers, kept for the process (one pool per worker count): an answer step plans
    every layer at each swap, and a pool started at each one showed its threads' start in a step's profile.
    Calls from several threads (a server's engines) share it: each waits only for its own layers."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvlocal-plan")
        return pool


def observation_window(scorer: Scorer) -> int | None:
    """The observation queries an attention scorer reads (SnapKV's ``window_size``, through wrappers), or
    None for a scorer that reads none."""
    while scorer is not None:
        if hasattr(scorer, "window_size"):
            return int(scorer.window_size)
        scorer = getattr(scorer, "press", None)
    return None
