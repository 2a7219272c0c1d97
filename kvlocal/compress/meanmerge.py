"""MeanMerge: KVSlimmer's merging with the plain average of the two keys (the ablation of its key weights)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlocal.compress.kvslimmer import KVSlimmer
from kvlocal.compress.methods import Method


@dataclass
class MeanMerge(KVSlimmer):
    """KVSlimmer with key weights 1/2, 1/2: same pairs rule, rounds, mean values and ``log(count)`` bias.

    The ablation KVSlimmer's paper argues from: it differs from :class:`KVSlimmer` only in the key
    weights, so comparing the two measures what the closed-form (Hessian) weighting buys. Over rounds
    the weights compose (a row merged twice holds 1/4, 1/4, 1/2), as KVSlimmer's do. Reference:
    ``kvlocal.reference.compress.MeanMerge``. No parameters.
    """

    def pair_weights(self, a1, a2, v1, v2, o) -> np.ndarray:
        return np.full(np.shape(a1), 0.5)


METHODS = {"meanmerge": Method(MeanMerge, rank=8)}
