"""A long turn read whole (kvlocal.engine.reading, ``Engine(read_cells=)``): the rows it leaves are the full cache's —
every key and value computed over all that came before it — where a turn read in the budget's context drifts; the
budget's context is the same one before and after (its cells, its bytes); a capped reading context reads in fewer,
larger events; a reading undone or interrupted leaves the engine that never read it. Tiny generated models (the
mechanics), on both backends; then Qwen2.5-Coder-0.5B, where the drift is what issue 61 measured."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "reference"))  # tiny_gguf

import tiny_gguf  # noqa: E402

from test_undo import continue_alike, differences, twins  # noqa: E402
from kvlocal.engine import Engine  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.eval.tasks import sample_text  # noqa: E402
from kvlocal.runtime import Context, Model, Sampler  # noqa: E402
from kvlocal.runtime.state import read_seq  # noqa: E402

THREADS = 2
N_TURN = 420  # tokens of the turn: longer than the free cells of the budget's context (64 + 32 + 16, padded to 256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Model:
    return Model(tiny_gguf.write_tiny(tmp_path_factory.mktemp("reading") / "llama.gguf", arch="llama", head_dim=64))


@pytest.fixture(scope="module")
def tokens(tiny) -> list[int]:
    return tiny.tokenize(sample_text(), add_special=False)[:1200]


def rows_against_full(e: Engine, full: Engine) -> np.ndarray:
    """Per compressed layer, the largest relative difference between a live row of ``e`` (K or V) and the full
    cache's row of the same token."""
    ref, kv = read_seq(full.ctx), read_seq(e.ctx)
    at = {int(p): j for j, p in enumerate(ref.pos)}
    true = e.kv.record.rows(kv.pos.astype(np.int64))[0]  # [n_layer, Hkv, n]
    out = []
    for i in range(len(kv.k)):
        worst = 0.0
        for h in range(true.shape[1]):
            for c, t in enumerate(true[i, h]):
                if t < 0:
                    continue
                for mine, theirs in ((kv.k[i][c, h], ref.k[i][at[int(t)], h]), (kv.v[i][c, h], ref.v[i][at[int(t)], h])):
                    a, b = mine.astype(np.float32), theirs.astype(np.float32)
                    worst = max(worst, float(np.abs(a - b).max() / (np.abs(b).max() + 1e-6)))
        out.append(worst)
    return np.array(out)


def engine(model: Model, backend: str, read_cells, **kw) -> Engine:
    return Engine(model, 64, "criticalkv", max_tokens=1200, chunk=32, recent=16, n_threads=THREADS, recall=True,
                  backend=backend, low_water=1.0, read_cells=read_cells, **kw)


@pytest.mark.parametrize("backend", ["state", "native"])
def test_a_turn_read_whole_leaves_the_full_caches_rows_in_the_same_context(tiny, tokens, backend):
    turn = tokens[:N_TURN]
    full = Engine(tiny, "1", "full", max_tokens=1200, n_threads=THREADS)
    full.prefill(turn)
    chunked, whole = engine(tiny, backend, 0), engine(tiny, backend, None)
    for e in (chunked, whole):
        e.prefill(turn, probe=turn[-16:])
    # the budget's context, before and after: the same cells and bytes, and it holds the budget
    assert whole.ctx.n_ctx == chunked.ctx.n_ctx < N_TURN
    assert whole.stats.kv_bytes_allocated == chunked.stats.kv_bytes_allocated
    assert whole.live_cells() <= whole.budget_cells and whole.n_past == chunked.n_past == N_TURN
    assert whole.stats.kv_cells_live_peak <= whole.ctx.n_ctx
    # read whole: one context, one event; the budget's context read it in many
    assert whole.stats.reading_contexts == 1 and whole.stats.compression_events == 1
    assert chunked.stats.reading_contexts == 0 and chunked.stats.compression_events > 1
    assert whole.stats.reading_bytes_peak > whole.stats.kv_bytes_allocated
    assert whole.tier.n_rows > 0  # what the event dropped waits on the host, as any event's
    # every row it holds is the full cache's; the chunked reading's later rows were computed over what it kept
    drift_whole, drift_chunked = rows_against_full(whole, full), rows_against_full(chunked, full)
    print("largest relative difference by layer, whole:", drift_whole.round(4), "chunked:", drift_chunked.round(4))
    assert drift_whole.max() < 2e-3
    assert drift_chunked[1:].min() > 10 * max(drift_whole.max(), 1e-4)  # (layer 0 reads no attention output)
    # and it goes on: a question, an answer
    whole.append(tokens[N_TURN:N_TURN + 24], question=True)
    assert len(list(whole.generate(8, Sampler(), stop_at_eog=False))) == 8
    assert whole.live_cells() <= whole.ctx.n_ctx


def test_a_sliding_window_model_reads_whole_too(tmp_path):
    """Gemma 3's iSWA memory: the sliding-window cache moves with the full-attention layers' cells (the sequence
    state's tail, which llama.cpp refuses to load where its layout differs); the rows kept are the full cache's,
    and the engine decodes on."""
    model = Model(tiny_gguf.write_tiny(tmp_path / "gemma3.gguf", arch="gemma3", head_dim=64, n_swa=16, swa_pattern=3))
    turn = model.tokenize(sample_text(), add_special=False)[:N_TURN]
    full = Engine(model, "1", "full", max_tokens=1200, n_threads=THREADS)
    full.prefill(turn)
    whole = engine(model, "state", None)
    whole.prefill(turn, probe=turn[-16:])
    assert whole.stats.reading_contexts == 1 and whole.stats.compression_events == 1
    assert rows_against_full(whole, full).max() < 2e-3
    assert whole.live_cells() <= whole.budget_cells and np.array_equal(whole.logits, full.logits)  # (read exactly)
    assert len(list(whole.generate(8, Sampler(), stop_at_eog=False))) == 8 and whole.n_past == N_TURN + 8


def test_a_capped_reading_context_reads_in_fewer_larger_events(tiny, tokens):
    turn = tokens[:900]
    runs = {cells: engine(tiny, "state", cells) for cells in (0, 400)}
    for e in runs.values():
        e.prefill(turn, probe=turn[-16:])
    chunked, capped = runs[0], runs[400]
    assert capped.stats.reading_contexts == 1 and capped.ctx.n_ctx == chunked.ctx.n_ctx
    assert 1 < capped.stats.compression_events < chunked.stats.compression_events
    assert capped.live_cells() <= capped.budget_cells and capped.n_past == len(turn)
    # a turn that fits the free cells, or a cap no larger than the budget's context, needs no reading context
    small = engine(tiny, "state", None)
    small.prefill(tokens[:40])
    low = engine(tiny, "state", 128)
    low.prefill(turn, probe=turn[-16:])
    assert small.stats.reading_contexts == low.stats.reading_contexts == 0
    # nor a turn whose positions move back while it is read (an endless session past the trained context)
    endless = engine(tiny, "state", None, endless=True)
    endless.position_limit = 600
    endless.prefill(turn, probe=turn[-16:])
    assert endless.stats.reading_contexts == 0 and endless.stats.repositions > 0


@pytest.mark.parametrize("backend", ["state", "native"])
def test_a_turn_read_whole_undone_or_interrupted_leaves_the_engine_that_never_read_it(tiny, tokens, backend):
    a, b = twins(tiny, tokens, 200, recall=True, backend=backend, read_cells=None)
    turn = tokens[300:300 + N_TURN]
    mark = a.mark()
    a.append(turn, probe=turn[-16:], question=True)
    # the mark kept the cells the reading replaced: a copy of the budget's cells (with a tier, the only K/V it copies)
    assert a.stats.reading_contexts == 1 and mark.cells is not None
    assert a.stats.rollback_copies == 1 and 0 < a.stats.rollback_bytes <= a.stats.kv_bytes_allocated
    list(a.generate(6, Sampler(), stop_at_eog=False))
    a.undo(mark)
    assert differences(a, b) == []
    # interrupted while it reads: the budget's context is the engine's again, as it was
    n_ctx = a.ctx.n_ctx
    mark = a.mark()

    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        a.append(turn, probe=turn[-16:], progress=stop, question=True)
    assert a.ctx.n_ctx == n_ctx and a.cells.ctx is a.ctx and a.kv.ctx is a.ctx
    a.undo(mark)
    assert differences(a, b) == []
    continue_alike(a, b, tokens[800:840])


def test_a_reading_context_llama_cpp_cannot_allocate_reads_in_the_budgets_context(tiny, tokens, monkeypatch):
    """Where the host has no memory for it (Context raises what it raises when llama_init_from_model fails: asking
    llama.cpp for terabytes to see it fail made it touch them first, for a minute), the turn is read chunk by chunk."""
    import kvlocal.engine.reading as reading

    def refused(model, n_ctx, **kw):
        raise UsageError(f"llama.cpp could not create a context of {n_ctx} cells: lower -c/--ctx-size or --budget")

    monkeypatch.setattr(reading, "Context", refused)
    e = engine(tiny, "state", None)
    e.prefill(tokens[:N_TURN], probe=tokens[N_TURN - 16:N_TURN])
    assert e.stats.reading_refused == 1 and e.stats.reading_contexts == 0
    assert e.stats.compression_events > 1 and e.n_past == N_TURN and e.live_cells() <= e.budget_cells


def test_read_cells_auto_holds_what_the_tiers_ram_cap_holds_and_bad_values_are_refused(tiny):
    """"auto" (the chat's default): with a recall tier, the cells whose K/V fit its RAM cap (measured against the
    bytes llama.cpp allocates for a context of that many cells), no cap where the tier has none; without a tier, 0."""
    def made(**kw):
        return Engine(tiny, 64, "criticalkv", max_tokens=1200, n_threads=THREADS, read_cells="auto", **kw)

    capped = made(recall=True, recall_mem=1 << 20)
    ctx = Context(tiny, n_ctx=capped.read_cells)  # (llama.cpp pads it)
    cell = ctx.kv_bytes()[0] / ctx.n_ctx  # K, V and the bias of one cell, as llama.cpp allocates them
    ctx.close()
    assert capped.read_cells * cell <= 1 << 20 < (capped.read_cells + 1) * cell
    assert made(recall=True, recall_mem="none").read_cells is None
    assert made(recall=False).read_cells == 0
    for bad in (-1, 1.5, True, "all"):
        with pytest.raises(UsageError, match="read_cells"):
            Engine(tiny, 64, "criticalkv", max_tokens=1200, recall=True, read_cells=bad)
