"""SnapKV: score cached cells by the attention they get from an observation window."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlocal import kernels
from kvlocal.compress.base import LayerInputs, Scorer, check_window_params, native_scoring, order_by_pos, window_votes
from kvlocal.compress.methods import Method


FUSED = True  # keep() in one kernel call where it can (fused_keep); tools/bench_kernels turns it off to compare


@dataclass
class SnapKV(Scorer):
    """Window-attention vote, pooled along positions, averaged over each GQA group.

    Based on https://arxiv.org/abs/2404.14469 (SnapKV), as kvpress's ``SnapKVPress`` with the AdaKV-repo
    / SnapKV-LongBench defaults (window 32, kernel 7, max pooling).

    For every query head: softmax in fp32 (scale ``1/sqrt(d)``, causal by position) of the last
    ``window_size`` observation queries over all cells, mean over those queries
    (:func:`kvlocal.kernels.window_votes`); restricted to the cells outside the window, pooled along
    the cells *in position order* (cells are stored in any order), then averaged over the ``G`` query
    heads of each KV head. Pooling comes before the group mean, as in kvpress (the AdaKV repo reduces
    the group first; see FasterDecoding/SnapKV#22). Sinks and window cells
    (:meth:`LayerInputs.protected`) score ``+inf``, so protection survives CriticalKV's product
    (kvpress uses ``max+1``). Sinks take part in pooling like any other cell, so under max pooling
    their neighbours inherit their (usually large) attention, as in SnapKV.

    Parameters
    ----------
    window_size : int
        Number of observation queries used (the last ones of ``layer.q``; all if fewer are given).
    kernel_size : int
        Odd pooling kernel; 1 disables pooling.
    pooling : str
        ``"max"`` or ``"avg"`` (zero padding counted, like torch ``avg_pool1d``).
    """

    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        check_window_params(self.window_size, self.kernel_size, self.pooling)

    def score(self, layer: LayerInputs) -> np.ndarray:
        if layer.q is None:
            raise ValueError(f"layer {layer.layer}: SnapKV needs the observation queries q and q_pos")
        q, q_pos = layer.q[:, -self.window_size :], layer.q_pos[-self.window_size :]
        hkv, n = layer.n_kv, layer.n
        group = q.shape[0] // hkv
        if layer.votes is not None:  # computed where K lives (the native backend), over these queries
            votes = layer.votes
        else:
            votes = window_votes(q, q_pos, layer.k, layer.pos, layer.bias)  # [Hq, n], cell order
        outside = layer.live & ~layer.window_mask(q_pos)  # empty rows are not pooled and stay -inf
        order = order_by_pos(layer.pos, hkv)  # [Hkv, n] cells in position order
        scores = np.full((hkv, n), -np.inf, dtype=np.float32)
        for g in range(hkv):
            rows = order[g][outside[g, order[g]]]  # the prefix: live cells before the window, in position order
            if rows.size:
                pooled = kernels.pool1d(votes[g * group : (g + 1) * group, rows], self.kernel_size, self.pooling)
                scores[g, rows] = pooled.mean(axis=0)  # [G, m] -> [m]
        scores[layer.protected(q_pos)] = np.inf
        return scores

    def keep(self, layer: LayerInputs, budget: int) -> np.ndarray:
        fused = fused_keep(self, layer, budget)
        return super().keep(layer, budget) if fused is None else fused


def fused_keep(snap: SnapKV, layer: LayerInputs, budget: int, critical=None) -> np.ndarray | None:
    """``snap.keep`` (or ``critical.keep``, CriticalKV over ``snap``) in one kernel call
    (:func:`kvlocal.kernels.attention_keep`: the same steps, the same kept cells), or None where the
    numpy scorers must run: the generic build (:func:`~kvlocal.compress.base.native_scoring`), grouped rows,
    inputs the scorers refuse (their error), rows that stay on the device without votes."""
    grouped = layer.groups is not None and (layer.groups >= 0).any()
    if (not FUSED or type(snap) is not SnapKV or not native_scoring() or layer.q is None or grouped
            or (layer.k is None and layer.votes is None)
            or (critical is not None and not critical.has_norm_weights(layer) and layer.v is not None)):
        return None
    w = snap.window_size
    vnorm, (wo, p) = None, (None, 1)
    if critical is not None:
        vnorm = layer.vnorm if layer.vnorm is not None else np.full((layer.n_kv, layer.n), np.nan, np.float32)
        wo, p = critical.norm_weights(layer)
    try:
        return kernels.attention_keep(
            layer.votes, None if layer.votes is not None else layer.q[:, -w:], layer.q_pos[-w:], layer.k,
            None if critical is None else layer.v, layer.pos_h, layer.bias, n_sink=layer.n_sink,
            recent=layer.recent, kernel=snap.kernel_size, pooling=snap.pooling, budget=budget,
            wo=wo, vnorm=vnorm, norm_p=p,
            alpha=0.5 if critical is None else critical.first_stage_ratio,
            epsilon=1e-4 if critical is None else critical.epsilon)
    except ValueError as e:
        raise ValueError(f"layer {layer.layer}: {e}") from None


METHODS = {"snapkv": Method(SnapKV, rank=2)}
