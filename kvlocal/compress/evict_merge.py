"""Evict, then merge: CriticalKV keeps a little more than the budget, KVSlimmer merges it down."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvlocal.compress.base import LayerInputs, Scorer
from kvlocal.compress.criticalkv import CriticalKV, criticalkv
from kvlocal.compress.kvslimmer import KVSlimmer
from kvlocal.compress.methods import Method, own
from kvlocal.compress.plan import LayerPlan
from kvlocal.compress.snapkv import SnapKV


def evict_budget(budget: int, merge_ratio: float) -> int:
    """Rows per head the eviction stage keeps: ``budget * (1 + merge_ratio)``, rounded half up."""
    return int(math.floor(budget * (1.0 + merge_ratio) + 0.5))


@dataclass
class EvictThenMerge(Scorer):
    """``press`` keeps :func:`evict_budget` rows per head, then ``merger`` merges them down to the budget.

    ``criticalkv+kvslimmer`` = ``EvictThenMerge(CriticalKV(SnapKV()), KVSlimmer())``: CriticalKV keeps
    ``min(live, round(budget * (1 + merge_ratio)))`` rows per head, then KVSlimmer merges those rows
    (adjacent = adjacent among the kept rows in position order; ``alpha`` and ``o`` over them only) down
    to the budget. In this order merging acts on the entries CriticalKV judged worth keeping, and the
    ``merge_ratio * budget`` extra entries survive as parts of merged slots instead of being dropped;
    merging first would spend merges on rows the eviction drops anyway. Reference:
    ``kvlocal.reference.compress.EvictThenMerge``.

    Parameters
    ----------
    press : Scorer
        The eviction stage (CriticalKV(SnapKV()) by default).
    merger : KVSlimmer
        The merging stage (KVSlimmer, or MeanMerge).
    merge_ratio : float
        Extra rows kept by the eviction stage, as a fraction of the budget (>= 0; 0 = plain eviction).
    """

    press: Scorer = field(default_factory=CriticalKV)
    merger: KVSlimmer = field(default_factory=KVSlimmer)
    merge_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not self.merge_ratio >= 0:
            raise ValueError(f"merge_ratio must be >= 0, got {self.merge_ratio}")

    def keep(self, layer: LayerInputs, budget: int):
        """The cells that hold each slot (a merged slot: its latest member); the merges are in :meth:`plan_layer`."""
        return self.plan_layer(layer, budget).keep

    def plan_layer(self, layer: LayerInputs, budget: int) -> LayerPlan:
        kept = self.press.keep(layer, evict_budget(budget, self.merge_ratio))  # [Hkv, B1], -1 in front
        return self.merger.plan_layer(layer.take(kept), budget).remap(kept)


def criticalkv_kvslimmer(**kw) -> EvictThenMerge:
    """``EvictThenMerge(CriticalKV(SnapKV(...)), KVSlimmer())``."""
    mine = own(kw, EvictThenMerge)
    return EvictThenMerge(press=criticalkv(**kw), merger=KVSlimmer(), **mine)


METHODS = {"criticalkv+kvslimmer": Method(criticalkv_kvslimmer, parts=(EvictThenMerge, CriticalKV, SnapKV), rank=9)}
