"""`kvlocal run`: a prompt read into a bounded cache and continued, as a user runs it — every bad input refused in
one line, the ``--json`` figures and ``--dump-plan``'s plan for every method, a short prompt left uncompressed."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import run_cli
from kvlocal.compress import Plan
from kvlocal.eval.tasks import sample_text
from kvlocal.runtime.llama import kv_cache_bytes

WINDOW = 32  # kvlocal run's observation window (--recent's default): n_ctx = budget + chunk + window


def padded(n_ctx: int) -> int:
    """llama.cpp rounds n_ctx up to a multiple of 256 (llama-context.cpp, GGML_PAD(n_ctx, 256))."""
    return -(-n_ctx // 256) * 256


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory, smollm2_model):
    """~400 tokens of prose (the CLI adds BOS) and a short prompt of ~20 tokens."""
    d = tmp_path_factory.mktemp("prompts")
    long, short = d / "long.txt", d / "short.txt"
    long.write_text(smollm2_model.detokenize(smollm2_model.tokenize(sample_text())[:400]))
    short.write_text("The quick brown fox jumps over the lazy dog. Where does the fox jump?")
    return dict(long=long, short=short)


def test_cli_rejects_bad_input_with_one_line(smollm2, prompt_file):
    base = ["run", str(smollm2), "--prompt-file", str(prompt_file["long"]), "-n", "4", "-t", "1"]
    cases = {
        "budget 0": (["--budget", "0"], "> 0"),
        "budget -1": (["--budget", "-1"], "> 0"),
        "budget 1.5": (["--budget", "1.5"], "whole number"),
        "budget abc": (["--budget", "abc"], "not a number"),
        "below the floor": (["--budget", "20"], "floor"),
        "unknown method": (["--method", "nope"], "unknown compression method"),
        "prompt over -c": (["-c", "100"], "-c"),
        "observe-every 0": (["--observe-every", "0"], "--observe-every 0: give at least 1"),
        "value-norm without one": (["--value-norm", "l2", "--method", "snapkv"], "--method snapkv has no value norm"),
    }
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(cases, pool.map(lambda args: run_cli(*base, *args[0]), cases.values())))
    for name, r in results.items():
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (name, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and len(lines) == 1, (name, r.stderr)
        assert lines[0].startswith("kvlocal: error: ") and cases[name][1] in lines[0], (name, lines[0])
        assert r.stdout == "", (name, r.stdout)


FIELDS = {"text": str, "prompt_tokens": int, "generated_tokens": int, "method": str, "budget": str, "n_ctx": int,
          "kv_bytes_allocated": int, "kv_cells_live_peak": int, "compression_events": int,
          "compression_seconds": float, "setup_seconds": float, "prefill_seconds": float, "decode_seconds": float}


def test_cli_json_and_dump_plan(smollm2, smollm2_model, prompt_file, tmp_path):
    plan_path = tmp_path / "plan.json"
    r = run_cli("run", str(smollm2), "--prompt-file", str(prompt_file["long"]), "--budget", "128", "--chunk", "64",
                "-n", "8", "-t", "1", "--json", "--dump-plan", str(plan_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for name, kind in FIELDS.items():
        assert isinstance(out[name], kind), (name, out.get(name))
    assert out["method"] == "criticalkv" and out["budget"] == "128" and 1 <= out["generated_tokens"] <= 8
    assert out["n_ctx"] == padded(128 + 64 + WINDOW) < out["prompt_tokens"]
    assert out["kv_bytes_measured"] and out["kv_bytes_allocated"] == sum(kv_cache_bytes(smollm2_model, out["n_ctx"]))
    assert out["compression_events"] >= 2 and out["compression_seconds"] > 0
    assert 128 < out["kv_cells_live_peak"] <= out["n_ctx"]

    text = plan_path.read_text()
    plan = Plan.from_json(text)
    assert (plan.n_layer, plan.n_kv, plan.n_slots) == (smollm2_model.n_layer, smollm2_model.n_head_kv, 128)
    d = json.loads(text)
    assert len(d["layers"]) == plan.n_layer and all(len(layer["positions"]) == plan.n_kv for layer in d["layers"])
    assert plan.positions.max() == out["prompt_tokens"] - 1 and plan.positions.min() == 0
    assert d["slot_positions"] == plan.slot_positions().tolist()
    assert Plan.from_json(plan.to_json()).to_dict() == d  # round trip


@pytest.mark.parametrize("method", ["adakv", "criticalkv+adakv", "kvslimmer", "meanmerge", "criticalkv+kvslimmer"])
@pytest.mark.slow(15)
def test_cli_json_and_dump_plan_of_every_method(smollm2, smollm2_model, prompt_file, tmp_path, method):
    """Head budgets and merges reach the CLI: the dumped plan has empty slots (AdaKV: a layer's cells hold
    its widest head, within the budget's cells: a mean share of budget / 2) or merged slots with their members,
    key weights and counts."""
    plan_path = tmp_path / "plan.json"
    r = run_cli("run", str(smollm2), "--prompt-file", str(prompt_file["long"]), "--budget", "128", "--chunk", "64",
                "--method", method, "-n", "8", "-t", "1", "--json", "--dump-plan", str(plan_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["method"] == method and out["compression_events"] >= (1 if "adakv" in method else 2) and out["text"]
    plan = Plan.from_json(plan_path.read_text())
    entries = (plan.positions >= 0).sum(axis=2)  # [n_layer, Hkv]
    hkv = smollm2_model.n_head_kv
    if "adakv" in method:
        assert np.all(entries.sum(axis=1) == hkv * 64) and 64 < plan.n_slots <= 128
        assert (plan.keep < 0).any() and plan.merges is None
        assert out["n_ctx"] == padded(128 + 64 + WINDOW)  # the budget's cells, as every method
    else:
        assert plan.n_slots == 128 and np.all(entries == 128)
        assert plan.counts is not None and plan.merges is not None
        groups = 0
        for il in range(plan.n_layer):
            for h, m in enumerate(plan.merges[il] or []):
                if m is None:
                    continue
                for slot, cells, weights in zip(m["slots"], m["cells"], m["weights"]):
                    members = np.asarray(cells)[np.asarray(cells) >= 0]
                    assert plan.keep[il, h, slot] == members[-1]  # the slot holds the latest member's cell
                    assert plan.counts[il, h, slot] >= len(members) >= 2  # (members may be merged rows)
                    assert abs(float(np.sum(weights)) - 1) < 1e-5
                    groups += 1
        assert groups > 0 and plan.counts.max() >= 2


def test_cli_short_prompt_is_not_compressed(smollm2, prompt_file, tmp_path):
    plan_path = tmp_path / "plan.json"
    r = run_cli("run", str(smollm2), "--prompt-file", str(prompt_file["short"]), "--budget", "128", "-n", "8",
                "-t", "1", "--json", "--dump-plan", str(plan_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] + out["generated_tokens"] < 128
    assert out["compression_events"] == 0 and out["compression_seconds"] == 0
    seen = out["prompt_tokens"] + out["generated_tokens"]
    assert out["kv_cells_live_peak"] in (seen, seen + 1)  # + the end-of-generation token, kept but not counted
    assert json.loads(plan_path.read_text()) is None


# -- 6. the query-aware probe ---------------------------------------------------------------------------
