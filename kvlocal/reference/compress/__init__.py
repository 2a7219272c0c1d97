"""Reference (PyTorch) versions of the compression maths, each operating on a cache layer.

Eviction scorers follow one contract (see :mod:`.base`) and compose by wrapping::

    SnapKV()                          # window-attention vote, pooled, GQA mean
    StreamingLLM()                    # sinks + most recent
    CriticalKV(SnapKV())              # two-stage: attention, then attention x ||v W_O||_1 (value_norm)
    DefensiveKV()                     # worst-case (max) window attention with a head prior, x ||v W_O||_1
    AdaKV(CriticalKV(SnapKV()))       # head-wise budgets (AdaKV outermost)

    plan = scorer.plan(layer_kv, Observation(q=q_win, q_pos=q_pos, wo=o_proj_weight), budget)
    apply_keep(layer_kv, plan)        # or scorer.compress(...)

Merging is separate: ``KVSlimmer().compress(layer_kv, obs, budget)`` merges adjacent rows in rounds
down to the budget (result: :class:`MergeGroups`); ``MeanMerge`` is the same with averaged keys, and
``EvictThenMerge(CriticalKV(SnapKV()), KVSlimmer())`` evicts to a little more than the budget first.

Each module declares the twins of the engine's methods it holds (``METHODS``: name -> ``twin(n_sink)``, the scorer
with the engine's defaults), read like the engine's own (:data:`METHODS`, :func:`make_twin`); an out-of-tree
method names its twin's module in the entry point group ``kvlocal.reference_methods``.
"""

from kvlocal import registry
from kvlocal.reference.compress.adakv import AdaKV, adakv_budgets
from kvlocal.reference.compress.base import (
    KeepPlan,
    Observation,
    Scorer,
    apply_keep,
    gather_rows,
    live_mask,
    protected_mask,
    select,
    window_attention,
)
from kvlocal.reference.compress.criticalkv import CriticalKV, projected_value_norms, two_stage
from kvlocal.reference.compress.defensivekv import DefensiveKV, defensive_aggregation, mass_first_stage
from kvlocal.reference.compress.evict_merge import EvictThenMerge, evict_budget
from kvlocal.reference.compress.full import Full
from kvlocal.reference.compress.kvslimmer import (
    KVSlimmer,
    MeanMerge,
    MergeGroups,
    MergePlan,
    apply_merges,
    hessian_norms,
    merge_weights,
    select_pairs,
    slot_attention,
)
from kvlocal.reference.compress.snapkv import SnapKV, pool1d
from kvlocal.reference.compress.streaming import StreamingLLM

ENTRY_POINTS = "kvlocal.reference_methods"
METHODS: dict = {}  # name -> twin(n_sink), for every method of kvlocal.compress.METHODS


def discover() -> dict:
    """Fill :data:`METHODS` from this package's modules and the entry point group :data:`ENTRY_POINTS`."""
    return registry.discover(__name__, ENTRY_POINTS, METHODS)


def make_twin(name: str, n_sink: int = 4):
    """The PyTorch twin of the engine's method ``name`` with its default hyperparameters; KeyError if it has none."""
    return METHODS[name](n_sink)


discover()

__all__ = [
    "ENTRY_POINTS",
    "Full",
    "METHODS",
    "discover",
    "make_twin",
    "AdaKV",
    "CriticalKV",
    "DefensiveKV",
    "EvictThenMerge",
    "KVSlimmer",
    "KeepPlan",
    "MeanMerge",
    "MergeGroups",
    "MergePlan",
    "Observation",
    "Scorer",
    "SnapKV",
    "StreamingLLM",
    "adakv_budgets",
    "apply_keep",
    "apply_merges",
    "defensive_aggregation",
    "evict_budget",
    "gather_rows",
    "hessian_norms",
    "live_mask",
    "mass_first_stage",
    "merge_weights",
    "pool1d",
    "projected_value_norms",
    "protected_mask",
    "select",
    "select_pairs",
    "slot_attention",
    "two_stage",
    "window_attention",
]
