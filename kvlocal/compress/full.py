"""Full cache: keep every cell (the baseline every method is compared with)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlocal.compress.base import LayerInputs, Scorer, select
from kvlocal.compress.methods import Method


@dataclass
class Full(Scorer):
    """Keep everything: every live cell scores ``+inf`` (empty rows ``-inf``) and the budget is always ``n``.

    No parameters. Useful as ``--method full`` (same engine path, no eviction) and in tests.
    """

    def score(self, layer: LayerInputs) -> np.ndarray:
        return np.where(layer.live, np.inf, -np.inf).astype(np.float32)

    def keep(self, layer: LayerInputs, budget: int) -> np.ndarray:
        return select(self.score(layer), layer.n, layer.pos, layer.live)


METHODS = {"full": Method(Full, rank=0)}
