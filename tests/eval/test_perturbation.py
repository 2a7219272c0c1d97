"""`kvlocal eval --perturbation`: the CriticalKV paper's output-perturbation analysis on the PyTorch reference.

Real SmolLM2 weights and real prose (512 tokens); what is checked is what must hold whatever the numbers
are: nothing dropped, nothing perturbed; the per-head outputs add up to the model's own attention output;
the compressed caches are what the reference compressors keep; more budget, less perturbation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import assert_usage_error, run_cli
from policy import need

torch = need("torch")

N_TOKENS = 512


@pytest.fixture(scope="module")
def reference(smollm2_ref):
    return smollm2_ref


@pytest.fixture(scope="module")
def seen_attention(reference, smollm2):
    """(the analysis, each layer's attention output [w, D] as the model computed it for the window)."""
    from kvlocal.eval.perturbation import Perturbation, prompt_tokens
    from kvlocal.runtime import Model

    seen = {}
    hooks = [layer.attention.register_forward_hook(lambda mod, inp, out, il=il: seen.__setitem__(il, out))
             for il, layer in enumerate(reference.layers)]
    try:  # the last call of each layer is the window's
        p = Perturbation(reference, prompt_tokens(Model(smollm2), N_TOKENS, 0))
    finally:
        for h in hooks:
            h.remove()
    return p, seen


@pytest.fixture(scope="module")
def analysis(seen_attention):
    return seen_attention[0]


@pytest.fixture(scope="module")
def measured(analysis):
    return {(m, b): analysis.measure(m, b) for m in ("streaming", "snapkv", "criticalkv") for b in (0.1, 0.4)}


def test_the_prompt_is_seeded_real_prose(smollm2):
    from kvlocal.eval.perturbation import prompt_tokens
    from kvlocal.runtime import Model

    lm = Model(smollm2)
    a = prompt_tokens(lm, 300, 0)
    assert len(a) == 300 and a == prompt_tokens(lm, 300, 0) and a != prompt_tokens(lm, 300, 1)
    assert len(set(lm.detokenize(a).split())) > 100  # words, not a repeated snippet


def test_head_outputs_add_up_to_the_models_attention_output(seen_attention, reference):
    p, seen = seen_attention
    assert p.q_pos.tolist() == list(range(N_TOKENS - 32, N_TOKENS))
    for il in p.layers:
        own = seen[il]  # [w, D]: Attention.forward's output for the window's tokens
        assert own.shape == (32, reference.args.n_embd)
        mine = p.outputs[il].sum(dim=0)  # sum over the query heads of o_h (SmolLM2's o_proj has no bias)
        assert reference.layers[il].attention.wo.bias is None
        assert (mine - own).abs().max() <= 1e-5 * own.abs().max() + 1e-6, il


def test_nothing_dropped_nothing_perturbed(analysis):
    for method in ("streaming", "snapkv", "criticalkv"):
        r = analysis.measure(method, 1.0)
        assert r["budget_cells"] == N_TOKENS
        assert r["head_l1"] == pytest.approx(0, abs=1e-5) and max(r["head_l1_per_layer"]) < 1e-5
        assert r["hidden_rel_l1"] < 1e-6 and abs(r["hidden_cos"]) < 1e-6
        assert r["o_l1"] > 1  # ...while the outputs themselves are not small


def test_the_caches_are_what_the_reference_compressors_keep(analysis):
    """The engine's scorers on the analysis' inputs keep the reference compressors' sets (sinks + window
    protected, the budget per head), with the observation the reference would build."""
    from kvlocal.reference.compress import CriticalKV, Observation, SnapKV, StreamingLLM

    cells = analysis.budget_cells(0.1)
    assert cells == math.ceil(0.1 * N_TOKENS)
    for method, ref in (("snapkv", SnapKV()), ("criticalkv", CriticalKV(SnapKV())), ("streaming", StreamingLLM())):
        layers = analysis.compressed(method, cells)
        for il in (0, 7, 29):
            kv = analysis.cache[il]
            obs = Observation(q=analysis.queries[il], q_pos=analysis.q_pos,
                              wo=analysis.model.layers[il].attention.wo.weight)
            plan = ref.plan(kv, obs, cells)
            for h in range(kv.pos.shape[0]):
                assert layers[il].pos[h].tolist() == kv.pos[h, plan.keep[h]].tolist(), (method, il, h)
            held = layers[il].pos
            assert held.shape[1] == cells and bool((held >= 0).all())
            assert set(range(4)) <= set(held[0].tolist()) and set(analysis.q_pos.tolist()) <= set(held[0].tolist())


def test_a_budget_is_memory_for_the_head_adaptive_methods_too(analysis):
    """AdaKV's heads share a layer's cells unevenly: its plan fits the budget's cells, as the engine's does (a mean
    head budget of cells / max_share), instead of giving every head the cells and the widest up to twice them."""
    cells = analysis.budget_cells(0.1)
    for method in ("adakv", "criticalkv+adakv"):
        layers = analysis.compressed(method, cells)
        widths = [int((layers[il].pos >= 0).sum(dim=1).max()) for il in analysis.layers]
        assert max(widths) <= cells and layers[analysis.layers[0]].pos.shape[1] <= cells, method


def test_compression_perturbs_and_more_budget_perturbs_less(measured):
    for method in ("streaming", "snapkv", "criticalkv"):
        small, large = measured[(method, 0.1)], measured[(method, 0.4)]
        assert small["budget_cells"] == 52 and large["budget_cells"] == 205
        assert small["head_l1"] > 0.05 * small["o_l1"] and small["hidden_rel_l1"] > 0.05  # dropping 90% shows
        # measured on seeds 0-3 (512 tokens): every layer, every method, by at least 1.4 (of tens)
        assert all(b < a for a, b in zip(small["head_l1_per_layer"], large["head_l1_per_layer"])), method
        assert large["hidden_rel_l1"] < small["hidden_rel_l1"] and large["hidden_cos"] < small["hidden_cos"]
    # the attention-based methods beat keeping the most recent tokens, in every measure, at 0.4
    for method in ("snapkv", "criticalkv"):
        assert measured[(method, 0.4)]["head_l1"] < measured[("streaming", 0.4)]["head_l1"]
        assert measured[(method, 0.4)]["hidden_rel_l1"] < measured[("streaming", 0.4)]["hidden_rel_l1"]


def test_table(measured):
    from kvlocal.eval.perturbation import key, table

    recs = [{"key": key("smollm2-135m", m, b, 0, N_TOKENS), "model": "smollm2-135m", "seed": 0,
             "n_tokens": N_TOKENS, **r} for (m, b), r in measured.items()]
    text = table(recs)
    rows = [ln for ln in text.splitlines() if ln.startswith("| smollm2-135m")]
    assert len(rows) == 6 and all(len(r.split("|")) == 13 for r in rows)
    crit = next(r for r in rows if "| 0.4 | 205 | criticalkv |" in r).split("|")
    snap, c = measured[("snapkv", 0.4)], measured[("criticalkv", 0.4)]
    assert float(crit[10]) == pytest.approx(c["head_l1"] / snap["head_l1"], abs=1e-3)
    assert float(crit[11]) == pytest.approx(c["hidden_rel_l1"] / snap["hidden_rel_l1"], abs=1e-3)
    assert "(layer, budget) pairs" in text


@pytest.mark.slow(12)
def test_cli_writes_complete_files_and_resumes(smollm2, tmp_path):
    out = tmp_path / "p"
    args = ("eval", "--perturbation", "--out", str(out), "--tokens", "300", "--budgets", "0.1", "0.4",
            "--methods", "snapkv", "criticalkv", "-t", "1")
    r = run_cli(*args, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    records = [json.loads(line) for line in (out / "perturbation.jsonl").read_text().splitlines()]
    assert sorted((x["method"], x["budget"]) for x in records) == sorted(
        (m, b) for m in ("snapkv", "criticalkv") for b in (0.1, 0.4))
    for x in records:
        assert x["command"].startswith("kvlocal eval --perturbation --out") and len(x["model_sha256"]) == 64
        assert x["model"] == "smollm2-135m" and x["model_file"] == Path(smollm2).name
        assert x["seed"] == 0 and x["n_tokens"] == x["prompt_tokens"] == 300 and x["finished"].endswith("Z")
        assert x["seconds"] > 0 and x["prefill_seconds"] > 0 and x["torch_threads"] == 1
        assert x["budget_cells"] == {0.1: 36, 0.4: 120}[x["budget"]]  # 0.1 of 300 is below sinks + window
        assert len(x["layers"]) == len(x["head_l1_per_layer"]) == len(x["o_l1_per_layer"]) == 30
        assert x["head_l1"] == pytest.approx(sum(x["head_l1_per_layer"]) / 30)
        assert x["head_l1"] > 0 and 0 < x["hidden_rel_l1"] < 2 and 0 < x["hidden_cos"] < 1
    md = (out / "perturbation.md").read_text()
    assert md.splitlines()[0].startswith("| model | tokens | seed | budget | cells | method | mean ‖o−ô‖₁")
    assert len([ln for ln in md.splitlines() if ln.startswith("| smollm2-135m | 300 | 0 |")]) == 4
    assert md.strip() in r.stdout

    before = (out / "perturbation.jsonl").read_text()
    again = run_cli(*args, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "perturbation.jsonl").read_text() == before and (out / "perturbation.md").read_text() == md
    assert "0 runs in" in again.stderr and "4 already done" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["--tasks", "needle"], "--tasks does not apply to --perturbation"),
    (["--items", "1"], "--items does not apply to --perturbation"),
    (["--observations", "agnostic"], "--observations does not apply to --perturbation"),
    (["--methods", "full-q8_0"], "--methods: unknown full-q8_0"),
    (["--budgets", "1.5"], "--budgets 1.5"),
    (["--tokens", "50"], "--tokens 50"),
])
def test_bad_flags_are_one_line_exit_2(tmp_path, args, message):
    r = run_cli("eval", "--perturbation", "--out", str(tmp_path / "p"), *args, timeout=60)
    assert_usage_error(r, message)
    assert not (tmp_path / "p").exists()


def test_without_torch_one_line_names_the_extra(tmp_path):
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named torch (hidden by the test)')\n")
    r = run_cli("eval", "--perturbation", "--out", str(tmp_path / "p"), "--tokens", "300",
                env={"PYTHONPATH": str(tmp_path / "shadow")}, timeout=60)
    assert_usage_error(r, "--perturbation", "pip install", "[reference]")
