"""`kvlocal bench --frontier`, `--overhead` and `--recall-cost`: the configurations users choose between at long
context, compression's levers and the recall tier's cost, measured in one run
on the real SmolLM2 (short contexts here: the figures that matter are in docs/engine.md, from the same
command at 4K and 8K). What is asserted is measured: llama.cpp's own allocation, the engine's events."""

from __future__ import annotations

import json

import pytest

from conftest import assert_usage_error, run_cli


@pytest.mark.slow(22)
def test_frontier_measures_every_configuration(smollm2, tmp_path):
    plot = tmp_path / "frontier.png"
    r = run_cli("bench", str(smollm2), "--frontier", "--contexts", "300", "--decode", "2",
                "--json", "--plot", str(plot))
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["frontier"]
    assert [(x["tokens"], x["config"]) for x in rows] == [
        (300, c) for c in ("full", "full-kv-q8_0", "full-kv-q4_0", "criticalkv 0.1", "criticalkv@kv-q8_0 0.1")]
    kv = {x["config"]: x["kv_bytes"] for x in rows}
    # llama.cpp's allocations: q8_0 about half of F16, q4_0 about half of that; the budget's cache is smaller
    # than the full one, and smaller again on q8_0
    assert kv["full-kv-q4_0"] < kv["full-kv-q8_0"] < kv["full"]
    assert kv["criticalkv@kv-q8_0 0.1"] < kv["criticalkv 0.1"] < kv["full"]
    for x in rows:
        assert x["ttft"] > 0 and x["decode_tok_s"] > 0
        assert (x["events"] > 0) == x["config"].startswith("criticalkv")  # only the method compresses
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_frontier_refuses_contexts_past_the_trained_one(smollm2):
    assert_usage_error(run_cli("bench", str(smollm2), "--frontier", "--contexts", "100000"), "trained on 8,192")


@pytest.mark.slow(8)
def test_frontier_runs_the_configurations_asked_for(smollm2):
    r = run_cli("bench", str(smollm2), "--frontier", "--configs", "method@kv-q8_0", "full", "--contexts", "300",
                "--decode", "2", "--method", "snapkv", "--budget", "0.2", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["frontier"]
    assert [x["config"] for x in rows] == ["full", "snapkv@kv-q8_0 0.2"]  # the table's order, --method and --budget
    assert rows[1]["events"] > 0 and rows[1]["kv_bytes"] < rows[0]["kv_bytes"]
    assert_usage_error(run_cli("bench", str(smollm2), "--frontier", "--configs", "method"), "include full")
    assert_usage_error(run_cli("bench", str(smollm2), "--configs", "full"), "add --frontier")


@pytest.mark.slow(49)
def test_overhead_compares_the_levers_side_by_side(smollm2):
    """``--overhead``: each --backends × --chunks × --observe-every run reads the same prompt; observing once in
    three decodes the probe for fewer of the same events (the prompt's last one always), on either backend."""
    r = run_cli("bench", str(smollm2), "--overhead", "--long", "700", "--budget", "100", "--chunks", "64",
                "--observe-every", "1", "3", "--decode", "1", "--json", "--backends", "native", "state")
    assert r.returncode == 0, r.stderr
    full, *rows = json.loads(r.stdout)["overhead"]
    assert full["full"] and [(x["backend"], x["chunk"], x["observe_every"]) for x in rows] == [
        ("native", 64, 1), ("native", 64, 3), ("state", 64, 1), ("state", 64, 3)]
    for once, third in (rows[:2], rows[2:]):
        e = third["events"]
        assert once["events"] == e == rows[0]["events"] > 3 and once["moved"] == 0 and once["n_ctx"] == third["n_ctx"]
        # decoded for events 0, 3, 6, ... and for the prompt's last one, whatever its turn
        assert e - third["moved"] == len(range(0, e, 3)) + ((e - 1) % 3 > 0)
    assert all(x["kv_bytes"] < full["kv_bytes"] for x in rows)
    assert_usage_error(run_cli("bench", str(smollm2), "--overhead", "--chunks", "0"), "--chunks")


@pytest.mark.slow(12)
def test_overhead_compares_low_waters(smollm2):
    """``--low-waters 1 0.5``: the same prompt in the same cells, read with fewer events where they leave half the
    budget."""
    r = run_cli("bench", str(smollm2), "--overhead", "--long", "700", "--budget", "100", "--chunks", "64",
                "--observe-every", "1", "--decode", "1", "--json", "--backends", "state", "--low-waters", "1", "0.5")
    assert r.returncode == 0, r.stderr
    full, whole, half = json.loads(r.stdout)["overhead"]
    assert (whole["low_water"], half["low_water"]) == (1, 0.5) and whole["n_ctx"] == half["n_ctx"]
    assert whole["kv_bytes"] == half["kv_bytes"] < full["kv_bytes"]
    assert 1 < half["events"] < whole["events"]


@pytest.mark.slow(12)
def test_overhead_compares_reading_whole(smollm2):
    """``--read-cells 0 whole``: the same prompt in the same device cells, read chunk by chunk or whole in a reading
    context in host memory (one event), whose bytes the row reports."""
    r = run_cli("bench", str(smollm2), "--overhead", "--long", "700", "--budget", "100", "--chunks", "64",
                "--observe-every", "1", "--decode", "1", "--json", "--backends", "state", "--recall", "on",
                "--read-cells", "0", "whole")
    assert r.returncode == 0, r.stderr
    full, chunked, whole = json.loads(r.stdout)["overhead"]
    assert (chunked["read_cells"], whole["read_cells"]) == (0, None) and whole["n_ctx"] == chunked["n_ctx"]
    assert whole["kv_bytes"] == chunked["kv_bytes"] < full["kv_bytes"]
    assert whole["events"] == 1 < chunked["events"] and chunked["reading_bytes"] == 0
    assert whole["kv_bytes"] < whole["reading_bytes"] <= full["kv_bytes"]


@pytest.mark.slow(16)
def test_overhead_compares_the_probe_with_the_chunks_window(smollm2):
    """``--prefill-observe probe window``: the probe decoded (once in 1 and in 3 events) and each event before the
    prompt's last scored by its chunk's own window (one row: no decode to spread), the same events; refused without
    ``--overhead``."""
    r = run_cli("bench", str(smollm2), "--overhead", "--long", "700", "--budget", "100", "--chunks", "64",
                "--observe-every", "1", "3", "--decode", "1", "--json", "--backends", "state",
                "--prefill-observe", "probe", "window")
    assert r.returncode == 0, r.stderr
    full, every1, every3, window = json.loads(r.stdout)["overhead"]
    assert [x["prefill_observe"] for x in (every1, every3, window)] == ["probe", "probe", "window"]
    e = window["events"]
    assert every1["events"] == every3["events"] == e > 3 and window["observe_every"] is None
    assert every1["windows"] == every3["windows"] == 0 and window["windows"] == e - 1 and window["moved"] == 0
    assert_usage_error(run_cli("bench", str(smollm2), "--prefill-observe", "window"), "add --overhead")


@pytest.mark.slow(12)
def test_overhead_with_the_recall_tier(smollm2, smollm2_model):
    """``--recall on``: the compressed runs keep a recall tier, as ``kvlocal chat`` does by default (so the engine's
    low water is the tier's); refused with ``--recall-cost``, which always reads with one. ``--probes question
    generic``: the prompt's last 32 tokens as its question, then read as a chat reads a document (the engine's
    generic probe scores it). With the tier the question's run reads the prompt as ``kvlocal run`` does (its question
    re-selects the cache before its own tokens are decoded: no event of its own at the end), the generic one as a
    chat reads a document (nothing re-selects yet)."""
    from kvlocal.engine import AGNOSTIC_PROBE, LOW_WATER

    r = run_cli("bench", str(smollm2), "--overhead", "--long", "700", "--budget", "100", "--chunks", "64",
                "--observe-every", "1", "--decode", "1", "--json", "--backends", "state", "--recall", "on",
                "--probes", "question", "generic")
    assert r.returncode == 0, r.stderr
    full, question, generic = json.loads(r.stdout)["overhead"]
    for row in (question, generic):
        assert row["recall"] and row["host_tier_bytes"] > 0 and row["low_water"] == LOW_WATER
    assert question["events"] > 1 and generic["events"] > 1 and question["probe_tokens"] == 32
    assert question["reselect_seconds"] > 0 == generic["reselect_seconds"]
    generic_tokens = len(smollm2_model.tokenize(AGNOSTIC_PROBE, add_special=False))
    assert (generic["probe"], generic["probe_tokens"]) == ("generic", generic_tokens) and generic_tokens < 32
    assert_usage_error(run_cli("bench", str(smollm2), "--recall-cost", "--recall", "on"), "leave --recall out")
    assert_usage_error(run_cli("bench", str(smollm2), "--probes", "generic"), "add --overhead")


@pytest.mark.slow(13)
def test_overhead_compares_the_value_norms(smollm2):
    """``--value-norms l1 l2``: CriticalKV with the paper's L1 norms and with L2 (through W_O's d x d factor) on the
    same prompt and events; refused without ``--overhead`` and for a method without value norms."""
    r = run_cli("bench", str(smollm2), "--overhead", "--long", "700", "--budget", "100", "--chunks", "64",
                "--observe-every", "3", "--decode", "1", "--json", "--backends", "state", "--value-norms", "l1", "l2")
    assert r.returncode == 0, r.stderr
    full, *rows = json.loads(r.stdout)["overhead"]
    assert [x["value_norm"] for x in rows] == ["l1", "l2"] and rows[0]["events"] == rows[1]["events"] > 3
    assert all(x["kv_bytes"] == rows[0]["kv_bytes"] < full["kv_bytes"] for x in rows)
    assert_usage_error(run_cli("bench", str(smollm2), "--value-norms", "l2"), "add --overhead")
    assert_usage_error(run_cli("bench", str(smollm2), "--low-waters", "0.5"), "add --overhead")
    assert_usage_error(run_cli("bench", str(smollm2), "--overhead", "--low-waters", "0"), "--low-waters")
    assert_usage_error(run_cli("bench", str(smollm2), "--overhead", "--method", "snapkv", "--value-norms", "l2"),
                       "snapkv has no value norm")


@pytest.mark.slow(35)
def test_recall_cost_counts_the_question_and_the_answer_steps(smollm2):
    """``--recall-cost``: a document read with recall on, one question, then an answer whose first tokens
    re-select too and that goes on past the room the question left it; the seconds of all three against the prefill,
    and what crossed. ``--step-confidence 1 0`` side by
    side: at 1 every step swaps, at 0 every step keeps its decode (no step time, no rows in after the question's);
    each with ``--decode-observe probe kept``: the compression back to the budget decodes its probe, or not."""
    r = run_cli("bench", str(smollm2), "--recall-cost", "--contexts", "600", "--backends", "state", "--json",
                "--step-confidence", "1", "0", "--decode-observe", "probe", "kept")
    assert r.returncode == 0, r.stderr
    swapping, swapping_kept, confident, confident_kept = json.loads(r.stdout)["recall"]
    for row in (swapping, swapping_kept, confident, confident_kept):
        assert row["tokens"] == 600 and row["backend"] == "state" and row["compression_events"] > 0
        assert 0 < row["steps"] <= 16 < row["answer_tokens"]  # an end-of-generation token is not a step
        # the question left the answer 64 cells past the rows it brought back; the answer outgrew them and a
        # compression returned the cache to the budget: counted in the turn's cost
        assert row["answer_tokens"] > 64 and row["back_seconds"] > 0
        assert 0 < row["back_observe_seconds"] < row["back_seconds"]  # its probe decode, or the kept queries turned
        # --decode-observe kept: that compression was observed by the queries its tokens had, not a probe decode
        assert (row["back_kept"] > 0) == (row["decode_observe"] == "kept")
        assert row["question_seconds"] > 0 and row["prefill_seconds"] > 0 and 0 < row["question_share"] < row["share"]
        assert row["rows_in"] > 0 and row["candidates"] > 0 and row["host_tier_bytes"] > 0
    assert (swapping["step_confidence"], confident["step_confidence"]) == (1, 0)
    assert swapping["step_every"] == confident["step_every"] == 1  # the default: any step may swap
    assert swapping["confident_steps"] == 0 < swapping["step_seconds"]
    assert confident["confident_steps"] == confident["steps"] and confident["step_seconds"] == 0
    assert confident["rows_in"] < swapping["rows_in"]  # only the question brought rows back
    for probe, kept in ((swapping, swapping_kept), (confident, confident_kept)):
        assert (probe["decode_observe"], kept["decode_observe"]) == ("probe", "kept")
        assert kept["back_observe_seconds"] < probe["back_observe_seconds"]  # queries turned, not 32 tokens decoded
    assert_usage_error(run_cli("bench", str(smollm2), "--recall-cost", "--step-confidence", "1.5"), "--step-confidence")
    assert_usage_error(run_cli("bench", str(smollm2), "--recall-cost", "--step-every", "0"), "--step-every")


@pytest.mark.slow(50)
def test_backends_side_by_side_on_a_quantized_cache(smollm2):
    """`kvlocal bench --cache q8_0`: the full q8_0 cache against the method on it on both backends (patches 0009, 0010);
    native copies no K/V to the host, state reads the cache out and back at every event."""
    r = run_cli("bench", str(smollm2), "--long", "600", "--decode", "2", "--budget", "100", "--cache", "q8_0",
                "--backends", "native", "state", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    native, state = out["backends"]["native"], out["backends"]["state"]
    assert native["run"]["backend"] == "native" and state["run"]["backend"] == "state"
    assert native["run"]["compression_events"] == state["run"]["compression_events"] > 0
    assert native["run"]["kv_bytes_allocated"] == state["run"]["kv_bytes_allocated"] < out["full"]["kv_bytes_allocated"]
    assert native["host_kv_bytes"] == 0 < state["host_kv_bytes"]
    f16 = run_cli("bench", str(smollm2), "--long", "600", "--decode", "2", "--budget", "100", "--backends", "state",
                  "--json")
    assert json.loads(f16.stdout)["full"]["kv_bytes_allocated"] > out["full"]["kv_bytes_allocated"]  # q8_0: fewer bytes
    assert_usage_error(run_cli("bench", str(smollm2), "--cache", "q3_k"), "--cache")
    for mode in ("--frontier", "--recall-cost", "--overhead"):  # they run on f16: refused, not ignored
        assert_usage_error(run_cli("bench", str(smollm2), mode, "--cache", "q8_0"), mode)


@pytest.mark.slow(8)
def test_an_option_without_the_mode_that_reads_it_is_refused(smollm2):
    """Every option only some modes read is refused without one of them, naming the mode to add: the plain side by
    side ran a whole 8K bench with ``--contexts 10`` ignored. Refused before the model is read (no run starts)."""
    from kvlocal.cli.bench import MODE_OPTIONS

    given = {"--contexts": ["300"], "--configs": ["full"], "--plot": ["x.png"], "--step-confidence": ["1"],
             "--step-every": ["2"], "--decode-observe": ["probe"], "--chunks": ["64"], "--observe-every": ["2"],
             "--low-waters": ["0.5"], "--probes": ["generic"], "--prefill-observe": ["window"], "--value-norms": ["l1"], "--read-cells": ["whole"]}
    assert set(given) == set(MODE_OPTIONS)
    for flag, values in given.items():
        modes = MODE_OPTIONS[flag]
        assert_usage_error(run_cli("bench", str(smollm2), flag, *values), f"add {' or '.join(modes)}")
        other = next(m for m in ("--frontier", "--recall-cost", "--overhead") if m not in modes)  # another mode
        assert_usage_error(run_cli("bench", str(smollm2), other, flag, *values), f"{flag} is an option of")
