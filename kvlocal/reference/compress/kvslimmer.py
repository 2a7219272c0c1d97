"""KVSlimmer: merge adjacent key pairs with a closed-form, gradient-free weighting."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlocal.reference.cache import LayerKV
from kvlocal.reference.compress.base import (
    Observation,
    apply_keep,
    gather_rows,
    live_mask,
    protected_mask,
    select,
    window_attention,
)


@dataclass
class MergePlan:
    """Which adjacent rows every KV head merges, and with which key weights.

    ``pairs[h]`` is ``[P_h, 2]`` int64 slot indices ``(m, m+1)`` (``m`` the earlier position), sorted
    by position; ``weights[h]`` is ``[P_h, 2]`` float64 ``(w_m, w_{m+1})`` with ``w_m + w_{m+1} = 1``, so
    ``k* = w_m k_m + w_{m+1} k_{m+1}``. The merged row replaces row ``m``; row ``m+1`` goes.
    """

    pairs: list[torch.Tensor]
    weights: list[torch.Tensor]


def slot_attention(kv: LayerKV, q: torch.Tensor, q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward quantities of the merge: slot attention ``alpha`` [Hkv, S] and output ``o`` [Hkv, d].

    ``alpha[g, j]`` is the softmax weight of row ``j`` (with its ``log(count)`` bias, so a merged slot's
    whole mass) averaged over the observation queries and over the G query heads of KV head ``g`` (GQA
    mean, as the KVSlimmer code). ``o[g] = sum_j alpha[g, j] v̄[g, j]`` is then exactly the mean of the
    real attention outputs of those queries and heads (attention is linear in the weights).
    """
    hkv, s = kv.pos.shape
    attn = window_attention(kv, q, q_pos)  # [Hq, w, S]
    alpha = attn.mean(dim=1).view(hkv, -1, s).mean(dim=1)  # [Hkv, S]
    o = (alpha[..., None] * kv.v.to(torch.float32)).sum(dim=1)  # [Hkv, d]
    return alpha, o


def hessian_norms(a1: torch.Tensor, a2: torch.Tensor, v1: torch.Tensor, v2: torch.Tensor,
                  o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KVSlimmer's ``ĥ11, ĥ22, ĥ12`` (paper form, L2 norms; docs/algorithms.md).

    a1, a2: [...] attention of the two slots; v1, v2: [..., d] their (mean) values; o: [..., d] output.
    ``ĥ11 = ||a1(1-2a1)(v1-o)||``, ``ĥ22 = ||a2(1-2a2)(v2-o)||``, ``ĥ12 = ||a1 a2 (v1+v2-2o)||``: the norms of
    the second derivatives ``∂²o/∂s1²``, ``∂²o/∂s2²`` and ``∂²o/∂s1∂s2`` of the attention output.
    """
    h11 = (a1 * (1 - 2 * a1))[..., None] * (v1 - o)
    h22 = (a2 * (1 - 2 * a2))[..., None] * (v2 - o)
    h12 = (a1 * a2)[..., None] * (v1 + v2 - 2 * o)
    return h11.norm(dim=-1), h22.norm(dim=-1), h12.norm(dim=-1)


def merge_weights(a1: torch.Tensor, a2: torch.Tensor, v1: torch.Tensor, v2: torch.Tensor,
                  o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key weights ``(w1, w2)`` of ``k* = [(ĥ11-ĥ12) k1 + (ĥ22-ĥ12) k2] / (ĥ11 + ĥ22 - 2ĥ12)``, float64.

    The stationary point of the second-order loss with the full 2x2 block Hessian. The weights sum to
    1 but are not clipped to [0, 1] (as in the paper and the code). Where the denominator is not
    positive (``ĥ12`` dominates, so the quadratic has no minimum, or everything is 0) the pair falls
    back to the plain average; the released code divides by ``A + B + 1e-21`` instead, which returns a
    zero key when ``A + B = 0``.
    """
    h11, h22, h12 = hessian_norms(*(x.to(torch.float64) for x in (a1, a2, v1, v2, o)))
    a, b = h11 - h12, h22 - h12
    den = a + b
    ok = den > 1e-12 * (h11 + h22)
    w1 = torch.where(ok, a / torch.where(ok, den, 1.0), 0.5)
    return w1, 1 - w1


def select_pairs(mass: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """Greedy non-overlapping adjacent pairs with the smallest mass.

    mass: [m] slot attention in position order. Pair ``i`` is ``(i, i+1)`` with mass
    ``mass[i] + mass[i+1]``; pairs are taken cheapest first (ties: earlier first), skipping any that
    shares a slot with a pair already taken, until ``n_pairs``. Returns the sorted ``i``s (maybe fewer).
    """
    if mass.numel() < 2 or n_pairs <= 0:
        return torch.zeros(0, dtype=torch.int64)
    taken = torch.zeros(mass.numel(), dtype=torch.bool)
    chosen = []
    for i in torch.argsort(mass[:-1] + mass[1:], stable=True).tolist():
        if len(chosen) == n_pairs:
            break
        if not taken[i] and not taken[i + 1]:
            taken[i] = taken[i + 1] = True
            chosen.append(i)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def apply_merges(kv: LayerKV, plan: MergePlan, max_count: int | None = None) -> None:
    """Write a :class:`MergePlan` into ``kv`` (in place).

    The merged row gets ``k* = w_m k_m + w_{m+1} k_{m+1}``, the count-weighted mean value (the cache
    stores means; with the ``log(count)`` bias this is AsymKV's summed value), ``count = l_m + l_{m+1}``
    (clipped at ``max_count`` if given), bias ``log(count)``, and the later member's position. The
    partner rows are removed; heads that merged fewer pairs than others are padded with cleared rows.
    """
    k, v = kv.k.clone(), kv.v.clone()
    pos, count, bias = kv.pos.clone(), kv.count.clone(), kv.bias.clone()
    rows = []
    for h, (pairs, w) in enumerate(zip(plan.pairs, plan.weights)):
        m, n = pairs[:, 0], pairs[:, 1]
        w = w.to(torch.float32)
        lm, ln = count[h, m].to(torch.float32), count[h, n].to(torch.float32)
        k[h, m] = (w[:, :1] * k[h, m].to(torch.float32) + w[:, 1:] * k[h, n].to(torch.float32)).to(k.dtype)
        v[h, m] = ((lm[:, None] * v[h, m].to(torch.float32) + ln[:, None] * v[h, n].to(torch.float32))
                   / (lm + ln)[:, None]).to(v.dtype)
        merged = count[h, m] + count[h, n]
        if max_count is not None:
            merged = merged.clamp(max=max_count)
        count[h, m] = merged
        bias[h, m] = torch.log(merged.to(torch.float32))
        pos[h, m] = torch.maximum(pos[h, m], pos[h, n])
        drop = torch.zeros(kv.n_slots, dtype=torch.bool)
        drop[n] = True
        rows.append(torch.nonzero(~drop).flatten())
    kv.k, kv.v, kv.pos, kv.count, kv.bias = k, v, pos, count, bias
    gather_rows(kv, rows)


@dataclass
class MergeGroups:
    """What :meth:`KVSlimmer.compress` did to a layer, in terms of the rows it started from.

    For KV head ``h`` and its ``r``-th live row afterwards (in position order): ``members[h][r]``, the
    input rows it stands for (int64, position order; one row if it was not merged), and
    ``weights[h][r]``, their key weights (float64, sum 1): the row's key is ``Σ_i w_i k_i`` of the input
    keys (up to the float32 rounding of the intermediate keys). ``rounds``: the pair rounds, in slot
    indices of the cache as it was at each round.
    """

    members: list[list[torch.Tensor]]
    weights: list[list[torch.Tensor]]
    rounds: list[MergePlan]


Group = tuple[torch.Tensor, torch.Tensor]  # (input rows, key weights) that one row of the cache stands for
NO_GROUP: Group = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64))


def groups_after_merges(groups: list[list[Group]], plan: MergePlan, n_slots: int) -> list[list[Group]]:
    """The groups of every row after :func:`apply_merges` (row ``m`` takes ``m+1``'s members; ``m+1`` goes)."""
    out = []
    for rows, pairs, w in zip(groups, plan.pairs, plan.weights):
        rows = list(rows)
        for (m, n), (w1, w2) in zip(pairs.tolist(), w.tolist()):
            rows[m] = (torch.cat([rows[m][0], rows[n][0]]), torch.cat([w1 * rows[m][1], w2 * rows[n][1]]))
        gone = set(pairs[:, 1].tolist())
        rows = [g for r, g in enumerate(rows) if r not in gone]
        out.append(rows + [NO_GROUP] * (n_slots - len(rows)))
    return out


@dataclass
class KVSlimmer:
    """Merge adjacent key pairs of low attention; closed-form key weights from forward quantities only.

    Based on https://arxiv.org/abs/2603.00907 (KVSlimmer; built on AsymKV, https://arxiv.org/abs/2506.05410).
    Implements the paper's formula with L2 norms (docs/algorithms.md), not the released code's
    smoothed L1 proxy. Per KV head: ``alpha`` and ``o`` from the observation queries (:func:`slot_attention`);
    candidate rows are the live, unprotected rows (not the first ``n_sink`` positions, not at or after
    the first observation query) in position order; the non-overlapping adjacent pairs with the smallest
    ``alpha_m + alpha_{m+1}`` are merged (:func:`select_pairs`) with :meth:`key_weights`. Each head
    picks its own pairs (the code shares pair positions across the heads of a layer). Not reproduced
    from the AsymKV/KVSlimmer code: the recency penalty ``exp(j/γ)``, overlapping pairs (which silently
    evict a token), the count clip at 5 (available as ``max_count``), the scalar pair-cardinality
    factor, the cross-chunk smoothing, the ``o`` built from summed values.

    To reach a budget, :meth:`compress` merges in rounds: each round takes up to ``live - budget`` pairs
    per head and recomputes ``alpha`` and ``o`` over the merged cache, until every head has at most
    ``budget`` live rows; a merged row can merge again, so a row may stand for more than two tokens.
    When no head over the budget has two candidates left (the sinks and the window fill the budget),
    the rest is evicted: the candidates with the least ``alpha`` first, then protected rows, oldest first.

    Parameters
    ----------
    n_sink : int
        Positions ``0 .. n_sink-1`` are never merged (32 in the AsymKV/KVSlimmer code).
    max_count : int, optional
        Clip merged counts (5 in the code). ``None`` (default) keeps the true member counts, which is
        what makes the merge lossless for identical keys.
    """

    n_sink: int = 32
    max_count: int | None = None

    def key_weights(self, a1, a2, v1, v2, o) -> tuple[torch.Tensor, torch.Tensor]:
        """The key weights of merged pairs: KVSlimmer's closed form (:func:`merge_weights`)."""
        return merge_weights(a1, a2, v1, v2, o)

    def plan_pairs(self, kv: LayerKV, obs: Observation, n_pairs) -> MergePlan:
        """Choose up to ``n_pairs`` pairs per head (one int, or [Hkv]; fewer where a head has too few candidates)."""
        if obs.q is None or obs.q_pos is None:
            raise ValueError("KVSlimmer needs the observation queries obs.q and obs.q_pos")
        alpha, o = slot_attention(kv, obs.q, obs.q_pos)
        candidate = live_mask(kv) & ~protected_mask(kv, self.n_sink, obs.q_pos)
        n_pairs = torch.as_tensor(n_pairs).expand(kv.pos.shape[0])
        pairs, weights = [], []
        for h in range(kv.pos.shape[0]):
            rows = torch.nonzero(candidate[h]).flatten()
            rows = rows[torch.argsort(kv.pos[h, rows], stable=True)]
            i = select_pairs(alpha[h, rows], int(n_pairs[h]))
            m, n = rows[i], rows[i + 1]
            w1, w2 = self.key_weights(alpha[h, m], alpha[h, n], kv.v[h, m].float(), kv.v[h, n].float(), o[h])
            pairs.append(torch.stack([m, n], dim=1))
            weights.append(torch.stack([w1, w2], dim=1))
        return MergePlan(pairs=pairs, weights=weights)

    def compress(self, kv: LayerKV, obs: Observation, budget: int) -> MergeGroups:
        """Merge (in rounds, see the class docstring) until every head has at most ``budget`` live rows."""
        if obs.q is None or obs.q_pos is None:
            raise ValueError("KVSlimmer needs the observation queries obs.q and obs.q_pos")
        start_pos = kv.pos.clone()
        groups = [[(torch.tensor([r]), torch.ones(1, dtype=torch.float64)) if alive else NO_GROUP
                   for r, alive in enumerate(row.tolist())] for row in live_mask(kv)]
        rounds = []
        while True:
            live = live_mask(kv)
            excess = (live.sum(dim=1) - budget).clamp(min=0)
            if not excess.any():
                break
            protected = protected_mask(kv, self.n_sink, obs.q_pos)
            n_pairs = torch.where((live & ~protected).sum(dim=1) >= 2, excess, 0)
            if not n_pairs.any():  # nothing left to merge: evict, least attention first
                alpha, _ = slot_attention(kv, obs.q, obs.q_pos)
                keep = select(alpha.masked_fill(protected, math.inf).masked_fill(~live, -math.inf), budget, kv.pos)
                groups = [[rows[r] for r in kept.tolist()] for rows, kept in zip(groups, keep.keep)]
                apply_keep(kv, keep)
                groups = [rows + [NO_GROUP] * (kv.n_slots - len(rows)) for rows in groups]
                break
            plan = self.plan_pairs(kv, obs, n_pairs)
            apply_merges(kv, plan, self.max_count)
            groups = groups_after_merges(groups, plan, kv.n_slots)
            rounds.append(plan)
        members, weights = [], []
        for h, rows in enumerate(groups):
            live_rows = torch.nonzero(live_mask(kv)[h]).flatten()
            members.append([]), weights.append([])
            for r in live_rows[torch.argsort(kv.pos[h, live_rows])].tolist():
                cells, w = rows[r]
                order = torch.argsort(start_pos[h, cells])
                members[h].append(cells[order])
                weights[h].append(w[order])
        return MergeGroups(members=members, weights=weights, rounds=rounds)

    def plan(self, kv: LayerKV, obs: Observation, budget: int) -> MergeGroups:
        """:meth:`compress` on a copy of ``kv`` (``kv`` is left as it is)."""
        copy = LayerKV(kv.k.clone(), kv.v.clone(), kv.pos.clone(), kv.count.clone(), kv.bias.clone())
        return self.compress(copy, obs, budget)


@dataclass
class MeanMerge(KVSlimmer):
    """KVSlimmer's pairs and rounds with the plain average of the two keys (weights 1/2, 1/2).

    The ablation of KVSlimmer's closed form: everything else (pair choice, count-weighted mean values,
    ``log(count)`` bias) is the same.
    """

    def key_weights(self, a1, a2, v1, v2, o) -> tuple[torch.Tensor, torch.Tensor]:
        half = torch.full(torch.as_tensor(a1).shape, 0.5, dtype=torch.float64)
        return half, half.clone()


METHODS = {  # the twins of kvlocal.compress's, by name
    "kvslimmer": lambda n_sink: KVSlimmer(n_sink=n_sink),
    "meanmerge": lambda n_sink: MeanMerge(n_sink=n_sink),
}
