"""``kvlocal doctor --plan``: each machine's weights and KV cache, computed from the GGUF header, against what
llama.cpp allocates for the same settings (kvlocal/cli/plan.py)."""

from __future__ import annotations

import pytest

from conftest import assert_usage_error, run_cli
from kvlocal.cli.plan import layer_devices, plan

N_CTX = 4096


def test_layers_go_where_llama_cpp_puts_them():
    # llama_model::load_tensors: the first n_layer + 1 - ngl layers stay; the rest (the output is layer n_layer) by the
    # devices' cumulative shares, a layer at the boundary to the next device
    assert layer_devices(4, 0, [1.0]) == [-1] * 5
    assert layer_devices(4, 3, [1.0, 1.0]) == [-1, -1, 0, 0, 1]
    assert layer_devices(4, -1, [3.0, 1.0]) == [0, 0, 0, 0, 1]
    assert layer_devices(4, 99, []) == [-1] * 5  # no device: everything here


@pytest.mark.parametrize("model", ["smollm2_model", "gemma3_model"])
def test_the_plans_kv_is_what_llama_cpp_allocates(model, request):
    """The plan's KV bytes — the whole context, and the budget's context — equal the buffers llama.cpp allocates for
    the full cache and for a default CriticalKV engine (measured: ``llama_memory_buffer_size``); Gemma 3's sliding
    layers hold their window either way."""
    from kvlocal.engine import Engine

    m = request.getfixturevalue(model)
    (share,) = plan(m.path, N_CTX, "0.1", 0, [])
    measured = {}
    for method in ("full", "criticalkv"):
        eng = Engine(m, "0.1", method, max_tokens=N_CTX, chunk=128, recent=32)
        try:
            assert eng.stats.kv_bytes_measured
            measured[method] = eng.stats.kv_bytes_allocated
        finally:
            eng.close()
    assert (share.kv_full, share.kv_budget) == (measured["full"], measured["criticalkv"])
    assert share.layers == list(range(m.arch.n_layer + 1))


def test_doctor_prints_the_plan_and_refuses_a_bad_split(smollm2):
    r = run_cli("doctor", "--plan", str(smollm2), "-c", "32768", "--budget", "0.1", "-ngl", "20",
                "--rpc", "127.0.0.1:1,127.0.0.1:2", "-ts", "1,1")
    out = r.stdout
    assert r.returncode in (0, 1), r.stderr  # (1: a server of --rpc cannot be reached; the plan asks none)
    assert "this machine: layers 0-10:" in out and "127.0.0.1:2: layers 21-29 + output:" in out, out
    assert "with the budget" in out
    assert_usage_error(run_cli("doctor", "--plan", str(smollm2), "-ts", "x"), "--tensor-split")
