"""The scorer contract, the observation a scorer reads, and the keep-plan helpers.

Every eviction method here is a :class:`Scorer`: a dataclass whose fields are its hyperparameters and
whose methods turn one layer of the cache (:class:`~kvlocal.reference.cache.LayerKV`) plus an
:class:`Observation` into a score per (KV head, slot), higher = keep. Behaviours compose by wrapping,
as in kvpress: ``CriticalKV(SnapKV())``, ``AdaKV(CriticalKV(SnapKV()))`` (AdaKV outermost).

The contract, documented once:

``score(kv, obs) -> [Hkv, S]``
    Budget-free importance of every row, ``float32``. ``-inf`` for empty rows (never kept), ``+inf``
    for rows the method protects (sinks, the observation window). Budget allocation (AdaKV) reads
    these scores.
``rerank(kv, obs, scores, budgets) -> [Hkv, S]``
    The ranking whose per-head top ``budgets[h]`` is the kept set, given ``scores = score(kv, obs)``
    and the per-head budgets ``[Hkv]``. The default returns ``scores`` unchanged; CriticalKV's
    two-stage selection depends on the budget and lives here.
``plan(kv, obs, budget) -> KeepPlan``
    Uniform budget per head (``budget`` rows each, at most the head's live rows), then :func:`select`.
    AdaKV overrides it.
``compress(kv, obs, budget) -> KeepPlan``
    :meth:`plan` followed by :func:`apply_keep`, in place.

A plan is plain data (:class:`KeepPlan`: per-head kept slot indices, sorted by position), so it can be
computed here and written elsewhere (the engine writes llama.cpp cells from it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlocal.reference.cache import LayerKV


@dataclass
class Observation:
    """What a scorer may read besides the cache, for one layer.

    Parameters
    ----------
    q : torch.Tensor, optional
        ``[Hq, w, d]`` observation-window queries after RoPE (the last prompt tokens, or a question probe).
    q_pos : torch.Tensor, optional
        ``[w]`` int64 positions of those queries; a query at ``p`` sees rows with ``pos <= p``.
    wo : torch.Tensor, optional
        ``[D, Hq*d]`` the layer's output projection in HF layout (``o_proj.weight``); CriticalKV only.
    """

    q: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    wo: torch.Tensor | None = None


@dataclass
class KeepPlan:
    """Which slots every KV head keeps.

    ``keep[h]`` is a 1-D int64 tensor of slot indices of head ``h`` sorted by position (empty rows, if a
    budget exceeds the live rows, last); ``budgets[h] == len(keep[h])``.
    """

    keep: list[torch.Tensor]
    budgets: torch.Tensor  # [Hkv] int64


def window_attention(kv: LayerKV, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Softmax attention probabilities of the window queries over every row, in float32.

    q: [Hq, w, d] after RoPE; q_pos: [w]. Returns ``[Hq, w, S]``. Same maths as
    :func:`~kvlocal.reference.cache.attend`: logits ``q·k/sqrt(d) + bias`` (``log(count)`` for merged
    slots, ``-inf`` for empty rows), a query at ``p`` sees rows with ``0 <= pos <= p``, query head ``h``
    reads KV head ``h // G``. fp32 on purpose: kvpress moved scores to fp32 after seeing bf16 tie most
    Knorm scores on Qwen3-8B. A query that sees no row gets all-zero probabilities instead of NaN.
    """
    hq, _, d = q.shape
    group = hq // kv.k.shape[0]
    k = kv.k.to(torch.float32).repeat_interleave(group, dim=0)  # [Hq, S, d]
    bias = kv.bias.to(torch.float32).repeat_interleave(group, dim=0)  # [Hq, S]
    pos = kv.pos.repeat_interleave(group, dim=0)  # [Hq, S]
    logits = q.to(torch.float32) @ k.transpose(-1, -2) / math.sqrt(d) + bias[:, None, :]  # [Hq, w, S]
    visible = (pos[:, None, :] <= q_pos.to(torch.int64)[None, :, None]) & (pos[:, None, :] >= 0)
    logits = logits.masked_fill(~visible, -math.inf)
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def live_mask(kv: LayerKV) -> torch.Tensor:
    """[Hkv, S] True where the row holds a token (``pos >= 0`` and a finite bias)."""
    return (kv.pos >= 0) & torch.isfinite(kv.bias)


def protected_mask(kv: LayerKV, n_sink: int, q_pos: torch.Tensor | None = None) -> torch.Tensor:
    """[Hkv, S] True for live rows that no method may evict or merge.

    Sinks are the rows at positions ``< n_sink`` (StreamingLLM's attention sinks). The window is every
    row at or after the first window query (``pos >= min(q_pos)``): the window's own tokens, and
    anything newer, which the window could not judge.
    """
    mask = kv.pos < n_sink
    if q_pos is not None and q_pos.numel() > 0:
        mask = mask | (kv.pos >= int(q_pos.min()))
    return mask & live_mask(kv)


def order_desc(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Indices that sort ``scores`` descending along the last axis, ties broken by the larger position.

    torch.topk's order among equal scores is unspecified; protected rows all score ``+inf``, so the
    tie-break decides which of them survive a budget smaller than their number: the most recent.
    """
    by_pos = torch.argsort(pos, dim=-1, descending=True, stable=True)
    s = torch.gather(scores, -1, by_pos)
    by_score = torch.argsort(s, dim=-1, descending=True, stable=True)
    return torch.gather(by_pos, -1, by_score)


def sort_by_pos(idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Reorder slot indices ``idx`` of one head by position, empty rows (pos -1) last."""
    key = pos[idx].clone()
    key[key < 0] = torch.iinfo(torch.int64).max
    return idx[torch.argsort(key, stable=True)]


def select(scores: torch.Tensor, budgets: torch.Tensor | int, pos: torch.Tensor) -> KeepPlan:
    """Per-head top-k. scores: [Hkv, S]; budgets: [Hkv] or one int; pos: [Hkv, S].

    Head ``h`` keeps its ``budgets[h]`` highest-scored slots (clipped to its live rows, ``pos >= 0``:
    an empty row is never kept); ties go to the later position. The kept indices are returned sorted
    by position.
    """
    hkv, s = scores.shape
    if isinstance(budgets, int):
        budgets = torch.full((hkv,), budgets, dtype=torch.int64)
    budgets = torch.minimum(budgets.to(torch.int64).clamp(min=0), (pos >= 0).sum(dim=-1))
    order = order_desc(scores, pos)  # [Hkv, S]
    keep = [sort_by_pos(order[h, : int(budgets[h])], pos[h]) for h in range(hkv)]
    return KeepPlan(keep=keep, budgets=budgets)


def gather_rows(kv: LayerKV, rows: list[torch.Tensor]) -> None:
    """Rebuild ``kv`` in place so head ``h`` holds the rows ``rows[h]`` in that order.

    The slot count becomes ``max_h len(rows[h])``; shorter heads are padded with a copy of some row that
    is then cleared (``-inf`` bias, pos -1, count 0), so they attend over exactly their own rows.
    """
    n = max((len(r) for r in rows), default=0)
    idx = torch.zeros(len(rows), n, dtype=torch.int64)
    pad = torch.zeros(len(rows), n, dtype=torch.bool)
    for h, r in enumerate(rows):
        idx[h, : len(r)] = r
        pad[h, len(r) :] = True
    kv.gather(idx)
    kv.clear(pad)


def apply_keep(kv: LayerKV, plan: KeepPlan) -> None:
    """Write a :class:`KeepPlan` into ``kv`` (in place): gather the kept rows, clear the surplus."""
    gather_rows(kv, plan.keep)


class Scorer:
    """Base class of the eviction scorers; the contract is in the module docstring."""

    def score(self, kv: LayerKV, obs: Observation) -> torch.Tensor:
        raise NotImplementedError

    def rerank(self, kv: LayerKV, obs: Observation, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        return scores

    def plan(self, kv: LayerKV, obs: Observation, budget: int) -> KeepPlan:
        budgets = live_mask(kv).sum(dim=1).clamp(max=max(budget, 0))
        return select(self.rerank(kv, obs, self.score(kv, obs), budgets), budgets, kv.pos)

    def compress(self, kv: LayerKV, obs: Observation, budget: int) -> KeepPlan:
        plan = self.plan(kv, obs, budget)
        apply_keep(kv, plan)
        return plan
