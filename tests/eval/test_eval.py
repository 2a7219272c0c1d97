"""`kvlocal eval`: the seeded tasks, and `--quick` end to end as a user runs it (output complete and sane,
resumable; not the numbers)."""

from __future__ import annotations

import csv
import json
import random

import pytest

from conftest import run_cli
from kvlocal.eval.command import QUICK
from kvlocal.eval.runner import plan
from kvlocal.eval.tasks import LONG_TEXTS, TASKS, TEXTS, Item, Prose, insert_at, make_items, score, sentences


def _prose() -> Prose:
    return Prose(lambda s: len(s.split()))  # a word is a token: enough to check the generators


def test_tasks_are_seeded_and_hold_their_answers():
    for task in TASKS:
        a, b = make_items(task, _prose(), 600, 1), make_items(task, _prose(), 600, 1)
        assert [i.prompt for i in a] == [i.prompt for i in b], task
        assert [i.prompt for i in a] != [i.prompt for i in make_items(task, _prose(), 600, 2)], task
        for item in a:
            assert 450 <= len(item.document.split()) <= 800, (task, item.name)
            for e in item.expected:  # every answer is in the document (docqa: after its quoted start)
                assert e in " ".join(item.document.split()), (task, item.name, e)


def test_a_document_longer_than_the_short_texts_reads_on_into_the_long_ones():
    short = sum(len(s.split()) for s in sentences(TEXTS))
    doc = " ".join(_prose().take(short, random.Random(0)))  # all of the short texts, once
    assert len(doc.split()) >= short and "Kellynch" not in doc
    doc = " ".join(_prose().take(short + 100, random.Random(0)))
    assert len(doc.split()) >= short + 100 and doc.count("GNU GENERAL PUBLIC LICENSE") <= 1
    assert any(s in doc for s in sentences(LONG_TEXTS) if s not in sentences(TEXTS))


def test_a_document_longer_than_the_shipped_texts_is_a_usage_error():
    from kvlocal.errors import UsageError

    words = sum(len(s.split()) for s in sentences(LONG_TEXTS))
    with pytest.raises(UsageError, match=f"{words:,} tokens for this model's tokenizer.*give fewer --tokens"):
        _prose().take(words + 100, random.Random(0))  # never by repeating the texts


def test_multikey_asks_one_of_several_similar_facts():
    for item in make_items("multikey", _prose(), 800, 0):
        assert item.document.count("The pass code of the ") == 4
        assert item.question.count("door") == 2


def test_plan_runs_the_full_cache_first_and_each_probe_where_it_matters():
    specs = plan(["m"], ["needle", "multiturn"], ["streaming", "criticalkv", "full-q4_0"], [0.1, 0.2],
                 ["question", "agnostic"], 3, 500)
    assert len({s.key for s in specs}) == len(specs)
    needle = [(s.method, s.budget, s.observation) for s in specs if s.task == "needle"]
    assert needle[:2] == [("full", 1.0, "-"), ("full-q4_0", 1.0, "-")]
    assert ("streaming", 0.1, "-") in needle and ("criticalkv", 0.2, "agnostic") in needle and len(needle) == 8
    chat = {(s.method, s.observation) for s in specs if s.task == "multiturn"}
    assert chat == {("full", "-"), ("full-q4_0", "-"), ("streaming", "-"), ("criticalkv", "chat")}


def test_methods_run_on_quantized_caches_as_method_at_cache():
    from kvlocal.eval.runner import (decode_observe, low_water, method_params, observe_every, prefill_observe, read_cells,
                                     split_method)

    assert split_method("criticalkv@kv-q8_0") == ("criticalkv", (8, 8), False)
    assert split_method("streaming@q4_0") == ("streaming", (2, None), False)
    assert split_method("full-kv-q4_0") == ("full", (2, 2), False) and split_method("snapkv") == ("snapkv", (None, None), False)
    assert split_method("criticalkv+recall") == ("criticalkv", (None, None), True)
    assert split_method("criticalkv+recall@kv-q8_0") == ("criticalkv", (8, 8), True)
    assert split_method("criticalkv+recall+every4@kv-q8_0") == ("criticalkv", (8, 8), True)
    assert [observe_every(m) for m in ("criticalkv", "criticalkv+every4", "snapkv+recall+every12@kv-q8_0")] == [1, 4, 12]
    # +l2 / +l1: CriticalKV's value norm, wherever CriticalKV is (the engine's method_params)
    assert split_method("criticalkv+l2+recall@kv-q8_0") == ("criticalkv", (8, 8), True)
    assert split_method("criticalkv+adakv+l2") == ("criticalkv+adakv", (None, None), False)
    # without one, the paper's L1 (not the engine's default): a name means what it meant in earlier records
    names = ("criticalkv", "criticalkv+l2+recall", "criticalkv+l1@kv-q8_0", "criticalkv+adakv", "snapkv+recall",
             "full-kv-q4_0")
    assert [method_params(m) for m in names] == [
        {"value_norm": "l1"}, {"value_norm": "l2"}, {"value_norm": "l1"}, {"value_norm": "l1"}, {}, {}]
    # +kept: decode-time events observed by the queries their tokens had (the engine's decode_observe)
    assert split_method("criticalkv+kept+l2+recall@kv-q8_0") == ("criticalkv", (8, 8), True)
    assert [decode_observe(m) for m in ("criticalkv", "snapkv+kept", "criticalkv+kept+recall@kv-q8_0")] == [
        "probe", "kept", "kept"]
    # +lowNN: a prompt's events leave NN% of the budget before its last (the engine's low_water)
    assert split_method("criticalkv+low60+recall@kv-q8_0") == ("criticalkv", (8, 8), True)
    assert [low_water(m) for m in ("criticalkv", "snapkv+low50", "criticalkv+recall+low75@kv-q8_0")] == [1.0, 0.5, 0.75]
    # +window: a prompt's events observed by their chunk's own last tokens (the engine's prefill_observe)
    assert split_method("criticalkv+l2+recall+low75+kept+window") == ("criticalkv", (None, None), True)
    assert [prefill_observe(m) for m in ("criticalkv+recall", "snapkv+window", "criticalkv+window+recall@kv-q8_0")] == [
        "probe", "window", "window"]
    # +whole: a long prompt read whole in a reading context, then compressed once (the engine's read_cells)
    assert split_method("criticalkv+l2+recall+whole+low75@kv-q8_0") == ("criticalkv", (8, 8), True)
    assert [read_cells(m) for m in ("criticalkv+recall", "criticalkv+recall+whole", "snapkv+whole@kv-q8_0")] == [
        0, None, None]
    for bad in ("full+whole", "criticalkv+window+every4", "streaming+window", "full+window", "full+low50", "criticalkv+low0", "criticalkv+low101", "full@kv-q8_0", "criticalkv@q3_k", "h2o@kv-q8_0", "kvslimmer+recall", "full+recall", "criticalkv+every0",
                "criticalkv+every4+recall", "snapkv+l2", "streaming+l1", "defensivekv+l2", "full+kept",
                "streaming+kept"):
        with pytest.raises(ValueError):
            split_method(bad)
    specs = plan(["m"], ["needle"], ["streaming@kv-q8_0", "criticalkv@kv-q8_0"], [0.1], ["question", "agnostic"], 0, 500)
    assert [(s.method, s.observation) for s in specs] == [
        ("full", "-"), ("streaming@kv-q8_0", "-"), ("criticalkv@kv-q8_0", "question"), ("criticalkv@kv-q8_0", "agnostic")]


def test_resume_skips_recorded_runs_and_a_torn_line(tmp_path):
    from kvlocal.eval.runner import done_keys, execute

    spec = plan(["m"], ["needle"], [], [], ["question"], 0, 400)[0]  # the full cache only
    out = tmp_path / "results.jsonl"
    out.write_text(json.dumps({"key": spec.key}) + "\n" + '{"key": "m|needle|snap')  # killed mid-line
    assert done_keys(out) == {spec.key}
    seen = []
    assert list(execute([spec], {}, out, "cmd", 1, progress=lambda s, skip: seen.append(skip))) == []
    assert seen == [True] and out.read_text().endswith("\n")


def test_text_is_real_and_not_repeated():
    pool = sentences()
    assert len(pool) > 250 and len(set(pool)) == len(pool)  # no sentence twice
    doc = "".join(_prose().take(2000, random.Random(0)))
    assert len(set(doc.split(". "))) > 0.95 * len(doc.split(". "))


def test_insert_and_score():
    assert insert_at(["A.", " B."], [(0.5, "X.")]) == "A. X. B."
    assert insert_at(["A.", " B."], [(0.0, "X.")]) == "X. A. B."
    item = Item("t", "n", "doc", "q", ["of this License, then"], kind="prefix")
    assert score(item, " of this license, then you") == 1.0
    assert score(item, " of this Act") == 0.5
    assert score(Item("t", "n", "d", "q", ["AB", "CD", "EF"], kind="recall"), "AB, EF") == pytest.approx(2 / 3)
    assert score(Item("t", "n", "d", "q", ["12345"]), " 12345.") == 1.0


@pytest.mark.slow(66)
def test_quick_eval_is_complete_sane_and_resumable(smollm2, tmp_path):
    out = tmp_path / "eval"
    # --quick's runs at one of its budgets (given options still apply): the suite's time, every code path
    r = run_cli("eval", "--quick", "--budgets", "0.1", "--out", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    specs = plan(QUICK["models"], QUICK["tasks"], QUICK["methods"], [0.1], ["question", "agnostic"], 0, QUICK["tokens"])
    assert sorted(r["key"] for r in records) == sorted(s.key for s in specs)
    full = {r["task"]: r for r in records if r["method"] == "full"}
    for rec in records:
        assert 0.0 <= rec["score"] <= 1.0
        assert len(rec["model_sha256"]) == 64 and rec["command"].startswith("kvlocal eval --quick")
        assert rec["seed"] == 0 and rec["seconds"] > 0 and len(rec["items"]) >= 1
        assert 300 <= rec["prompt_tokens"] <= 600
        assert rec["kv_bytes_measured"] and rec["kv_bytes_allocated"] > 0
        if rec["budget"] < 1:  # eviction: compressed, into no more cells than the full cache (fewer at 0.1;
            # at 0.2 of ~500 tokens both are 512 cells: the budget's 100 + chunk + window, padded to 256)
            f = full[rec["task"]]["kv_bytes_allocated"]
            assert rec["compression_events"] > 0
            assert rec["kv_bytes_allocated"] < f if rec["budget"] <= 0.1 else rec["kv_bytes_allocated"] <= f
        if rec["task"] == "continuation":
            assert rec["mean_kl"] >= 0
    assert full["continuation"]["score"] == 1.0 and full["continuation"]["mean_kl"] == pytest.approx(0, abs=1e-6)
    q8 = [r for r in records if r["method"] == "full-kv-q8_0"]
    assert q8 and all(r["kv_bytes_allocated"] < full[r["task"]]["kv_bytes_allocated"] for r in q8)
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == len(records) and all(row["loss"] != "" or float(row["full_score"] or 0) == 0 for row in rows)
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["smollm2-135m-budget.png", "smollm2-135m-bytes.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in pngs)
    assert "| criticalkv | 0.1 | question |" in (out / "summary.md").read_text()

    before = (out / "results.jsonl").read_text()
    again = run_cli("eval", "--quick", "--budgets", "0.1", "--out", str(out), timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "results.jsonl").read_text() == before
    assert "0 runs in" in again.stderr and f"{len(specs)} already done" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["--budgets", "1.5"], "--budgets 1.5"),
    (["--budgets", "abc"], "--budgets 'abc'"),
    (["--tasks", "nope"], "--tasks: unknown nope"),
    (["--methods", "h2o"], "--methods: unknown h2o"),
    (["--methods", "criticalkv@q3_k"], "--methods: unknown criticalkv@q3_k; choose from"),
    (["--tokens", "50"], "--tokens 50"),
    (["no-such-model"], "neither a known model"),
])
def test_eval_bad_input_is_one_line_exit_2(tmp_path, args, message):
    r = run_cli("eval", "--out", str(tmp_path / "e"), *args, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlocal: error:") and message in lines[0], r.stderr
    assert not (tmp_path / "e" / "results.jsonl").exists()


def test_targets_are_judged_from_the_records():
    from kvlocal.eval.report import targets, with_loss

    def rec(method, budget, task, score, kl=None, mib=10.0, obs="question"):
        r = {"model": "m", "task": task, "method": method, "budget": budget, "observation": obs, "seed": 1,
             "n_tokens": 1000, "score": score, "kv_bytes_allocated": int(mib * 2**20)}
        return r if kl is None else {**r, "mean_kl": kl}

    records = [rec("full", 1.0, "needle", 1.0, obs="-"), rec("full", 1.0, "continuation", 1.0, 0.0, obs="-"),
               rec("full-kv-q4_0", 1.0, "needle", 0.5, mib=8, obs="-"),
               rec("full-kv-q4_0", 1.0, "continuation", 0.6, 0.9, mib=8, obs="-")]
    for b, crit, snap in ((0.1, 0.8, 0.4), (0.2, 0.9, 0.6)):
        records += [rec("criticalkv", b, "needle", crit), rec("criticalkv", b, "continuation", crit, 0.2),
                    rec("snapkv", b, "needle", snap), rec("snapkv", b, "continuation", snap, 0.3),
                    rec("criticalkv@kv-q8_0", b, "needle", 1.0 if b == 0.1 else 0.0, mib=5),
                    rec("criticalkv@kv-q8_0", b, "continuation", 0.7, 0.4, mib=5)]
    text = targets(with_loss(records))
    # losses: criticalkv (0.2+0.2+0.1+0.1)/4 = 0.15, snapkv (0.6+0.6+0.4+0.4)/4 = 0.5
    assert "≤ ½ SnapKV's (budgets 0.1, 0.2): 0.15 vs 0.50 — **met**" in text
    assert "criticalkv@kv-q8_0 at 0.1 beats the q4_0 K+V full cache: KL 0.400 vs 0.900, retrieval 1.00 vs 0.50" in text
    assert "criticalkv@kv-q8_0 at 0.2 beats" in text and "retrieval 0.00 vs 0.50, 5.0 vs 8.0 MiB — **missed**" in text
    assert "lowest KL 0.400 (criticalkv@kv-q8_0 0.1) vs 0.900, best retrieval 1.00 vs 0.50 — **met**" in text


def test_generation_reads_its_tokens_then_forces_the_text_after_them():
    """generation: a document of about the asked length, then at least N_GENERATED tokens of the text that
    follows it (the next sentence: the forced text starts where the document stops)."""
    from kvlocal.eval.tasks import N_GENERATED

    prose = _prose()
    for n in (600, 2048, 4096):
        for seed in range(3):
            item = make_items("generation", prose, n, seed)[0]
            assert item.kind == "continuation" and item.question == ""
            assert n <= prose.count(item.document) <= n + 200 and prose.count(item.forced) >= N_GENERATED, (n, seed)
            whole = " ".join(prose.take(n + 2 * N_GENERATED, random.Random(f"generation:{seed}:{n}")))
            assert " ".join((item.document + item.forced).split()) == " ".join(whole.split())


def test_continuation_always_has_its_forced_tokens():
    """The cut before the forced text never leaves it short (it once left it empty after a long GPL
    sentence, at 4,096 tokens)."""
    prose = _prose()
    for n in (400, 1024, 2048, 4096):
        for seed in range(6):
            item = make_items("continuation", prose, n, seed)[0]
            assert prose.count(item.forced) >= 64, (n, seed)
