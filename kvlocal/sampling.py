"""Next-token choice from a logit vector: greedy, or temperature with top-k / top-p."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Sampler:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None

    def __post_init__(self):
        self._rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature <= 0:
            return int(np.argmax(logits))
        k = min(self.top_k, logits.shape[-1]) if self.top_k > 0 else logits.shape[-1]
        idx = np.argpartition(-logits, k - 1)[:k]
        idx = idx[np.argsort(-logits[idx])]
        z = logits[idx].astype(np.float64) / self.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
        p = p[:keep] / p[:keep].sum()
        return int(idx[self._rng.choice(keep, p=p)])
