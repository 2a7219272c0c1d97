"""The engine's scoring and selection layer: numpy in, numpy out, hot loops in ``kvlocal._kernels``.

One compression event, per layer: :class:`LayerInputs` (K, V, positions in cell order, the observation
queries, ``W_O``) -> a :class:`Scorer` -> kept cells per KV head -> a :class:`Plan` for all layers::

    from kvlocal.compress import LayerInputs, make_scorer, plan_layers

    scorer = make_scorer("criticalkv")                     # CriticalKV(SnapKV())
    plan = plan_layers(scorer, layers, budget=1024)         # layers: one LayerInputs per layer
    plan.keep[il]            # [Hkv, B] source cells per slot, per KV head, in position order (-1: empty)
    plan.slot_positions()    # [B] the position of every cell after the plan is applied
    k, v, counts, bias = plan.materialize(k_cells, v_cells, counts_in)   # the rows to write (merges done)

Methods (``METHODS``, the CLI's ``--method``): eviction (``full``, ``streaming``, ``snapkv``,
``criticalkv``, ``defensivekv``), head-adaptive budgets (``adakv``, ``criticalkv+adakv``: a head may take up to
``max_share`` times the budget, so plans have up to ``max_share * budget`` slots), and merging
(``kvslimmer``, ``meanmerge``, ``criticalkv+kvslimmer``: slots that stand for several tokens, with
counts and a ``log(count)`` bias).

The contract is documented once, in :mod:`kvlocal.compress.base`; the PyTorch reference of every
scorer (``kvlocal.reference.compress``) keeps exactly the same sets (``tests/test_compress.py``).
"""

from __future__ import annotations

import dataclasses

from kvlocal.compress.adakv import AdaKV, head_budgets
from kvlocal.compress.base import LayerInputs, Scorer, native_scoring, plan_layers, select, top_cells
from kvlocal.compress.criticalkv import VALUE_NORMS, CriticalKV, norm_p, projected_value_norms
from kvlocal.compress.defensivekv import DefensiveKV
from kvlocal.compress.evict_merge import EvictThenMerge
from kvlocal.compress.full import Full
from kvlocal.compress.kvslimmer import KVSlimmer
from kvlocal.compress.meanmerge import MeanMerge
from kvlocal.compress.plan import LayerPlan, Plan
from kvlocal.compress.snapkv import SnapKV
from kvlocal.compress.streaming import StreamingLLM
from kvlocal.errors import UsageError

WRAPPED = {"press", "merger"}  # fields that hold another scorer, not hyperparameters


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - WRAPPED


def _own(kw: dict, cls) -> dict:
    """Take ``cls``'s hyperparameters out of ``kw``."""
    return {key: kw.pop(key) for key in list(kw) if key in _fields(cls)}


def _criticalkv(**kw) -> CriticalKV:
    """``CriticalKV(SnapKV(...))``: CriticalKV's own parameters go to it, the others to SnapKV."""
    own = _own(kw, CriticalKV)
    return CriticalKV(press=SnapKV(**kw), **own)


def _adakv(**kw) -> AdaKV:
    """``AdaKV(SnapKV(...))``."""
    own = _own(kw, AdaKV)
    return AdaKV(press=SnapKV(**kw), **own)


def _criticalkv_adakv(**kw) -> AdaKV:
    """``AdaKV(CriticalKV(SnapKV(...)))``: kvpress's CriticalAdaKV."""
    own = _own(kw, AdaKV)
    return AdaKV(press=_criticalkv(**kw), **own)


def _criticalkv_kvslimmer(**kw) -> EvictThenMerge:
    """``EvictThenMerge(CriticalKV(SnapKV(...)), KVSlimmer())``."""
    own = _own(kw, EvictThenMerge)
    return EvictThenMerge(press=_criticalkv(**kw), merger=KVSlimmer(), **own)


METHODS = {
    "full": Full,
    "streaming": StreamingLLM,
    "snapkv": SnapKV,
    "criticalkv": _criticalkv,
    "defensivekv": DefensiveKV,
    "adakv": _adakv,
    "criticalkv+adakv": _criticalkv_adakv,
    "kvslimmer": KVSlimmer,
    "meanmerge": MeanMerge,
    "criticalkv+kvslimmer": _criticalkv_kvslimmer,
}

PARTS = {  # the classes whose hyperparameters a composed method takes
    "criticalkv": (CriticalKV, SnapKV),
    "adakv": (AdaKV, SnapKV),
    "criticalkv+adakv": (AdaKV, CriticalKV, SnapKV),
    "criticalkv+kvslimmer": (EvictThenMerge, CriticalKV, SnapKV),
}


def method_params(name: str) -> list[str]:
    """The hyperparameters ``make_scorer(name, ...)`` accepts."""
    return sorted(set().union(*(_fields(cls) for cls in PARTS.get(name, (METHODS[name],)))))


def value_norm_refusal(name: str) -> str | None:
    """Why ``name`` takes no ``value_norm`` (CriticalKV's, :data:`VALUE_NORMS`) — "has no value norm; use …", the
    methods that have one — or None where it does (or the method is unknown: refused elsewhere, by its name)."""
    if name not in METHODS or "value_norm" in method_params(name):
        return None
    have = [m for m in METHODS if "value_norm" in method_params(m)]
    return f"has no value norm; use {', '.join(have[:-1])} or {have[-1]}"


def make_scorer(name: str, **params) -> Scorer:
    """The scorer of a method by name (``METHODS``), with hyperparameters as keyword arguments.

    Raises :class:`kvlocal.errors.UsageError` for an unknown method or parameter, or a bad value.
    """
    if name not in METHODS:
        raise UsageError(f"unknown compression method {name!r}; known methods: {', '.join(METHODS)}")
    unknown = sorted(set(params) - set(method_params(name)))
    if unknown:
        allowed = ", ".join(method_params(name)) or "none"
        hint = ""
        if {"n_sink", "recent", "window"} & set(unknown):
            hint = (" (sinks and the protected recent span are LayerInputs.n_sink and LayerInputs.recent,"
                    " the same for every method)")
        raise UsageError(f"method {name!r} has no parameter {', '.join(unknown)}; its parameters: {allowed}{hint}")
    try:
        return METHODS[name](**params)
    except (TypeError, ValueError) as e:
        raise UsageError(f"method {name!r}: {e}") from None



# The registry of what each method asks of the engine, derived from its scorer's capabilities
# (kvlocal.compress.base.Scorer): read W_O, need the per-head bias, merge rows.
WO_METHODS = frozenset(m for m in METHODS if make_scorer(m).needs_wo)
BIAS_METHODS = frozenset(m for m in METHODS if make_scorer(m).needs_bias)
MERGING_METHODS = frozenset(m for m in METHODS if make_scorer(m).merges)
# Every method runs on both KV backends (the engine's --backend). A scorer exists up to three times:
#   - the torch oracle: kvlocal.reference.compress (PyTorch, readable, the definition tests check against);
#   - numpy + C: these scorers, on K/V the state backend reads to the host (hot loops in compress.kernels);
#   - ggml graphs: the same scorers fed by the patched llama.cpp's on-device graphs (llama_kv_score: window
#     votes and projected value norms; llama_kv_compact: the kept rows). A scorer that reads K/V itself (a
#     merge, DefensiveKV's maximum) asks for the rows it reads (LayerInputs.rows), which then cross.


def observation_window(scorer: Scorer) -> int | None:
    """The observation queries an attention scorer reads (SnapKV's ``window_size``, through wrappers), or
    None for a scorer that reads none."""
    while scorer is not None:
        if hasattr(scorer, "window_size"):
            return int(scorer.window_size)
        scorer = getattr(scorer, "press", None)
    return None

__all__ = [
    "BIAS_METHODS",
    "MERGING_METHODS",
    "METHODS",
    "VALUE_NORMS",
    "WO_METHODS",
    "value_norm_refusal",
    "AdaKV",
    "CriticalKV",
    "DefensiveKV",
    "EvictThenMerge",
    "Full",
    "KVSlimmer",
    "LayerInputs",
    "LayerPlan",
    "MeanMerge",
    "Plan",
    "Scorer",
    "SnapKV",
    "StreamingLLM",
    "head_budgets",
    "make_scorer",
    "method_params",
    "native_scoring",
    "norm_p",
    "observation_window",
    "plan_layers",
    "projected_value_norms",
    "select",
    "top_cells",
]
