"""The state backend in place (kvlocal.runtime.hostview, patch 0012): the cells read and written where llama.cpp
keeps them, against the same events through the sequence-state blob, on the real llama.cpp.

A decode is deterministic for a given cache, thread count and cell order: both ways put the plan's rows in cells
0..B-1, so logits are compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvlocal.compress import Plan
from kvlocal.engine import Engine
from kvlocal.backends import StateBackend
from kvlocal.runtime import CacheBasis, Context
from kvlocal.runtime.hostview import STATE_IO_ENV
from kvlocal.runtime.kvquant import CACHE_TYPES
from kvlocal.runtime.state import read_seq

from test_state import TEXT

F32, Q8_0 = CACHE_TYPES["f32"], CACHE_TYPES["q8_0"]
CACHES = {  # name: Context keywords (a quantized V needs flash attention, which stores V as rows)
    "f16": {}, "f16-fa": {"flash_attn": True}, "f32": {"type_k": F32, "type_v": F32},
    "q8_0": {"type_k": Q8_0, "type_v": Q8_0, "flash_attn": True},
}


def backend(ctx, blob: bool = False, in_place: bool | None = True) -> StateBackend:
    """The state backend on ``ctx``: in place where it can be, through the blob with ``blob`` (``in_place=None``: as
    ``KVLOCAL_STATE_IO`` says)."""
    arch = ctx.model.arch
    basis = CacheBasis.for_cache(ctx.type_k, ctx.type_v, arch.head_dim_k, arch.head_dim_v)
    return StateBackend(ctx, arch.full_layers, arch.n_head_kv, arch.head_dim_k, basis=basis,
                        in_place=False if blob else in_place)


def filled(model, n: int, **kw) -> Context:
    ctx = Context(model, n_ctx=256, n_threads=2, **kw)
    ctx.decode(model.tokenize(TEXT * 3)[:n], logits="none")
    return ctx


def same_cells(a, b) -> bool:
    return (np.array_equal(a.pos, b.pos) and all(np.array_equal(x, y) for x, y in zip(a.k, b.k, strict=True))
            and all(np.array_equal(x, y) for x, y in zip(a.v, b.v, strict=True)))


@pytest.mark.parametrize("cache", list(CACHES))
def test_reads_the_cells_the_state_blob_holds_without_a_copy(smollm2_model, cache):
    ctx = filled(smollm2_model, 150, **CACHES[cache])
    kv = backend(ctx)
    assert kv.in_place
    read = kv.read()
    blob = read_seq(ctx)
    assert read.kv.in_place and same_cells(read.kv, blob)
    # the arrays are llama.cpp's memory: a row written through them is what the state blob reads next
    read.kv.k[3][17, 1] = read.kv.k[3][40, 1]
    assert np.array_equal(read_seq(ctx).k[3][17, 1], blob.k[3][40, 1])
    assert not np.array_equal(blob.k[3][17, 1], blob.k[3][40, 1])
    ctx.close()


@pytest.mark.parametrize("cache", ["f16", "f16-fa", "q8_0"])
def test_an_event_in_place_leaves_the_cells_an_event_through_the_blob_leaves(smollm2_model, cache):
    """The same plan (random per-head rows, a different set per layer and head) on two contexts holding the same
    tokens: the same cells, positions and rows afterwards, and the same next-token logits bit for bit."""
    ctxs = [filled(smollm2_model, 180, **CACHES[cache]) for _ in range(2)]
    view, blob = backend(ctxs[0]), backend(ctxs[1], blob=True)
    assert view.in_place and not blob.in_place
    reads = view.read(), blob.read()
    assert reads[0].kv.in_place and not reads[1].kv.in_place
    rng = np.random.default_rng(3)
    arch = smollm2_model.arch
    kept = np.sort(np.argsort(rng.random((len(arch.full_layers), arch.n_head_kv, 180)), axis=2)[:, :, :120], axis=2)
    for kv, read in zip((view, blob), reads):
        kv.apply(read, Plan(kept, np.take_along_axis(read.true, kept, axis=2)))
    after = [read_seq(c) for c in ctxs]
    assert after[0].n == 120 and same_cells(*after)
    assert all(np.array_equal(c.cells()[0], np.arange(120)) for c in ctxs)
    tok = smollm2_model.tokenize(" the")[-1]
    logits = [c.decode([tok], [int(after[0].pos.max()) + 1]) for c in ctxs]
    np.testing.assert_array_equal(*logits)
    for c in ctxs:
        c.close()


@pytest.mark.parametrize("method", ["criticalkv", "kvslimmer", "adakv"])
@pytest.mark.slow(34)
def test_a_prefill_in_place_equals_one_through_the_blob(smollm2_model, method, monkeypatch):
    """An engine's whole prompt in chunks of 64, an event after each, then (CriticalKV, with the recall tier) a
    question that brings rows back from the tier: the same plans, tier and logits bit for bit. The prompt's events
    move rows where they lie; KVSlimmer's merged rows (and their log(count) biases), AdaKV's empty slots and the
    question's union with the tier's rows are written from scratch rows."""
    toks = smollm2_model.tokenize(TEXT * 8)[:1100]
    question = smollm2_model.tokenize(" Who was going direct to Heaven, and who had nothing before them?")
    runs = []
    for io in ("view", "blob"):
        monkeypatch.setenv(STATE_IO_ENV, io)
        recall = method == "criticalkv"
        eng = Engine(smollm2_model, 0.1, method, max_tokens=1200, backend="state", recall=recall, n_threads=2,
                     chunk=64, low_water=1.0)
        assert eng.kv.in_place == (io == "view")
        eng.prefill(toks)
        plans = [eng.last_plan]
        if recall:
            assert eng.reselect(question) > 0  # rows came back
            eng.append(question)
            plans.append(eng.last_plan)
        runs.append((plans, np.array(eng.logits), eng.stats, eng.tier.nbytes if eng.tier else 0))
    (plans_a, logits_a, stats_a, tier_a), (plans_b, logits_b, stats_b, tier_b) = runs
    assert stats_a.compression_events == stats_b.compression_events >= 9
    assert plans_a[0].merged().any() == (method == "kvslimmer")
    assert (plans_a[0].keep < 0).any() == (method == "adakv")  # the narrower heads' empty slots
    for a, b in zip(plans_a, plans_b, strict=True):
        np.testing.assert_array_equal(a.keep, b.keep)
    np.testing.assert_array_equal(logits_a, logits_b)
    assert tier_a == tier_b and (tier_a > 0) == recall
    # nothing is copied out and loaded back: the rows written are those that moved, a blob's round trip is the cache
    assert stats_a.host_kv_bytes < stats_b.host_kv_bytes / 2


def test_cells_elsewhere_than_the_first_are_read_through_the_blob(smollm2_model):
    """Holes in the sequence's cells (tokens removed mid-sequence): the read falls back to the state blob."""
    ctx = filled(smollm2_model, 150)
    ctx.remove(40, 60)
    kv = backend(ctx)
    read = kv.read()
    assert kv.in_place and not read.kv.in_place and same_cells(read.kv, read_seq(ctx)) and read.n == 130
    ctx.close()


def test_a_full_attention_cache_of_an_iswa_memory(gemma3_model):
    """Gemma 3: its full-attention layers' cache is viewed and rewritten; the sliding-window cache is left alone."""
    ctxs = [filled(gemma3_model, 200) for _ in range(2)]
    view, blob = backend(ctxs[0]), backend(ctxs[1], blob=True)
    reads = view.read(), blob.read()
    assert reads[0].kv.in_place and same_cells(reads[0].kv, reads[1].kv)
    kept = np.tile(np.r_[0:4, 100:200], (len(gemma3_model.arch.full_layers), gemma3_model.arch.n_head_kv, 1))
    for kv, read in zip((view, blob), reads):
        kv.apply(read, Plan(kept, np.take_along_axis(read.true, kept, axis=2)))
    after = [read_seq(c) for c in ctxs]
    assert after[0].n == 104 and same_cells(*after) and np.array_equal(after[0].tail, after[1].tail)
    tok = gemma3_model.tokenize(" the")[-1]
    np.testing.assert_array_equal(*[c.decode([tok], [200]) for c in ctxs])
    for c in ctxs:
        c.close()


def test_kvlocal_state_io_blob_turns_the_view_off(smollm2_model, monkeypatch):
    ctx = filled(smollm2_model, 50)
    monkeypatch.setenv(STATE_IO_ENV, "view")
    assert backend(ctx, in_place=None).in_place
    monkeypatch.setenv(STATE_IO_ENV, "blob")
    assert not backend(ctx, in_place=None).in_place and backend(ctx).in_place  # an explicit choice wins
    ctx.close()
