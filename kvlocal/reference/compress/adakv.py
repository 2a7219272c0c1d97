"""AdaKV: share a layer's budget between its KV heads by a flattened top-k over their scores."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvlocal.reference.cache import LayerKV
from kvlocal.reference.compress.base import KeepPlan, Observation, Scorer, order_desc, select
from kvlocal.reference.compress.criticalkv import CriticalKV
from kvlocal.reference.compress.snapkv import SnapKV


def flat_counts(scores: torch.Tensor, total: int, pos: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """How many of the ``total`` best entries of the flattened [Hkv, S] scores fall in each head.

    Only the entries where ``candidate`` [Hkv, S] is True take part. Ties (all protected rows score
    +inf) go to the later position, then to the lower head.
    """
    hkv, s = scores.shape
    head = torch.arange(hkv)[:, None].expand(hkv, s)[candidate]  # head-major, as the flattened [Hkv, S]
    order = order_desc(scores[candidate][None], pos[candidate][None])[0, :total]
    return torch.bincount(head[order], minlength=hkv)


def top_rows(scores: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """[Hkv, S] True for each head's ``k`` best live rows (fewer if it has fewer), ties to the later position."""
    live = pos >= 0
    order = order_desc(scores.masked_fill(~live, -math.inf), pos)
    mask = torch.zeros_like(live)
    for h in range(scores.shape[0]):
        mask[h, order[h, : min(k, int(live[h].sum()))]] = True
    return mask


def largest_remainder(x: torch.Tensor, total: int) -> torch.Tensor:
    """Round the non-negative reals ``x`` to integers summing to ``total`` (Hamilton's method)."""
    base = torch.floor(x).to(torch.int64)
    rest = total - int(base.sum())
    if rest > 0:
        base[torch.argsort(x - base, descending=True, stable=True)[:rest]] += 1
    return base


def adakv_budgets(scores: torch.Tensor, budget: int, pos: torch.Tensor, alpha: float = 0.2,
                  mode: str = "floor", max_share: float | None = 2.0) -> torch.Tensor:
    """Per-head budgets ``[Hkv]`` summing to ``Hkv * budget`` (``budget`` clipped to S).

    Only live rows (``pos >= 0``) count, and only each head's best ``int(max_share * budget)`` of them
    (``None``: no cap) take part in the flattened top-k, so no head gets more than that. With empty
    rows the sum can fall short of ``Hkv * budget`` (not enough live candidates).

    ``mode="floor"`` (original AdaKV, docs/algorithms.md): ``c_h`` = the count of head ``h`` among the
    flattened top-``Hkv*B``; every head gets the floor ``int(alpha*B)`` and the remaining
    ``Hkv*(B - floor)`` slots are shared in proportion to ``c_h``, rounded by largest remainder. That is
    the original ``round((1-alpha)*c_h + int(alpha*B))`` whenever ``alpha*B`` is an integer, except that
    the rounding keeps the sum exact (the original can miss or exceed ``Hkv*B`` by a few slots).

    ``mode="safeguard"`` (kvpress ``AdaKVPress``, §2.3): each head's top ``max(1, int(alpha*B))`` rows
    are set to +inf, then the budgets are the counts of the flattened top-``Hkv*B``.
    """
    hkv, s = scores.shape
    budget = max(0, min(budget, s))
    if mode not in ("floor", "safeguard"):
        raise ValueError(f"mode must be 'floor' or 'safeguard', got {mode!r}")
    if mode == "safeguard":
        scores = scores.masked_fill(top_rows(scores, pos, max(1, int(alpha * budget))), math.inf)
    candidate = top_rows(scores, pos, s if max_share is None else int(max_share * budget))
    total = min(hkv * budget, int(candidate.sum()))
    counts = flat_counts(scores, total, pos, candidate)
    if mode == "safeguard":
        return counts
    floor = int(alpha * budget)
    share = counts.to(torch.float64) * (budget - floor) / max(budget, 1)  # sums to Hkv*(B - floor)
    budgets = floor + largest_remainder(share, hkv * (budget - floor))
    return torch.minimum(budgets, (pos >= 0).sum(dim=1))


@dataclass
class AdaKV(Scorer):
    """Head-wise adaptive budgets for any scorer: heads with concentrated attention give slots to others.

    Based on https://arxiv.org/abs/2407.11550 (Ada-KV). The layer keeps ``Hkv * budget`` rows in all,
    split between its KV heads from the wrapped press's budget-free scores (see :func:`adakv_budgets`),
    then each head keeps its top ``b_h`` by the press's ranking (two-stage for CriticalKV). Unlike kvpress
    (which only masks), heads with smaller budgets really drop rows: :func:`apply_keep` clears them,
    and the slot count becomes ``max_h b_h``. Use it outermost: ``AdaKV(CriticalKV(SnapKV()))``.

    Parameters
    ----------
    press : Scorer
        The scorer whose scores decide both the budgets and, per head, the kept rows.
    alpha : float
        Floor ratio (``mode="floor"``; original code default 0.2, "suggested with GQA"; README 0.5) or
        safeguard ratio (``mode="safeguard"``; kvpress default 0.2).
    mode : str
        ``"floor"`` (original AdaKV, the default) or ``"safeguard"`` (kvpress; with the defaults
        ``alpha=0.2, max_share=2.0`` this is the engine's ``kvlocal.compress.AdaKV``).
    max_share : float, optional
        Cap: a head never gets more than ``int(max_share * budget)`` rows (only its best that many take
        part in the flattened top-k). The engine needs it to bound the cells it allocates (at most
        ``max_share * budget``); ``None``: no cap, as the original and kvpress.
    """

    press: Scorer = field(default_factory=SnapKV)
    alpha: float = 0.2
    mode: str = "floor"
    max_share: float | None = 2.0

    def score(self, kv: LayerKV, obs: Observation) -> torch.Tensor:
        return self.press.score(kv, obs)

    def rerank(self, kv: LayerKV, obs: Observation, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        return self.press.rerank(kv, obs, scores, budgets)

    def plan(self, kv: LayerKV, obs: Observation, budget: int) -> KeepPlan:
        scores = self.press.score(kv, obs)
        budgets = adakv_budgets(scores, budget, kv.pos, self.alpha, self.mode, self.max_share)
        return select(self.press.rerank(kv, obs, scores, budgets), budgets, kv.pos)


METHODS = {  # the twins of kvlocal.compress's, by name
    "adakv": lambda n_sink: AdaKV(SnapKV(n_sink=n_sink)),
    "criticalkv+adakv": lambda n_sink: AdaKV(CriticalKV(SnapKV(n_sink=n_sink))),
}
