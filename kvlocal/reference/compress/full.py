"""Full cache: keep every row (the twin of :class:`kvlocal.compress.full.Full`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlocal.reference.cache import LayerKV
from kvlocal.reference.compress.base import KeepPlan, Observation, Scorer, live_mask


@dataclass
class Full(Scorer):
    """Keep everything: every live row scores ``+inf`` (empty rows ``-inf``) and the budget is always the row
    count. No parameters."""

    def score(self, kv: LayerKV, obs: Observation | None = None) -> torch.Tensor:
        return torch.full(kv.pos.shape, math.inf).masked_fill(~live_mask(kv), -math.inf)

    def plan(self, kv: LayerKV, obs: Observation | None, budget: int) -> KeepPlan:
        return super().plan(kv, obs, kv.pos.shape[-1])


METHODS = {"full": lambda n_sink: Full()}
