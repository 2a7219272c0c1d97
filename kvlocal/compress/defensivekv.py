"""DefensiveKV: the worst observed attention instead of the mean, with a per-head prior, times ||v W_O||_1."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlocal import kernels
from kvlocal.compress.base import LayerInputs, Scorer, check_window_params, order_by_pos, window_votes
from kvlocal.compress.criticalkv import projected_value_norms
from kvlocal.compress.methods import Method
from kvlocal.compress.numpy_kernels import window_attention


@dataclass
class DefensiveKV(Scorer):
    """CriticalKV's scoring with the mean over the window replaced by *defensive aggregation*.

    Based on https://arxiv.org/abs/2510.13334 (Feng et al., "Taming the Fragility of KV Cache Eviction
    in LLM Inference", ICLR 2026; code: FFY0/DefensiveKV, ``EfficientDefensiveKVPress``). Mean
    aggregation trusts that an entry's importance is stable over time; when it is not, the mean hides
    the steps at which an evicted entry would have mattered. Defensive aggregation (the paper's
    Algorithm 1) bounds that worst case instead, in two linear-time steps. Per KV head ``g`` with the
    query heads ``h`` of its group, the window queries ``j`` and the cells ``i`` outside the window
    (live, sinks included), in position order:

    1. ``a[h,j,i]``: softmax of query ``j`` over all cells (fp32, causal by position, slot bias);
       ``p[h,j,:] = pool(a[h,j,:]) * sum_i a[h,j,i] / sum_i pool(a[h,j,:])_i`` — SnapKV's pooling
       applied to every query (Algorithm 2 pools before aggregating), each query's row rescaled to
       the attention mass it gave these cells before pooling (the official code; avg pooling with
       zero padding would otherwise lose mass at the ends).
    2. Worst-case risk estimation: ``R~[g,i] = max_{h in g, j} p[h,j,i]`` (over the window's queries
       and the GQA group).
    3. Adaptive prior-risk correction: ``R[g,i] = max(R~[g,i], mean_i' R~[g,i'])`` — an entry seen less
       than the head's average worst case is treated as under-observed and gets the head's prior
       (Laplace-smoothing-like; no hyperparameter). ``prior_correction=False`` is the paper's ablation.

    ``score`` returns ``R`` (``+inf`` protected, ``-inf`` empty). Selection (:meth:`rerank`) follows
    CriticalKV's two stages as the official code runs them (Algorithm 2 multiplies by CriticalKV's
    projected value norm): stage 1 takes the cells before the window (sinks included) in decreasing
    *mean* window attention (``mean_{h in g, j} a[h,j,i]``, unpooled) while their cumulative share of
    the head's attention on those cells stays below ``first_stage_mass`` (0.9); the sinks among them
    are kept anyway, the others become stage 1, at most the budget left after the protected cells.
    Stage 2 fills the rest of the budget by ``R[g,i] * ||v_i W_O||_1`` (L1 over D, mean over the G
    query heads, :func:`~kvlocal.compress.criticalkv.projected_value_norms`; no epsilon: the prior
    keeps ``R > 0``). Sinks and window cells score ``+inf`` as in SnapKV.

    Not done (docs/algorithms.md): budgets are uniform per head. The official DefensiveKV selects a
    layer's ``Hkv * b`` cells by a flattened top-k over its heads (AdaKV without safeguard), with the
    value norms divided per token by their sum over the KV heads (for the comparison across heads; it
    also reorders a head's own cells, but here a cell's heads may hold different tokens);
    Layer-DefensiveKV adds a flattened top-k over all layers, which the per-layer Plan machinery does
    not have. The official window-mass correction of the stage-1 threshold (``0.9 - window_bias``,
    computed there on the last prefix tokens) is left out.

    Parameters
    ----------
    window_size : int
        Observation queries used (the last ones of ``layer.q``); 32 in the paper.
    kernel_size : int
        Odd pooling kernel (official code: 5); 1 disables pooling.
    pooling : str
        ``"avg"`` (official code; zero padding counted, like torch ``avg_pool1d``) or ``"max"``.
    first_stage_mass : float
        Stage 1's share of the mean window attention, in [0, 1] (official code: 0.9); 0: stage 2 only.
    prior_correction : bool
        Apply the adaptive prior-risk correction (step 3).
    """

    window_size: int = 32
    kernel_size: int = 5
    pooling: str = "avg"
    first_stage_mass: float = 0.9
    prior_correction: bool = True
    needs_wo = True  # not a field: stage 2 reads W_O

    def __post_init__(self) -> None:
        check_window_params(self.window_size, self.kernel_size, self.pooling)
        if not 0.0 <= self.first_stage_mass <= 1.0:
            raise ValueError(f"first_stage_mass must be in [0, 1], got {self.first_stage_mass}")

    def _window(self, layer: LayerInputs) -> tuple[np.ndarray, np.ndarray]:
        if layer.q is None:
            raise ValueError(f"layer {layer.layer}: DefensiveKV needs the observation queries q and q_pos")
        return layer.q[:, -self.window_size :], layer.q_pos[-self.window_size :]

    def keep(self, layer: LayerInputs, budget: int) -> np.ndarray:
        # a maximum over the window's queries: the keys on the host (the device's scores are the mean)
        return super().keep(layer.loaded(), budget)

    def score(self, layer: LayerInputs) -> np.ndarray:
        q, q_pos = self._window(layer)
        hkv, n = layer.n_kv, layer.n
        group = q.shape[0] // hkv
        attn = window_attention(q, q_pos, layer.k, layer.pos, layer.bias)  # [Hq, w, n], cell order
        outside = layer.live & ~layer.window_mask(q_pos)
        order = order_by_pos(layer.pos, hkv)
        scores = np.full((hkv, n), -np.inf, dtype=np.float32)
        for g in range(hkv):
            rows = order[g][outside[g, order[g]]]  # live cells before the window, in position order
            if not rows.size:
                continue
            a = attn[g * group : (g + 1) * group, :, rows].reshape(-1, rows.size)  # [G*w, m]
            p = kernels.pool1d(a, self.kernel_size, self.pooling)
            mass, pooled = a.sum(axis=1, keepdims=True), p.sum(axis=1, keepdims=True)
            p = np.divide(p, pooled, out=np.zeros_like(p), where=pooled > 0) * mass
            risk = p.max(axis=0)  # worst case over the window's queries and the group's heads
            if self.prior_correction:
                risk = np.maximum(risk, risk.mean(dtype=np.float32))
            scores[g, rows] = risk
        scores[layer.protected(q_pos)] = np.inf
        return scores

    def rerank(self, layer: LayerInputs, scores: np.ndarray, budgets: np.ndarray) -> np.ndarray:
        if layer.q is None:
            raise ValueError(f"layer {layer.layer}: DefensiveKV needs the observation queries q")
        q, q_pos = self._window(layer)
        hkv, n = scores.shape
        scores = np.asarray(scores, dtype=np.float32)
        candidates = np.isfinite(scores)  # live and not protected
        n_protected = np.isposinf(scores).sum(axis=1)
        first = np.zeros((hkv, n), dtype=bool)
        if self.first_stage_mass > 0:
            # stage 1 ranks the cells before the window (sinks included, as the official prefix) by their
            # plain mean attention over the window queries and the group's heads (unpooled)
            mean_attn = window_votes(q, q_pos, layer.k, layer.pos, layer.bias).reshape(hkv, -1, n).mean(axis=1)
            prefix = layer.live & ~layer.window_mask(q_pos)
            for g in range(hkv):
                rows = np.flatnonzero(prefix[g])
                room = max(0, int(budgets[g]) - int(n_protected[g]))
                m = mean_attn[g, rows]
                total = m.sum(dtype=np.float32)
                if not rows.size or room == 0 or not total > 0:
                    continue
                by = np.lexsort((-layer.pos_h[g, rows], -m))  # most attention first, ties to the later position
                share = np.cumsum(m[by], dtype=np.float32) / total
                lead = rows[by[: int(np.sum(share < np.float32(self.first_stage_mass)))]]
                first[g, lead[candidates[g, lead]][:room]] = True  # the sinks among them are kept anyway
        ranked = candidates & ~first  # the cells stage 2 ranks: the only norms needed
        vnorm = layer.vnorm if layer.vnorm is not None else np.full((hkv, n), np.nan, dtype=np.float32)
        todo = [np.flatnonzero(ranked[g] & np.isnan(vnorm[g])) for g in range(hkv)]
        if any(len(t) for t in todo):  # norms the engine does not carry (the native backend computes them all)
            if layer.wo is None:
                raise ValueError(f"layer {layer.layer}: DefensiveKV needs wo (o_proj weight [D, Hq*d]) or every vnorm")
            for g, norms in enumerate(projected_value_norms(layer.v, layer.wo, layer.n_head, todo)):
                vnorm[g, todo[g]] = norms
        crit = scores.copy()
        crit[ranked] = scores[ranked] * vnorm[ranked]
        crit[first] = np.inf
        return crit


METHODS = {"defensivekv": Method(DefensiveKV, rank=4)}
