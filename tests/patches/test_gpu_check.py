"""ggml_patches/gpu_pack.sh and gpu_check.sh, run end to end without a GPU: a pack of this machine's own (CPU)
libraries in place of a CUDA build, a tiny random model, short prompts. A GPU session's minutes are few; this is
what keeps the scripts it will run from breaking unseen in between (every step but test-backend-ops, which the CPU
pack lacks, and the native tests, which the suite runs anyway), and what holds the steps' time budgets to one
10-minute command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import llama_cpp
import pytest

from conftest import REPO
from policy import missing

sys.path.insert(0, str(REPO / "ggml_patches"))

import gpu_steps  # noqa: E402

STEPS = ["libraries", "backend-ops", "setup", "tests", "bias", "gguf", "sched", "bench", "bench-adakv", "frontier"]


def budget_table(out: str) -> dict[str, int]:
    """The dry run's table: seconds per step, and the total under "total"."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\S+)\s+(\d+)s  ", out, re.M)}


def test_the_steps_budgets_fit_one_ten_minute_command():
    """DRY_RUN=1 prints every step with its budget and runs nothing; the budgets add up to at most 9 minutes."""
    r = subprocess.run(["bash", "ggml_patches/gpu_check.sh"], cwd=REPO, env={**os.environ, "DRY_RUN": "1"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    table = budget_table(r.stdout)
    total = table.pop("total")
    assert list(table) == STEPS and total == sum(table.values()) <= 540, r.stdout


@pytest.mark.slow(75)
def test_gpu_pack_and_check_run_every_step(tmp_path):
    if sys.platform != "linux":
        pytest.skip("the GPU scripts pack Linux wheels and libraries")
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

    out = tmp_path / "out"  # a device machine's $OUT: the results must land under it
    env.pop("RESULTS", None)
    env.update(GPU_PACK=str(pack), GPU_WORK=str(tmp_path / "work"), OUT=str(out), PYTHON=sys.executable,
               SHAPE="tiny", TESTS="0", TOKENS="600", CONTEXTS="512 1024", BUDGET_SCALE="4")  # a busy 2-core CPU
    r = subprocess.run(["bash", "ggml_patches/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    log, results = r.stdout, out / "gpu-check"
    assert "prebuilt: no CUDA, built" in log and re.search(r"runtime +llama-cpp-python 0\.3\.36, patched", log)
    ran = [s for s in STEPS if s not in ("backend-ops", "tests")]  # no test-backend-ops in a CPU pack; TESTS=0
    for step in ran:
        assert f"== {step} (budget " in log, step
    assert "== backend-ops: skipped (no test-backend-ops" in log and "== tests: skipped (TESTS=0)" in log
    steps = [line.split("\t") for line in (results / "steps.tsv").read_text().splitlines()]
    assert [s[0] for s in steps] == ran and all(s[3] == "ok" and int(s[2]) <= int(s[1]) for s in steps), steps

    # the scheduler's assignments read for every graph (all on the CPU here), the bias against itself
    sched = (results / "sched.txt").read_text()
    for op in ("score", "merge", "compaction", "biased decode"):
        assert re.search(rf"^  {op} +[1-9]\d* nodes, 1 splits \(CPU\)", sched, re.M), sched
    bias = (results / "bias.txt").read_text()
    assert len(re.findall(r"head +(64|128) flash attention (on |off): KL 0\.00e\+00", bias)) == 4, bias
    # each bench: the compressed cache on the native backend against the full one, nothing copied to the host
    for name, method, tokens in (("bench", "criticalkv", 600), ("bench-adakv", "criticalkv+adakv", 300)):
        result = json.loads((results / f"{name}.json").read_text())
        run = result["backends"]["native"]["run"]
        assert run["method"] == method and result["full"]["prompt_tokens"] == tokens and run["compression_events"] > 0
        assert result["backends"]["native"]["host_kv_bytes"] == 0
        assert f"{method} at budget 0.1 on native: " in (results / f"{name}.txt").read_text()
    rows = [line.split() for line in (results / "frontier.txt").read_text().splitlines()
            if line.strip().startswith(("512", "1,024"))]
    assert [row[1] for row in rows] == ["full", "full-kv-q8_0", "full-kv-q4_0", "criticalkv", "criticalkv@kv-q8_0"] * 2
    assert (results / "frontier.png").stat().st_size > 10_000
    assert not (tmp_path / "work" / "results").exists()


CASES = """\
Testing 2 devices

Backend 1/2: CUDA0
  Device description: NVIDIA H100 80GB HBM3
  FLASH_ATTN_EXT(hsk=64,hsv=64,nh=4,nr23=[1,1],kv=113,nb=1,mask=1,sinks=0,max_bias=0.000000,logit_softcap=0.000000,prec=f32,type_K=f16,type_V=f16,permute=[0,1,2,3],kv_view=1,v_is_view_of_k=0,n_kv_max=0,bias=1): \x1b[1;32mOK\x1b[0m
  FLASH_ATTN_EXT(hsk=128,hsv=128,nh=4,nr23=[1,1],kv=512,nb=8,mask=1,sinks=0,max_bias=8.000000,logit_softcap=0.000000,prec=f32,type_K=f16,type_V=f16,permute=[0,1,2,3],kv_view=1,v_is_view_of_k=0,n_kv_max=0,bias=1): not supported [CUDA0]
  FLASH_ATTN_EXT(hsk=128,hsv=128,nh=4,nr23=[4,1],kv=512,nb=1,mask=1,sinks=0,max_bias=0.000000,logit_softcap=0.000000,prec=f32,type_K=f16,type_V=f16,permute=[0,1,2,3],kv_view=1,v_is_view_of_k=0,n_kv_max=0): OK
  2/2 tests passed
  Backend CUDA0: \x1b[1;32mOK\x1b[0m
"""
UNSUPPORTED = ("  FLASH_ATTN_EXT(hsk=576,hsv=512,nh=2,nr23=[8,1],kv=512,nb=1,mask=1,sinks=0,max_bias=0.000000,"
               "logit_softcap=0.000000,prec=f32,type_K=q8_0,type_V=q8_0,permute=[0,1,2,3],kv_view=1,"
               "v_is_view_of_k=1,n_kv_max=0,bias=1): not supported [CUDA0]\n")


def test_backend_ops_counts_not_supported_bias_cases(capsys):
    """test-backend-ops passes a case it cannot run ("not supported"): the step counts the bias cases by status and
    fails on any not supported but ALiBi's, on a failure, and on a log without bias cases."""
    assert gpu_steps.backend_ops(CASES) == 0
    assert capsys.readouterr().out.startswith("attention-bias cases: 1 not supported, ALiBi, 1 ok")
    assert gpu_steps.backend_ops(CASES + UNSUPPORTED) == 1
    assert "not supported (not ALiBi): hsk=576" in capsys.readouterr().out
    assert gpu_steps.backend_ops(CASES.replace("\x1b[1;32mOK", "\x1b[1;31mFAIL")) == 1
    assert gpu_steps.backend_ops("Backend 1/2: CUDA0\n") == 1
