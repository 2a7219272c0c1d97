"""Policy 2 of the suite (tests/conftest.py): what a test needs skips it with the reason locally and fails
it under CI. A module of its own so that test files in sub-folders import the same helpers."""

from __future__ import annotations

import importlib
import os

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def missing(reason: str):
    """Skip with the reason locally (a whole module when called at its top), fail under CI."""
    if under_ci():
        pytest.fail(f"{reason} (CI=true: everything must run)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def need(module: str, extra: str = "test"):
    """Import an optional package a test needs (``openai``, ``torch``), or skip/fail as :func:`missing`."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing(f"{module} is not installed ({e}): pip install -e '.[{extra}]'")
