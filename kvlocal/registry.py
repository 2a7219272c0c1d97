"""Registries read from the modules that declare their entries: a package's modules (and the modules an entry
point group names) each hold a module-level ``METHODS`` dict, and :func:`discover` gathers them.

The compression methods (:mod:`kvlocal.compress.methods`) and their PyTorch twins (:mod:`kvlocal.reference.compress`)
are both read this way, so adding a method is its scorer's file and its twin's file, nothing else. Imports nothing
of kvlocal: both layers use it."""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil


def discover(package: str, group: str, into: dict, attribute: str = "METHODS", order=None) -> dict:
    """Fill ``into`` in place with the ``attribute`` dict of every module of ``package`` (but ``_private`` ones) and
    of every module the entry point ``group`` names, sorted by ``order(name, entry)`` (default: by name). A name
    declared by two modules is an ImportError naming both. Call it again for a module installed since."""
    pkg = importlib.import_module(package)
    modules = [f"{package}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
    modules += [ep.value for ep in importlib.metadata.entry_points(group=group)]
    found, where = {}, {}
    for module in modules:
        declared = getattr(importlib.import_module(module), attribute, {})
        if declared is into:  # the registry's own module
            continue
        for name, entry in declared.items():
            if name in where and where[name] != module:
                raise ImportError(f"{name!r} is declared by both {where[name]} and {module}")
            found[name], where[name] = entry, module
    into.clear()
    into.update(sorted(found.items(), key=lambda item: order(*item) if order else item[0]))
    return into
