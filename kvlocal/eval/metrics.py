"""How far one model's logits are from another's over the same tokens: the figures ``kvlocal verify``
(llama.cpp against the PyTorch reference) and ``kvlocal eval`` (a compressed cache against the full
one) report."""

from __future__ import annotations

import numpy as np

# top-1 agreement is also reported over the positions where llama.cpp's best token leads its runner-up
# by at least this many logits: quantized arithmetic flips near-ties, a real bug flips clear choices
DECISIVE_MARGIN = 1.0


def compare_logits(ll: np.ndarray, ref: np.ndarray, rows: int = 64) -> dict:
    """Metrics of reference logits against llama.cpp's, both [T, V]; float64, ``rows`` positions at a time
    (a 262K vocabulary in float64 is 2 MB a position, and the metrics need several such arrays)."""
    max_diff, sum_diff, kl, agree, decisive = 0.0, 0.0, [], [], []
    for r0 in range(0, ll.shape[0], rows):
        a, b = ll[r0 : r0 + rows].astype(np.float64), ref[r0 : r0 + rows].astype(np.float64)
        diff = np.abs(a - b)
        max_diff, sum_diff = max(max_diff, float(diff.max())), sum_diff + float(diff.sum())
        lp_ll, lp_ref = a - _logsumexp(a), b - _logsumexp(b)
        kl.append((np.exp(lp_ll) * (lp_ll - lp_ref)).sum(-1))  # [rows] KL(llama.cpp ‖ reference)
        agree.append(a.argmax(-1) == b.argmax(-1))
        top2 = np.partition(a, -2, axis=-1)[:, -2:]
        decisive.append(top2[:, 1] - top2[:, 0] >= DECISIVE_MARGIN)
    kl, agree, decisive = np.concatenate(kl), np.concatenate(agree), np.concatenate(decisive)
    return {
        "max_abs_diff": max_diff,
        "mean_abs_diff": sum_diff / ll.size,
        "top1_agreement": float(agree.mean()),
        "decisive_positions": int(decisive.sum()),
        "decisive_top1_agreement": float(agree[decisive].mean()) if decisive.any() else 1.0,
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
    }


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(-1, keepdims=True))
