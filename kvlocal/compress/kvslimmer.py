"""KVSlimmer: merge adjacent rows of low attention, with closed-form key weights, down to the budget."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlocal import kernels
from kvlocal.compress.base import LayerInputs, Scorer, order_by_pos, select, window_votes
from kvlocal.compress.methods import Method
from kvlocal.compress.plan import EMPTY, LayerPlan


def merge_weights(a1: np.ndarray, a2: np.ndarray, v1: np.ndarray, v2: np.ndarray, o: np.ndarray) -> np.ndarray:
    """Key weight ``w1`` [P] float64 of the earlier row of each pair (the later one gets ``1 - w1``).

    a1, a2: [P] attention of the two rows; v1, v2: [P, d] their (mean) values; o: [P, d] (or [d]) the
    output of each pair's head.
    ``k* = [(ĥ11-ĥ12) k1 + (ĥ22-ĥ12) k2] / (ĥ11 + ĥ22 - 2ĥ12)`` with ``ĥ11 = ||a1(1-2a1)(v1-o)||``,
    ``ĥ22 = ||a2(1-2a2)(v2-o)||``, ``ĥ12 = ||a1 a2 (v1+v2-2o)||`` (L2; docs/algorithms.md). Not clipped
    to [0, 1]; a pair whose denominator is not positive gets the plain average (1/2).
    """
    a1, a2 = np.asarray(a1, np.float64), np.asarray(a2, np.float64)
    v1, v2, o = np.asarray(v1, np.float64), np.asarray(v2, np.float64), np.asarray(o, np.float64)
    d1, d2 = v1 - o, v2 - o
    h11 = np.abs(a1 * (1 - 2 * a1)) * np.sqrt(np.einsum("pd,pd->p", d1, d1))
    h22 = np.abs(a2 * (1 - 2 * a2)) * np.sqrt(np.einsum("pd,pd->p", d2, d2))
    h12 = a1 * a2 * np.sqrt(np.einsum("pd,pd->p", d1 + d2, d1 + d2))
    den = h11 + h22 - 2 * h12
    ok = den > 1e-12 * (h11 + h22)
    return np.where(ok, (h11 - h12) / np.where(ok, den, 1.0), 0.5)


class MergeState:
    """One layer's cache while it is merged, kept over the input rows (no compaction).

    A merged row lives at the index of its latest member, whose position it keeps; the other members'
    rows are dead (``pos = -1``, bias ``-inf``). ``owner[h, i]`` is the row that holds input row ``i`` of
    head ``h`` now (as a flat index ``h * n + row``) and ``weight[h, i]`` its weight in that row's key: a
    row's key is ``Σ weight · k`` of the input keys it owns, its value their count-weighted mean, its
    count the sum of theirs.
    """

    def __init__(self, layer: LayerInputs):
        hkv, n, _ = layer.k.shape
        live = layer.live
        self.k = layer.k.astype(np.float32, copy=True)  # [Hkv, n, d]
        self.v = layer.v.astype(np.float32, copy=True)
        self.pos = np.array(layer.pos_h, dtype=np.int64)  # [Hkv, n], -1 = dead or empty
        self.count = layer.counts  # [Hkv, n] int64
        self.bias = np.zeros((hkv, n), np.float32) if layer.bias is None else layer.bias.copy()
        self.owner = np.arange(hkv * n).reshape(hkv, n)
        self.weight = live.astype(np.float64)

    @property
    def live(self) -> np.ndarray:
        return self.pos >= 0

    def attention(self, layer: LayerInputs) -> tuple[np.ndarray, np.ndarray]:
        """``alpha`` [Hkv, n] (mean over all observation queries and the G query heads of each KV head,
        with the ``log(count)`` bias: a merged row's whole mass) and ``o = Σ_j alpha_j v_j`` [Hkv, d]."""
        hkv, n = self.pos.shape
        live = self.live
        heads = np.arange(hkv)[:, None]
        cols = np.argsort(~live, axis=1, kind="stable")[:, : int(live.sum(axis=1).max(initial=0))]  # live first
        votes = window_votes(layer.q, layer.q_pos, self.k[heads, cols], self.pos[heads, cols],
                             self.bias[heads, cols])  # [Hq, m]: only the live rows (and a few dead ones)
        alpha = np.zeros((hkv, n), np.float32)
        alpha[heads, cols] = votes.reshape(hkv, -1, cols.shape[1]).mean(axis=1)
        return alpha, np.einsum("hn,hnd->hd", alpha, self.v)

    def merge(self, h: np.ndarray, a: np.ndarray, b: np.ndarray, w1: np.ndarray) -> None:
        """Merge rows ``a[i]`` into the later rows ``b[i]`` of heads ``h[i]``, key weights ``(w1, 1-w1)``."""
        w = np.stack([w1, 1.0 - w1]).astype(np.float32)[..., None]  # [2, P, 1]
        self.k[h, b] = w[0] * self.k[h, a] + w[1] * self.k[h, b]
        ca, cb = (self.count[h, x].astype(np.float32)[:, None] for x in (a, b))
        self.v[h, b] = (ca * self.v[h, a] + cb * self.v[h, b]) / (ca + cb)
        self.count[h, b] += self.count[h, a]
        self.bias[h, b] = np.log(self.count[h, b].astype(np.float32))
        self.kill(h, a)
        n = self.pos.shape[1]
        scale = np.ones(self.pos.size)
        scale[h * n + a], scale[h * n + b] = w1, 1.0 - w1
        move = np.arange(self.pos.size)
        move[h * n + a] = h * n + b
        self.weight *= scale[self.owner]
        self.owner = move[self.owner]

    def kill(self, h, rows: np.ndarray) -> None:
        self.pos[h, rows] = EMPTY
        self.bias[h, rows] = -np.inf

    def layer_plan(self, layer: LayerInputs) -> LayerPlan:
        """The live rows as a :class:`LayerPlan`: kept cells, counts, and the merged slots' members."""
        live = self.live
        keep = select(np.zeros(live.shape, np.float32), live.sum(axis=1), self.pos, live)
        counts = np.where(keep >= 0, np.take_along_axis(self.count, np.maximum(keep, 0), axis=1), 0)
        merges = [self._head_merges(layer, h, keep[h]) for h in range(len(keep))]
        return LayerPlan(keep=keep, counts=None if np.all(counts[keep >= 0] == 1) else counts,
                         merges=merges if any(len(m["slots"]) for m in merges) else None)

    def _head_merges(self, layer: LayerInputs, h: int, keep: np.ndarray) -> dict:
        pos_in, owner = layer.pos_h[h], self.owner[h] - h * layer.n  # owner: a row of head h
        members = np.flatnonzero(layer.live[h] & self.live[h][owner])  # input rows that survive
        own = owner[members]
        members = members[np.bincount(own, minlength=len(pos_in))[own] > 1]  # of merged rows only
        slot_of = np.full(len(pos_in), EMPTY)
        slot_of[keep[keep >= 0]] = np.flatnonzero(keep >= 0)
        members = members[np.lexsort((pos_in[members], slot_of[owner[members]]))]
        slots, first, sizes = np.unique(slot_of[owner[members]], return_index=True, return_counts=True)
        width = int(sizes.max(initial=0))
        group = np.repeat(np.arange(len(slots)), sizes)
        col = np.arange(len(members)) - first[group] + width - sizes[group]  # left-padded
        out = {"slots": slots.astype(np.int64),
               "cells": np.full((len(slots), width), EMPTY, np.int64),
               "positions": np.full((len(slots), width), EMPTY, np.int64),
               "weights": np.zeros((len(slots), width), np.float64)}
        out["cells"][group, col] = members
        out["positions"][group, col] = pos_in[members]
        out["weights"][group, col] = self.weight[h, members]
        return out


@dataclass
class KVSlimmer(Scorer):
    """Merge adjacent rows of low attention until every head fits the budget; closed-form key weights.

    Based on https://arxiv.org/abs/2603.00907 (KVSlimmer; built on AsymKV, https://arxiv.org/abs/2506.05410),
    as the reference ``kvlocal.reference.compress.KVSlimmer`` (the paper's L2 formula, not the released
    code's smoothed L1 proxy; docs/algorithms.md). Per KV head: ``alpha`` and ``o`` from all the
    observation queries, with the rows' ``log(count)`` bias, GQA mean (:meth:`MergeState.attention`);
    candidates are the live, unprotected rows (:meth:`LayerInputs.protected`) in position order; the
    non-overlapping adjacent pairs with the smallest ``alpha_m + alpha_{m+1}`` are merged
    (:func:`kvlocal.kernels.greedy_pairs`), keys by :meth:`pair_weights`, values by count-weighted mean,
    counts summed (bias ``log(count)``), at the later member's position.

    Rounds: each round merges up to ``live - budget`` pairs per head, then ``alpha`` and ``o`` are
    recomputed over the merged cache, until every head has at most ``budget`` live rows; a merged row
    may merge again (groups of more than two, key weights composed). When no head over the budget has
    two candidates left (sinks and window fill the budget), the rest is evicted instead: the candidates
    with the least ``alpha`` first, then protected rows, oldest first (as :func:`select`).

    No parameters: sinks and the recent span are the engine's (``LayerInputs.n_sink``, ``.recent``; the KVSlimmer
    code protects 32 sinks); counts are never clipped (the code clips at 5).
    """

    needs_bias = True  # not fields: merged slots carry log(count) in llama.cpp's per-head bias
    merges = True

    def pair_weights(self, a1, a2, v1, v2, o) -> np.ndarray:
        """Key weight of the earlier row of each pair: KVSlimmer's closed form (:func:`merge_weights`)."""
        return merge_weights(a1, a2, v1, v2, o)

    def keep(self, layer: LayerInputs, budget: int) -> np.ndarray:
        """The cells that hold each slot (a merged slot: its latest member); the merges are in :meth:`plan_layer`."""
        return self.plan_layer(layer, budget).keep

    def plan_layer(self, layer: LayerInputs, budget: int) -> LayerPlan:
        if layer.q is None:
            raise ValueError(f"layer {layer.layer}: {type(self).__name__} needs the observation queries q and q_pos")
        layer = layer.loaded()  # it merges rows: their K and V on the host
        budget = max(0, int(budget))
        state = MergeState(layer)
        protected = layer.protected()
        order = order_by_pos(layer.pos, layer.n_kv)  # positions never change: a merged row keeps its latest
        while True:
            live = state.live
            excess = live.sum(axis=1) - budget
            if np.all(excess <= 0):
                break
            candidate = live & ~protected
            mergeable = (excess > 0) & (candidate.sum(axis=1) >= 2)
            alpha, o = state.attention(layer)
            if not mergeable.any():  # nothing left to merge: evict, least attention first
                kept = select(np.where(protected, np.inf, alpha), budget, state.pos, live)
                for h in np.flatnonzero(excess > 0):
                    gone = np.ones(layer.n, dtype=bool)
                    gone[kept[h][kept[h] >= 0]] = False
                    state.kill(h, np.flatnonzero(gone & live[h]))
                break
            heads, firsts = [], []
            for h in np.flatnonzero(mergeable):
                rows = order[h][candidate[h, order[h]]]
                i = kernels.greedy_pairs(alpha[h, rows], int(excess[h]))
                heads.append(np.full(len(i), h))
                firsts.append((rows[i], rows[i + 1]))
            h = np.concatenate(heads)  # all heads' pairs at once
            a, b = np.concatenate([f[0] for f in firsts]), np.concatenate([f[1] for f in firsts])
            state.merge(h, a, b, self.pair_weights(alpha[h, a], alpha[h, b], state.v[h, a], state.v[h, b], o[h]))
        return state.layer_plan(layer)


METHODS = {"kvslimmer": Method(KVSlimmer, rank=7)}
