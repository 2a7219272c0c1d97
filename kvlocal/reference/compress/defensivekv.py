"""DefensiveKV: the worst observed attention instead of the mean, with a per-head prior, times ||v W_O||_1."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlocal.reference.cache import LayerKV
from kvlocal.reference.compress.base import (
    Observation,
    Scorer,
    live_mask,
    order_desc,
    protected_mask,
    window_attention,
)
from kvlocal.reference.compress.criticalkv import projected_value_norms
from kvlocal.reference.compress.snapkv import pool1d


def defensive_aggregation(obs_scores: torch.Tensor, prior_correction: bool = True) -> torch.Tensor:
    """The paper's Algorithm 1 on one head's importance matrix ``[m, n]`` (m observations of n entries).

    Worst-case risk estimation ``R~_i = max_j I[j, i]``, then the adaptive prior-risk correction
    ``R_i = max(R~_i, mean_i' R~_i')``. Returns ``[n]``.
    """
    worst = obs_scores.amax(dim=0)
    return torch.maximum(worst, worst.mean()) if prior_correction else worst


def mass_first_stage(mean_attn: torch.Tensor, prefix: torch.Tensor, protected: torch.Tensor, room: int,
                     pos: torch.Tensor, mass: float) -> torch.Tensor:
    """One head's stage-1 rows ``[S]`` bool. The ``prefix`` rows (before the window, sinks included) in
    decreasing mean attention (ties to the later position) while their cumulative share of the prefix's
    attention stays below ``mass``; of those, the first ``room`` that are not ``protected``."""
    first = torch.zeros_like(prefix)
    rows = torch.nonzero(prefix).flatten()
    m = mean_attn[rows]
    total = m.sum()
    if rows.numel() == 0 or room <= 0 or mass <= 0 or not total > 0:
        return first
    order = order_desc(m[None], pos[rows][None])[0]
    share = torch.cumsum(m[order], dim=0) / total
    lead = rows[order[: int((share < mass).sum())]]
    first[lead[~protected[lead]][:room]] = True
    return first


@dataclass
class DefensiveKV(Scorer):
    """CriticalKV's scoring with the mean over the window replaced by defensive aggregation.

    Based on https://arxiv.org/abs/2510.13334 (Feng et al., ICLR 2026), as the official
    ``EfficientDefensiveKVPress`` but with a uniform budget per head (docs/algorithms.md). For KV head
    ``g``: every window query's softmax (fp32, slot bias, causal by position) over the rows, restricted
    to the live rows before the window, in position order, pooled per query and rescaled to that query's
    mass on those rows; the worst case over the window and the ``G`` query heads of the group, raised to
    the head's mean worst case (:func:`defensive_aggregation`). Sinks and window rows ``+inf``, empty rows
    ``-inf``. Selection: stage 1 by mean window attention up to ``first_stage_mass`` of the prefix's
    (:func:`mass_first_stage`), stage 2 by ``R * ||v W_O||_1`` (:func:`projected_value_norms`).

    Parameters
    ----------
    window_size, kernel_size, pooling :
        Observation queries (the last ones of ``obs.q``), odd pooling kernel, ``"avg"`` or ``"max"``.
    first_stage_mass : float
        Share of the mean window attention stage 1 covers; 0 disables it.
    prior_correction : bool
        The adaptive prior-risk correction (off: the paper's worst-case-only ablation).
    n_sink : int
        Positions ``0 .. n_sink-1`` are always kept.
    """

    window_size: int = 32
    kernel_size: int = 5
    pooling: str = "avg"
    first_stage_mass: float = 0.9
    prior_correction: bool = True
    n_sink: int = 4

    def _window(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor]:
        if obs.q is None or obs.q_pos is None:
            raise ValueError("DefensiveKV needs the observation queries obs.q and obs.q_pos")
        return obs.q[:, -self.window_size :], obs.q_pos[-self.window_size :]

    def score(self, kv: LayerKV, obs: Observation) -> torch.Tensor:
        q, q_pos = self._window(obs)
        hkv, s = kv.pos.shape
        group = q.shape[0] // hkv
        attn = window_attention(kv, q, q_pos)  # [Hq, w, S]
        live = live_mask(kv)
        window = live & (kv.pos >= int(q_pos.min()))
        scores = torch.full((hkv, s), -math.inf)
        for g in range(hkv):
            rows = torch.nonzero(live[g] & ~window[g]).flatten()
            rows = rows[torch.argsort(kv.pos[g, rows], stable=True)]
            if rows.numel() == 0:
                continue
            a = attn[g * group : (g + 1) * group][:, :, rows].reshape(-1, rows.numel())  # [G*w, m]
            p = pool1d(a, self.kernel_size, self.pooling)
            before, after = a.sum(dim=-1, keepdim=True), p.sum(dim=-1, keepdim=True)
            p = torch.where(after > 0, p / after.clamp(min=torch.finfo(torch.float32).tiny), 0.0) * before
            scores[g, rows] = defensive_aggregation(p, self.prior_correction)
        return scores.masked_fill(protected_mask(kv, self.n_sink, q_pos), math.inf)

    def rerank(self, kv: LayerKV, obs: Observation, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        if obs.wo is None or obs.q is None:
            raise ValueError("DefensiveKV needs obs.wo (o_proj weight [D, Hq*d]) and obs.q (for Hq)")
        q, q_pos = self._window(obs)
        hkv, s = scores.shape
        mean_attn = window_attention(kv, q, q_pos).mean(dim=1).view(hkv, -1, s).mean(dim=1)  # [Hkv, S]
        vnorm = projected_value_norms(kv.v, obs.wo, obs.q.shape[0])
        candidates = torch.isfinite(scores)
        protected = torch.isposinf(scores)
        prefix = live_mask(kv) & (kv.pos < int(q_pos.min()))
        crit = torch.where(candidates, scores * vnorm, scores)
        for g in range(hkv):
            room = int(budgets[g]) - int(protected[g].sum())
            first = mass_first_stage(mean_attn[g], prefix[g], protected[g], room, kv.pos[g], self.first_stage_mass)
            crit[g, first] = math.inf
        return crit


METHODS = {"defensivekv": lambda n_sink: DefensiveKV(n_sink=n_sink)}  # the twin of kvlocal.compress's
