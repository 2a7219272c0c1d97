"""The registry of compression methods (the CLI's ``--method``), derived from the scorer modules themselves.

A method is declared once, in the module of its scorer, by a module-level ``METHODS`` dict of name ->
:class:`Method`::

    METHODS = {"snapkv": Method(SnapKV)}                        # one class, its fields are the hyperparameters
    METHODS = {"criticalkv": Method(criticalkv, parts=(CriticalKV, SnapKV))}    # a composition

:func:`discover` reads every module of :mod:`kvlocal.compress` and every module named by the ``kvlocal.methods``
entry point group (a method from another package), so adding a method is one scorer file here plus its
reference twin in :mod:`kvlocal.reference.compress` (which declares the same name; ``tests/compress/test_methods.py``
checks every method against its twin). The names, the help text, the parameters a method takes and what it asks
of the engine (:data:`WO_METHODS`, ...) are all read from this registry.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from dataclasses import dataclass
from typing import Callable

from kvlocal import registry
from kvlocal.errors import UsageError

ENTRY_POINTS = "kvlocal.methods"  # the entry point group of methods from other packages (a module with METHODS)
WRAPPED = {"press", "merger"}  # fields that hold another scorer, not hyperparameters


@dataclass(frozen=True)
class Method:
    """A compression method: ``make(**params)`` builds its scorer; ``parts`` are the classes whose dataclass fields
    are its hyperparameters (default: ``make`` itself, a scorer class); ``rank`` orders the listing (help text,
    errors): the plainer methods first."""

    make: Callable
    parts: tuple = ()
    rank: int = 100

    def params(self) -> list[str]:
        """The hyperparameters ``make`` accepts."""
        return sorted(set().union(*(fields(cls) for cls in self.parts or (self.make,))))


def fields(cls) -> set[str]:
    """A scorer class's hyperparameters: its dataclass fields but those that hold another scorer."""
    return {f.name for f in dataclasses.fields(cls)} - WRAPPED


def own(kw: dict, cls) -> dict:
    """Take ``cls``'s hyperparameters out of ``kw`` (a composed method gives each part its own)."""
    return {key: kw.pop(key) for key in list(kw) if key in fields(cls)}


METHODS: dict[str, Method] = {}  # filled by discover(), in rank order


def discover() -> dict:
    """Fill :data:`METHODS` in place from every module of :mod:`kvlocal.compress` and every module the entry point
    group ``kvlocal.methods`` names (:func:`kvlocal.registry.discover`), in rank order. Called on import; call it
    again for a method installed since."""
    return registry.discover("kvlocal.compress", ENTRY_POINTS, METHODS, order=lambda name, m: (m.rank, name))


def method_params(name: str) -> list[str]:
    """The hyperparameters ``make_scorer(name, ...)`` accepts."""
    return METHODS[name].params()


def make_scorer(name: str, **params):
    """The scorer of a method by name (:data:`METHODS`), with hyperparameters as keyword arguments.

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
        return METHODS[name].make(**params)
    except (TypeError, ValueError) as e:
        raise UsageError(f"method {name!r}: {e}") from None


def value_norm_refusal(name: str) -> str | None:
    """Why ``name`` takes no ``value_norm`` (CriticalKV's) — "has no value norm; use …", the methods that have
    one — or None where it does (or the method is unknown: refused elsewhere, by its name)."""
    if name not in METHODS or "value_norm" in method_params(name):
        return None
    have = [m for m in METHODS if "value_norm" in method_params(m)]
    return f"has no value norm; use {', '.join(have[:-1])} or {have[-1]}"


def methods_help() -> str:
    """The known methods, for help text: ``full, streaming, snapkv, ...``."""
    return ", ".join(METHODS)


class MethodsWith(collections.abc.Set):
    """The methods whose default scorer has a capability (:class:`~kvlocal.compress.base.Scorer`'s ``needs_wo``,
    ``needs_bias``, ``merges``): what each method asks of the engine, read from the registry as it is now."""

    def __init__(self, capability: str):
        self.capability = capability

    def _names(self) -> frozenset:
        return frozenset(m for m in METHODS if getattr(make_scorer(m), self.capability))

    def __contains__(self, name) -> bool:
        return name in METHODS and bool(getattr(make_scorer(name), self.capability))

    def __iter__(self):
        return iter(sorted(self._names()))

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _from_iterable(cls, it) -> frozenset:  # what `|`, `&` and `-` with another set give
        return frozenset(it)

    def __repr__(self) -> str:
        return f"MethodsWith({self.capability!r}: {sorted(self._names())})"


WO_METHODS = MethodsWith("needs_wo")  # read W_O
BIAS_METHODS = MethodsWith("needs_bias")  # need the per-head bias (patch 0007)
MERGING_METHODS = MethodsWith("merges")  # merge rows
