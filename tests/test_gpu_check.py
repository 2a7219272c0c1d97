"""ggml_patches/gpu_pack.sh and gpu_check.sh, run end to end without a GPU: a pack of this machine's own (CPU)
libraries in place of a CUDA build, a tiny random model, short prompts. A GPU session's minutes are few; this is
what keeps the scripts it will run from breaking unseen in between (every step but the native tests, which the
suite runs anyway)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import llama_cpp
import pytest

from conftest import REPO
from policy import missing


@pytest.mark.slow(24)
def test_gpu_pack_and_check_run_every_step(tmp_path):
    if sys.platform != "linux":
        pytest.skip("the GPU scripts pack Linux wheels and libraries")
    sys.path.insert(0, str(REPO / "ggml_patches"))
    from build import SDIST, cache_dir

    if not (cache_dir() / "src" / SDIST).exists():
        missing(f"the llama-cpp-python source package is not in {cache_dir() / 'src'}: run ./setup.sh")
    libs = Path(llama_cpp.__file__).parent / "lib"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {**os.environ, "GPU_LIBS": str(libs), "GPU_PYTHON": py, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    pack = tmp_path / "pack"
    r = subprocess.run(["bash", "ggml_patches/gpu_pack.sh", str(pack)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (pack / "bin.tar.xz").exists() and not (pack / "llama.cpp.tar.gz").exists()

    results = tmp_path / "results"
    env.update(GPU_PACK=str(pack), GPU_WORK=str(tmp_path / "work"), RESULTS=str(results), PYTHON=sys.executable,
               SHAPE="tiny", TESTS="0", TOKENS="600", CONTEXTS="512 1024")
    r = subprocess.run(["bash", "ggml_patches/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    log = r.stdout
    assert "prebuilt: no CUDA, built" in log and "runtime  llama-cpp-python 0.3.36, patched" in log
    for step in ("1. libraries", "2. native backend tests", "3. a random-weight GGUF of tiny", "4. kvlocal bench",
                 "5. kvlocal bench --frontier", "done ("):
        assert f"== {step}" in log, step
    # each bench: the full cache against the compressed one on the native backend, 600 tokens
    for name, method in (("bench", "criticalkv"), ("bench-adakv", "criticalkv+adakv")):
        text = (results / f"{name}.txt").read_text()
        assert f"method {method} · budget 0.1 · 600-token prompt" in text
        copied = next(line for line in text.splitlines() if line.startswith("K/V copied to the host"))
        assert copied.split()[-8:] == ["0.0", "MiB", "0", "on", "native", "without", "a", "tier"]  # nothing crossed
    rows = [line.split() for line in (results / "frontier.txt").read_text().splitlines()
            if line.strip().startswith(("512", "1,024"))]
    assert [row[1] for row in rows] == ["full", "full-kv-q8_0", "full-kv-q4_0", "criticalkv", "criticalkv@kv-q8_0"] * 2
    assert (results / "frontier.png").stat().st_size > 10_000
