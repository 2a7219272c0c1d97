"""The engine never silently wrong: a rewrite is all or nothing, a lost cache stops it, decode-time events are
scored by the question and the reply, the W_O cache is bounded, bad arguments are refused, and Ctrl-C is a clean
stop at any graph node or plan (counted, not timed) — on the real llama.cpp and SmolLM2-135M."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from kvlocal.engine import Engine
from kvlocal.errors import UsageError
from kvlocal.runtime import Context
from kvlocal.runtime import state as state_mod
from kvlocal.runtime.state import CacheLost, read_seq, write_seq
from kvlocal.eval.tasks import sample_text

THREADS = 2


@pytest.fixture(scope="module")
def prose():
    return sample_text()


def test_failed_rewrite_restores_the_previous_cells(smollm2_model, prose, monkeypatch):
    m = smollm2_model
    toks = m.tokenize(prose)[:120]
    ctx = Context(m, n_ctx=256, n_threads=THREADS)
    ctx.decode(toks[:-1], range(len(toks) - 1), "none")
    ref = Context(m, n_ctx=256, n_threads=THREADS)
    ref.decode(toks[:-1], range(len(toks) - 1), "none")
    want = ref.decode([toks[-1]], [len(toks) - 1])
    kv = read_seq(ctx)
    good = state_mod.build_blob
    monkeypatch.setattr(state_mod, "build_blob", lambda kv, pos=None, **kw: good(kv, pos, **kw)[:-100])  # llama.cpp refuses it
    with pytest.raises(RuntimeError, match="previous cells were loaded back"):
        write_seq(ctx, kv.select(np.arange(50)))
    monkeypatch.setattr(state_mod, "build_blob", good)
    assert len(ctx.cells()[0]) == len(toks) - 1
    np.testing.assert_array_equal(ctx.decode([toks[-1]], [len(toks) - 1]), want)


@pytest.mark.parametrize("io", ["blob", "view"])
def test_lost_cache_stops_the_engine(smollm2_model, prose, monkeypatch, io):
    """llama.cpp refuses the rewritten cells: through the blob, and even its previous cells; in place, the
    positions after the rows were moved (kvlocal.runtime.hostview)."""
    m = smollm2_model
    toks = m.tokenize(prose)[:400]
    monkeypatch.setenv("KVLOCAL_STATE_IO", io)
    eng = Engine(m, 64, max_tokens=1000, chunk=64, n_threads=THREADS)
    assert eng.kv.in_place == (io == "view")

    def refuse(*args, **kwargs):
        raise (RuntimeError if io == "blob" else ValueError)("refused")

    if io == "blob":
        monkeypatch.setattr(state_mod, "set_blob", refuse)
    else:
        monkeypatch.setattr(type(eng.ctx), "compact", refuse)
    with pytest.raises(CacheLost):
        eng.prefill(toks)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="lost its cache"):
        eng.prefill(toks[:10])
    with pytest.raises(RuntimeError, match="lost its cache"):
        next(eng.generate(1))


@pytest.mark.slow(7)
def test_decode_time_events_are_scored_by_the_question_and_the_reply(smollm2_model, prose):
    """Decode-time events score the cache with the question's last half-window followed by the reply's
    last half-window (docs/engine.md), so a long reply is judged by what it says now too."""
    m = smollm2_model

    class Recording(Engine):
        def _compress(self, probe, observed=None, decoding=False, **kwargs):
            self.seen.append((list(probe), list(self._reply)))
            super()._compress(probe, observed, decoding, **kwargs)

    eng = Recording(m, 96, max_tokens=1200, chunk=64, recent=16, n_threads=THREADS)
    eng.seen = []
    q = m.tokenize("\n\nWho wrote this text, and what is it about? Answer at length.\n", add_special=False)
    eng.prefill(m.tokenize(prose)[:300] + q, probe=q)
    n_prefill = len(eng.seen)
    reply = list(eng.generate(400, stop_at_eog=False))
    decode_events = eng.seen[n_prefill:]
    assert n_prefill >= 1 and len(decode_events) >= 2 and len(reply) == 400
    assert all(probe == q[-16:] for probe, _ in eng.seen[:n_prefill])
    for probe, reply_then in decode_events:
        assert len(reply_then) >= 8 and probe == q[-8:] + reply_then[-8:]
    assert eng.last_probe == decode_events[-1][0]


def test_wo_cache_is_bounded_and_reported(smollm2, smollm2_model, prose):
    """CriticalKV's dequantized W_O is kept per layer in a bounded cache — the first layers that fit, not the most
    recent: an event reads the layers in order, and a pass over every layer twice hits the kept ones the second time
    (a least-recently-used cache would hit none) — its factors for L2 norms for every layer (W_O is not read again
    for them); the engine reports their bytes."""
    from kvlocal.compress.criticalkv import l2_factor
    from kvlocal.backends.weights import OutputProjections, output_projections
    from kvlocal.models.gguf_file import dequantize_tensor, read_gguf

    one = 576 * 576 * 4  # SmolLM2: W_O is [576, 576] float32
    wo = OutputProjections(str(smollm2), max_bytes=3 * one)
    for il in range(smollm2_model.n_layer):
        assert wo[il].shape == (576, 576)
        assert wo.nbytes <= 3 * one
    assert wo.nbytes == 3 * one and sorted(wo._cache) == [0, 1, 2]  # the first three
    assert [wo[il] is wo[il] for il in range(smollm2_model.n_layer)] == [True] * 3 + [False] * 27  # hits, the rest read
    tensor = next(t for t in read_gguf(smollm2).tensors if t.name == "blk.3.attn_output.weight")
    np.testing.assert_array_equal(wo[3], dequantize_tensor(tensor, smollm2))  # dequantized again on demand
    hq, factor = smollm2_model.n_head, 64 * 576 * 4  # a factor is [d, Hq*d] float32
    factors = [wo.l2_factor(il, hq) for il in range(smollm2_model.n_layer)]
    held = list(wo._cache)
    assert all(wo.l2_factor(il, hq) is f for il, f in enumerate(factors)) and list(wo._cache) == held
    np.testing.assert_array_equal(factors[3], l2_factor(dequantize_tensor(tensor, smollm2), hq))
    assert wo.nbytes == 3 * one + 30 * factor
    fresh = OutputProjections(str(smollm2), max_bytes=3 * one)  # a factor made first keeps no W_O: L2 never reads it
    assert fresh.l2_factor(3, hq).shape == factors[3].shape and fresh.nbytes == factor and not fresh._cache
    shared = output_projections(str(smollm2_model.path))  # the process's, which engines share
    held = shared._wo_bytes()  # (an earlier L1 engine's W_O in this process would be there)
    eng = Engine(smollm2_model, 64, max_tokens=600, chunk=64, n_threads=THREADS)
    eng.prefill(smollm2_model.tokenize(prose)[:300])
    s = eng.stats
    # the engine's L2 norms (the default) read the factors, made with the engine for every layer, and keep no W_O
    assert s.compression_events >= 1 and eng._wo is shared and s.wo_cache_bytes == shared.nbytes
    assert sorted(shared._factors) == [(il, hq) for il in range(30)] and shared._wo_bytes() == held
    assert shared.nbytes - held == 30 * factor
    assert 0 < s.host_bytes_peak < 4 * s.kv_bytes_allocated


def test_bench_wo_times_both_ways_on_a_generated_model():
    """tools/bench_wo (the W_O work of L2 value norms an event asks for) runs on the code as it is, on a GGUF it
    writes itself: one row per way, one figure per event, the W_O cache smaller than the layers' W_O."""
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "tools.bench_wo", "--layers", "6", "--dim", "256", "--heads", "4",
                        "--events", "2", "--cache-mib", "0.5"], cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    head, *rows = r.stdout.splitlines()
    assert head.startswith("6 layers, W_O 256 x 256 Q4_0, 4 query heads, W_O cache 0.5 MiB (2 MiB"), r.stdout
    assert [row.split("  ")[1].split(" (")[0] for row in rows] == ["through W_O", "factors kept"], r.stdout
    assert all(len(row.split(")")[-1].split()) == 2 for row in rows), r.stdout


@pytest.mark.parametrize("kwargs, message", [
    ({"recent": 0}, "recent must be a whole number >= 1"),
    ({"chunk": 0}, "chunk must be a whole number >= 1"),
    ({"n_sink": -1}, "n_sink must be a whole number >= 0"),
    ({"recent": 2.5}, "recent must be a whole number"),
    ({"max_tokens": 0}, "max_tokens must be a whole number >= 1"),
    ({"recent": 400}, "recent 400 is too large"),
    ({"budget": "lots"}, "is not a number"),
    ({"budget": 10}, "below the floor"),
    ({"method": "magic"}, "unknown compression method"),
])
def test_engine_validates_its_arguments(smollm2_model, kwargs, message):
    args = {"budget": 0.1, "max_tokens": 1000, **kwargs}
    with pytest.raises(UsageError, match=message):
        Engine(smollm2_model, **args)


def test_empty_prompt_and_generate_before_prefill_are_errors(smollm2_model):
    eng = Engine(smollm2_model, 0.5, max_tokens=256, n_threads=1)
    with pytest.raises(UsageError, match="prefill a prompt"):
        next(eng.generate(1))
    with pytest.raises(UsageError, match="prompt is empty"):
        eng.prefill([])
    assert eng.n_past == 0 and eng.stats.kv_cells_live == 0


def _on_calls(monkeypatch, note) -> None:
    """Call ``note(where)`` at each point of the Ctrl-C test's prefill it counts, in engines made after this:
    ``"node"``, each graph node llama.cpp asks the engine's eval callback about (inside llama.cpp's compute), and
    ``"plan"``, each compression event's scoring (Python)."""
    from kvlocal.runtime import QueryCapture

    from kvlocal.engine.compressor import Compressor

    callback, plan = QueryCapture.callback, Compressor.plan

    def counted_callback(self, t, ask, user_data):
        note("node")
        return callback(self, t, ask, user_data)

    def counted_plan(self, *args, **kwargs):
        note("plan")
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(QueryCapture, "callback", counted_callback)
    monkeypatch.setattr(Compressor, "plan", counted_plan)


def _ctrl_c_engine(m) -> Engine:
    return Engine(m, 128, max_tokens=4000, chunk=64, n_threads=THREADS)


@pytest.fixture(scope="module")
def ctrl_c_prefill_calls(smollm2_model, prose) -> dict[str, int]:
    """How many of each point (:func:`_on_calls`) the Ctrl-C test's prefill passes uninterrupted: the signals are
    sent at fractions of these counts, so that they land inside the prefill whatever the machine's speed."""
    counts = {"node": 0, "plan": 0}

    def note(where):
        counts[where] += 1

    with pytest.MonkeyPatch.context() as mp:
        _on_calls(mp, note)
        _ctrl_c_engine(smollm2_model).prefill(smollm2_model.tokenize(prose)[:1000])
    return counts


@pytest.fixture
def python_sigint():
    """SIGINT handled by Python's own handler, as a terminal gives it, for the test's length: a background job of
    a non-interactive shell (nohup, some CI runners) starts with SIGINT ignored, and a signal sent outside the
    engine's decode would then be lost (the chat sets this handler itself: cli/repl.py)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("where, at", [("node", 0.1), ("node", 0.4), ("node", 0.7), ("plan", 0.5)])
@pytest.mark.slow(27)
def test_ctrl_c_is_a_clean_stop(smollm2_model, prose, ctrl_c_prefill_calls, monkeypatch, python_sigint, where, at):
    """A real SIGINT (as Ctrl-C sends) at some point of a prefill with compression — inside llama.cpp (from the
    eval callback, at a fraction of the graph nodes the prefill computes) or in Python (a compression event's
    scoring) — stops it with KeyboardInterrupt and leaves the engine consistent: llama.cpp holds exactly the
    positions below n_past, no probe cells, and the next prefill continues from there."""
    m = smollm2_model
    toks = m.tokenize(prose)[:1000]
    target = max(1, int(at * ctrl_c_prefill_calls[where]))
    seen, sent = {"node": 0, "plan": 0}, []

    def note(w):
        seen[w] += 1
        if w == where and seen[w] == target:
            sent.append(signal.getsignal(signal.SIGINT))  # the handler the signal meets
            os.kill(os.getpid(), signal.SIGINT)

    _on_calls(monkeypatch, note)
    eng = _ctrl_c_engine(m)
    try:
        eng.prefill(toks)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    assert sent, f"the prefill passed {seen} points, {where} {target} not among them ({ctrl_c_prefill_calls} before)"
    if not interrupted:  # say what the signal met, to find why
        status = dict(line.split(":\t") for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
        pytest.fail(f"the SIGINT sent at {where} {target} was lost: the prefill ran to its end without "
                    f"KeyboardInterrupt; SIGINT's handler then: {sent[0]!r}, now: {signal.getsignal(signal.SIGINT)!r}; "
                    f"SigIgn {status.get('SigIgn')}, SigBlk {status.get('SigBlk')}")
    cells, pos = eng.ctx.cells()
    assert len(cells) == eng.stats.kv_cells_live
    assert eng.n_past == 0 or pos.max() == eng.n_past - 1
    assert len(np.unique(pos)) == len(pos) and eng.capture.armed is False
    n = eng.n_past
    print(f"SIGINT at {where} {target}: stopped at position {n} of {len(toks)}, {eng.stats.compression_events} events, "
          f"{len(cells)} cells")
    rest = toks[n:]
    eng.prefill(rest)
    assert eng.n_past == len(toks) == eng.ctx.pos_max() + 1
    assert len(eng.ctx.cells()[0]) == eng.stats.kv_cells_live <= eng.ctx.n_ctx
