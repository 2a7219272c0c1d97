"""StreamingLLM: keep the attention sinks and the most recent tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlocal.reference.cache import LayerKV
from kvlocal.reference.compress.base import Observation, Scorer, live_mask


@dataclass
class StreamingLLM(Scorer):
    """Keep the first ``n_sink`` positions and, with the rest of the budget, the most recent rows.

    Based on https://arxiv.org/abs/2309.17453 (StreamingLLM). Positions stay the source positions (keys
    are stored after RoPE), i.e. kvpress's ``StreamingLLMPress`` without ``KeyRerotationPress``; the paper
    re-indexes positions inside the cache instead. The score is the row's position (``+inf`` for sinks,
    ``-inf`` for empty rows), so a merged slot counts as recent as its last member. Needs no observation.

    Parameters
    ----------
    n_sink : int
        Positions ``0 .. n_sink-1`` are always kept.
    """

    n_sink: int = 4

    def score(self, kv: LayerKV, obs: Observation | None = None) -> torch.Tensor:
        live = live_mask(kv)
        scores = kv.pos.to(torch.float32)
        scores = scores.masked_fill(live & (kv.pos < self.n_sink), math.inf)
        return scores.masked_fill(~live, -math.inf)


METHODS = {"streaming": lambda n_sink: StreamingLLM(n_sink=n_sink)}  # the twin of kvlocal.compress's, by name
