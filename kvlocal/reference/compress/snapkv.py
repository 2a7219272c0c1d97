"""SnapKV: score cached entries by the attention they get from an observation window."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlocal.reference.cache import LayerKV
from kvlocal.reference.compress.base import Observation, Scorer, live_mask, protected_mask, window_attention


def pool1d(x: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Stride-1, same-length 1-D pooling along the last axis of ``x`` [N, m].

    ``max`` pads with -inf (torch max_pool1d); ``avg`` pads with zeros and divides by the full kernel
    (torch avg_pool1d, ``count_include_pad=True``), so the two ends are damped as in SnapKV/kvpress.
    """
    if kernel_size % 2 != 1:
        raise ValueError(f"kernel_size must be odd, got {kernel_size}")
    if x.shape[-1] == 0 or kernel_size == 1:
        return x
    pad = kernel_size // 2
    if pooling == "max":
        return F.max_pool1d(x[:, None, :], kernel_size, stride=1, padding=pad)[:, 0, :]
    if pooling == "avg":
        return F.avg_pool1d(x[:, None, :], kernel_size, stride=1, padding=pad, count_include_pad=True)[:, 0, :]
    raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")


@dataclass
class SnapKV(Scorer):
    """Window-attention vote, pooled along positions, averaged over each GQA group.

    Based on https://arxiv.org/abs/2404.14469 (SnapKV), as in kvpress's ``SnapKVPress`` with the
    AdaKV-repo / SnapKV-LongBench defaults (window 32, kernel 7, max pooling).

    For every query head: softmax (fp32) of the last ``window_size`` observation queries over all rows
    (slot bias and causality respected), mean over the window, restricted to rows before the window,
    pooled along the rows *in position order* (rows of a head may be stored in any order), then averaged
    over the ``G`` query heads of each KV head. Pooling comes before the group mean, as in kvpress (the
    AdaKV repo reduces the group first; see FasterDecoding/SnapKV#22 for the GQA discussion).
    Window rows (``pos >= min(q_pos)``) and the first ``n_sink`` positions score ``+inf``; empty rows
    ``-inf``. Sinks take part in the pooling like any other row, so their neighbours inherit their
    (usually large) attention under max pooling, exactly as in SnapKV.

    Parameters
    ----------
    window_size : int
        Number of observation queries used (the last ones of ``obs.q``; all if fewer are given).
    kernel_size : int
        Odd pooling kernel; 1 disables pooling.
    pooling : str
        ``"max"`` or ``"avg"`` (zero padding counted, like torch ``avg_pool1d``).
    n_sink : int
        Positions ``0 .. n_sink-1`` are always kept.
    """

    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    n_sink: int = 4

    def score(self, kv: LayerKV, obs: Observation) -> torch.Tensor:
        if obs.q is None or obs.q_pos is None:
            raise ValueError("SnapKV needs the observation queries obs.q and obs.q_pos")
        q, q_pos = obs.q[:, -self.window_size :], obs.q_pos[-self.window_size :]
        hkv, s = kv.pos.shape
        group = q.shape[0] // hkv
        votes = window_attention(kv, q, q_pos).mean(dim=1)  # [Hq, S]

        live = live_mask(kv)
        window = live & (kv.pos >= int(q_pos.min()))
        scores = torch.full((hkv, s), -math.inf)
        for g in range(hkv):
            rows = torch.nonzero(live[g] & ~window[g]).flatten()
            rows = rows[torch.argsort(kv.pos[g, rows], stable=True)]  # prefix rows in position order
            pooled = pool1d(votes[g * group : (g + 1) * group, rows], self.kernel_size, self.pooling)  # [G, m]
            scores[g, rows] = pooled.mean(dim=0)
        return scores.masked_fill(protected_mask(kv, self.n_sink, q_pos), math.inf)


METHODS = {"snapkv": lambda n_sink: SnapKV(n_sink=n_sink)}  # the twin of kvlocal.compress's, by name
