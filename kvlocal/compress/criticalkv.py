"""CriticalKV: two-stage selection, attention first, then attention x projected value norm."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvlocal.compress.base import LayerInputs, Scorer, top_cells, vnorm_l1
from kvlocal.compress.snapkv import SnapKV, fused_keep


def projected_value_norms(v: np.ndarray, wo: np.ndarray, n_head: int,
                          rows: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """``||v · W_O^h||_1`` per cell, averaged over the query heads of each GQA group.

    v: [Hkv, n, d] values; wo: [D, Hq*d] (``o_proj.weight``, HF layout). Query head ``h`` reads KV head
    ``h // G`` and its slice is ``W_O^h = wo[:, h*d:(h+1)*d].T`` ([d, D]); L1 over D, then mean over the
    G query heads (:func:`kvlocal.compress.kernels.vnorm_l1`). ``rows[g]``: the cells of KV head ``g`` to compute
    (default all). Returns one float32 array per KV head, ``[len(rows[g])]`` (or ``[n]``).
    """
    hkv = v.shape[0]
    group = n_head // hkv
    wo = np.ascontiguousarray(wo, dtype=np.float32)
    return [vnorm_l1(v[g], wo, g * group, group, None if rows is None else rows[g]) for g in range(hkv)]


@dataclass
class CriticalKV(Scorer):
    """Wraps an attention scorer; keeps part of the budget by attention, the rest by attention x ``||v W_O||_1``.

    Based on https://arxiv.org/abs/2502.03805 (CriticalKV), as kvpress's ``CriticalKVPress``. Per KV head
    with budget ``b``: stage 1 keeps the top ``int(first_stage_ratio * b)`` cells by the wrapped scorer's
    score ``A`` (ties to the later position); stage 2 fills the rest by ``(A + epsilon) * ||v W_O^h||_1``
    (L1 over D, mean over the G query heads, :func:`projected_value_norms`). Written, as in kvpress, as a
    ranking (:meth:`rerank`): the critical score with the stage-1 cells set to ``+inf``, whose ordinary
    top-b is stage 1 ∪ stage 2. Protected cells (``A = +inf``) stay ``+inf`` and count toward stage 1, as
    in kvpress. The budget-free :meth:`score` is the wrapped scorer's (budget allocation uses the base
    scores, as kvpress's ``CriticalAdaKVPress``). Nothing is normalised. Norms are computed only for the
    cells stage 2 ranks (not protected, not taken by stage 1) and not already in ``layer.vnorm``.

    Parameters
    ----------
    press : Scorer
        The attention scorer (SnapKV by default).
    epsilon : float
        Added to the attention score before multiplying by the norm (paper footnote, kvpress default).
    first_stage_ratio : float
        Fraction ``alpha`` of each head's budget chosen by attention alone; ``int(alpha*b)`` cells.
        kvpress floors the stage-1 count at 1; here ``b = 1`` gives a pure stage 2.
    """

    press: Scorer = field(default_factory=SnapKV)
    needs_wo = True  # not a field: the value-norm stage reads W_O
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def score(self, layer: LayerInputs) -> np.ndarray:
        return self.press.score(layer)

    def rerank(self, layer: LayerInputs, scores: np.ndarray, budgets: np.ndarray) -> np.ndarray:
        if (layer.wo is None and layer.v is not None) or layer.q is None:
            raise ValueError(f"layer {layer.layer}: CriticalKV needs wo (o_proj weight [D, Hq*d]) and q (for Hq)")
        scores = np.asarray(self.press.rerank(layer, scores, budgets), dtype=np.float32)
        crit = scores.copy()  # +inf / -inf cells keep their score whatever their norm
        first = np.zeros(scores.shape, dtype=bool)  # stage 1: top int(alpha * b) by the score alone
        n_first = np.array([int(self.first_stage_ratio * int(b)) for b in budgets])
        for k in np.unique(n_first):  # one top-k for all heads that share a budget
            heads = np.flatnonzero(n_first == k)
            pos = layer.pos if layer.pos.ndim == 1 else layer.pos[heads]
            taken = np.zeros((len(heads), scores.shape[1]), dtype=bool)
            np.put_along_axis(taken, top_cells(scores[heads], int(k), pos), True, axis=1)
            first[heads] = taken
        ranked = ~first & np.isfinite(scores)  # the cells stage 2 ranks: the only norms needed
        vnorm = layer.vnorm if layer.vnorm is not None else np.full(scores.shape, np.nan, dtype=np.float32)
        todo = [np.flatnonzero(ranked[g] & np.isnan(vnorm[g])) for g in range(layer.n_kv)]
        if any(len(t) for t in todo):
            if layer.v is None:
                raise ValueError(f"layer {layer.layer}: CriticalKV without v needs the norms of every cell it ranks")
            for g, norms in enumerate(projected_value_norms(layer.v, layer.wo, layer.n_head, todo)):
                vnorm[g, todo[g]] = norms
        crit[ranked] = (scores[ranked] + np.float32(self.epsilon)) * vnorm[ranked]
        crit[first] = np.inf
        return crit

    def keep(self, layer: LayerInputs, budget: int) -> np.ndarray:
        fused = fused_keep(self.press, layer, budget, critical=self) if type(self.press) is SnapKV else None
        return super().keep(layer, budget) if fused is None else fused
