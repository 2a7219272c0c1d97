"""CriticalKV: two-stage selection, attention first, then attention x projected value norm."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvlocal.reference.cache import LayerKV
from kvlocal.reference.compress.base import Observation, Scorer, order_desc
from kvlocal.reference.compress.snapkv import SnapKV


def projected_value_norms(v: torch.Tensor, wo: torch.Tensor, n_head: int, p: int = 1) -> torch.Tensor:
    """``||v · W_O^h||_p`` per row (p = 1, the paper's, or 2), averaged over the query heads of each GQA group.

    v: [Hkv, S, d] (the cache's values; mean values for merged slots); wo: [D, Hq*d], HF ``o_proj.weight``.
    ``W_O^h = wo[:, h*d:(h+1)*d].T`` ([d, D]) is the slice of *query* head ``h``, which reads KV head
    ``h // G``. The norm over the hidden dimension D, then mean over the G query heads. Returns [Hkv, S], fp32.
    One head at a time so that no [Hq, S, D] tensor is built (as in kvpress).
    """
    hkv, s, d = v.shape
    group = n_head // hkv
    wo = wo.to(torch.float32)
    norms = torch.zeros(n_head, s)
    for h in range(n_head):
        projected = v[h // group].to(torch.float32) @ wo[:, h * d : (h + 1) * d].T
        norms[h] = torch.linalg.vector_norm(projected, ord=p, dim=-1)
    return norms.view(hkv, group, s).mean(dim=1)


def two_stage(scores: torch.Tensor, vnorm: torch.Tensor, budgets: torch.Tensor, pos: torch.Tensor,
              first_stage_ratio: float = 0.5, epsilon: float = 1e-4) -> torch.Tensor:
    """Ranking whose per-head top ``budgets[h]`` is CriticalKV's kept set (docs/algorithms.md).

    Stage 1 keeps the top ``int(first_stage_ratio * b)`` rows by the attention score ``A`` alone; stage
    2 fills the rest of ``b`` by ``(A + epsilon) * vnorm``. Returned as the kvpress trick: the critical
    score with the stage-1 rows set to ``+inf``, so the ordinary top-b is stage 1 ∪ stage 2. Rows with
    ``A = +inf`` (protected) stay ``+inf`` and rows with ``A = -inf`` (empty) stay ``-inf`` whatever
    their norm. scores, vnorm, pos: [Hkv, S]; budgets: [Hkv].
    """
    crit = (scores + epsilon) * vnorm
    crit = torch.where(torch.isinf(scores), scores, crit)
    order = order_desc(scores, pos)
    for h in range(scores.shape[0]):
        n_first = int(first_stage_ratio * int(budgets[h]))
        crit[h, order[h, :n_first]] = math.inf
    return crit


@dataclass
class CriticalKV(Scorer):
    """Wraps an attention scorer; keeps half the budget by attention, the rest by attention x ``||v W_O||``.

    Based on https://arxiv.org/abs/2502.03805 (CriticalKV), as kvpress's ``CriticalKVPress``. The
    budget-free :meth:`score` is the inner press's score: budget allocation (AdaKV) uses the base scores,
    as kvpress's ``CriticalAdaKVPress`` does; only the selection (:meth:`rerank`) is two-stage. Nothing
    is normalised. Merged slots use their mean value: the attention ``A`` of a merged slot already
    carries its ``log(count)`` bias, so ``A · v̄`` is its true contribution to the output (the summed
    value would count the members twice).

    Parameters
    ----------
    press : Scorer
        The attention scorer (SnapKV by default). Needs ``obs.wo`` and ``obs.q`` (for the head count).
    epsilon : float
        Added to the attention score before multiplying by the norm (paper footnote, kvpress default).
    first_stage_ratio : float
        Fraction ``alpha`` of each head's budget chosen by attention alone (stage 1); ``int(alpha*b)``
        rows. kvpress floors the stage-1 count at 1; here ``b = 1`` gives a pure stage 2.
    value_norm : str
        ``"l1"`` over D (the paper's, the default) or ``"l2"`` (the paper's ablation: similar gains).
    """

    press: Scorer = field(default_factory=SnapKV)
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5
    value_norm: str = "l1"

    def score(self, kv: LayerKV, obs: Observation) -> torch.Tensor:
        return self.press.score(kv, obs)

    def rerank(self, kv: LayerKV, obs: Observation, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        if obs.wo is None or obs.q is None:
            raise ValueError("CriticalKV needs obs.wo (o_proj weight [D, Hq*d]) and obs.q (for Hq)")
        scores = self.press.rerank(kv, obs, scores, budgets)
        vnorm = projected_value_norms(kv.v, obs.wo, obs.q.shape[0], {"l1": 1, "l2": 2}[self.value_norm])
        return two_stage(scores, vnorm, budgets, kv.pos, self.first_stage_ratio, self.epsilon)


METHODS = {"criticalkv": lambda n_sink: CriticalKV(SnapKV(n_sink=n_sink))}  # the twin of kvlocal.compress's
