"""The engine's scoring and selection layer: numpy in, numpy out, hot loops in ``kvlocal._kernels``.

One compression event, per layer: :class:`LayerInputs` (K, V, positions in cell order, the observation
queries, ``W_O``) -> a :class:`Scorer` -> kept cells per KV head -> a :class:`Plan` for all layers::

    from kvlocal.compress import LayerInputs, make_scorer, plan_layers

    scorer = make_scorer("criticalkv")                     # CriticalKV(SnapKV())
    plan = plan_layers(scorer, layers, budget=1024)         # layers: one LayerInputs per layer
    plan.keep[il]            # [Hkv, B] source cells per slot, per KV head, in position order
    plan.slot_positions()    # [B] the position of every cell after the plan is applied

The contract is documented once, in :mod:`kvlocal.compress.base`; the PyTorch reference of every
scorer (``kvlocal.reference.compress``) keeps exactly the same sets (``tests/test_compress.py``).
"""

from __future__ import annotations

import dataclasses

from kvlocal.compress.base import LayerInputs, Scorer, native_scoring, plan_layers, select, top_cells
from kvlocal.compress.criticalkv import CriticalKV, projected_value_norms
from kvlocal.compress.full import Full
from kvlocal.compress.plan import Plan
from kvlocal.compress.snapkv import SnapKV
from kvlocal.compress.streaming import StreamingLLM
from kvlocal.errors import UsageError


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _criticalkv(**kw) -> CriticalKV:
    """``CriticalKV(SnapKV(...))``: CriticalKV's own parameters go to it, the others to SnapKV."""
    own = {key: kw.pop(key) for key in list(kw) if key in _fields(CriticalKV) - {"press"}}
    return CriticalKV(press=SnapKV(**kw), **own)


METHODS = {
    "full": Full,
    "streaming": StreamingLLM,
    "snapkv": SnapKV,
    "criticalkv": _criticalkv,
}


def method_params(name: str) -> list[str]:
    """The hyperparameters ``make_scorer(name, ...)`` accepts."""
    if name == "criticalkv":
        return sorted((_fields(CriticalKV) - {"press"}) | _fields(SnapKV))
    return sorted(_fields(METHODS[name]))


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
        if {"n_sink", "window"} & set(unknown):
            hint = (" (sinks and the protected window are LayerInputs.n_sink and LayerInputs.window,"
                    " the same for every method)")
        raise UsageError(f"method {name!r} has no parameter {', '.join(unknown)}; its parameters: {allowed}{hint}")
    try:
        return METHODS[name](**params)
    except (TypeError, ValueError) as e:
        raise UsageError(f"method {name!r}: {e}") from None


__all__ = [
    "METHODS",
    "CriticalKV",
    "Full",
    "LayerInputs",
    "Plan",
    "Scorer",
    "SnapKV",
    "StreamingLLM",
    "make_scorer",
    "method_params",
    "native_scoring",
    "plan_layers",
    "projected_value_norms",
    "select",
    "top_cells",
]
