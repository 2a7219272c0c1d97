"""Evict, then merge: CriticalKV keeps a little more than the budget, KVSlimmer merges it down."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvlocal.reference.cache import LayerKV
from kvlocal.reference.compress.base import Observation, Scorer
from kvlocal.reference.compress.criticalkv import CriticalKV
from kvlocal.reference.compress.kvslimmer import KVSlimmer, MergeGroups
from kvlocal.reference.compress.snapkv import SnapKV


def evict_budget(budget: int, merge_ratio: float) -> int:
    """Rows per head the eviction stage keeps: ``budget * (1 + merge_ratio)``, rounded half up."""
    return int(math.floor(budget * (1.0 + merge_ratio) + 0.5))


@dataclass
class EvictThenMerge:
    """``press`` keeps :func:`evict_budget` rows per head, then ``merger`` merges them down to the budget.

    The merge sees only the kept rows (adjacent = adjacent among them, ``alpha`` and ``o`` over them), so
    it acts on the entries the eviction judged worth keeping; the extra ``merge_ratio * budget`` rows
    survive as parts of merged slots instead of being dropped. Default: CriticalKV(SnapKV()) + KVSlimmer.

    Parameters
    ----------
    press : Scorer
        The eviction stage.
    merger : KVSlimmer
        The merging stage (its ``n_sink`` should match the press's).
    merge_ratio : float
        Extra rows kept by the eviction stage, as a fraction of the budget.
    """

    press: Scorer = field(default_factory=CriticalKV)
    merger: KVSlimmer = field(default_factory=KVSlimmer)
    merge_ratio: float = 0.5

    def compress(self, kv: LayerKV, obs: Observation, budget: int) -> MergeGroups:
        """Both stages, in place; the groups' members are rows of ``kv`` as it was before."""
        kept = self.press.compress(kv, obs, evict_budget(budget, self.merge_ratio))
        groups = self.merger.compress(kv, obs, budget)
        members = [[kept.keep[h][rows] for rows in per_head] for h, per_head in enumerate(groups.members)]
        return MergeGroups(members=members, weights=groups.weights, rounds=groups.rounds)


METHODS = {  # the twin of kvlocal.compress's, by name
    "criticalkv+kvslimmer": lambda n_sink: EvictThenMerge(CriticalKV(SnapKV(n_sink=n_sink)), KVSlimmer(n_sink=n_sink)),
}
