"""Shared fixtures. Tests run the real llama.cpp on real GGUF files: the default model is pulled into
the user cache on first use (the same path `kvlocal chat` takes), so the suite needs the network once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from kvlocal.models import pull

    return pull("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def smollm2_model(smollm2):
    from kvlocal.runtime import Model

    return Model(smollm2)


def run_cli(*args: str, input: str | None = None, env: dict | None = None, timeout: int = 300):
    """Run `python -m kvlocal ARGS` as a user would; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "kvlocal", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )
