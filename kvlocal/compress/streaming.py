"""StreamingLLM: keep the attention sinks and the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlocal.compress.base import LayerInputs, Scorer
from kvlocal.compress.methods import Method


@dataclass
class StreamingLLM(Scorer):
    """Keep the sinks (positions ``< layer.n_sink``) and, with the rest of the budget, the most recent cells.

    Based on https://arxiv.org/abs/2309.17453 (StreamingLLM). Positions stay the source positions (keys
    are stored after RoPE), i.e. kvpress's ``StreamingLLMPress`` without ``KeyRerotationPress``; the paper
    re-indexes positions inside the cache instead. The score is the cell's position, ``+inf`` for sinks;
    the window needs no protection of its own (it is the most recent); empty rows ``-inf``, and a merged
    row counts as recent as its last member (its position). Needs no observation queries.
    No parameters: the sink count is the engine's, ``LayerInputs.n_sink`` (kvpress default 4).
    """

    def score(self, layer: LayerInputs) -> np.ndarray:
        pos = layer.pos_h
        scores = np.where(pos < layer.n_sink, np.inf, pos.astype(np.float32))
        return np.where(layer.live, scores, -np.inf).astype(np.float32)


METHODS = {"streaming": Method(StreamingLLM, rank=1)}
