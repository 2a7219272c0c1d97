"""A probe's queries moved by RoPE (kvlocal/engine/observation.py), against llama.cpp's own queries.

In a fresh context a batch attends only to itself, and attention depends only on relative positions, so the
same tokens decoded at positions ``p`` and ``p + Δ`` have the same pre-RoPE queries in every layer: the
captured post-RoPE queries must differ by exactly the rotation ``R(Δ)`` that :class:`Rope` computes.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvlocal.engine import Engine
from kvlocal.engine.observation import Rope
from kvlocal.runtime import Context
from kvlocal.runtime.capture import QueryCapture

TEXT = "The harbour master wrote the names of the seven ships in a green ledger before the storm."


def _queries_at(model, ctx, cap, toks, p0):
    cap.arm(len(toks))
    try:
        ctx.decode(toks, list(range(p0, p0 + len(toks))), "none")
    finally:
        cap.disarm()
    ctx.remove(0, -1)
    return cap.take()


@pytest.mark.parametrize("fixture", ["smollm2_model", "qwen_model", "gemma3_model"])
def test_moved_queries_are_llama_cpp_queries_at_the_new_positions(fixture, request):
    """Exact where the hidden states are (layer 0 of SmolLM2 and Qwen: the queries depend on the token only);
    deeper, the batch's own attention over its rotated keys rounds differently, and the moved queries stay
    within a quarter of the error that not moving them makes."""
    model = request.getfixturevalue(fixture)
    rope = Rope.of(model)
    assert rope is not None and rope.kind == ("norm" if model.arch.arch == "llama" else "neox")
    cap = QueryCapture.for_model(model)
    ctx = Context(model, 768 if model.arch.has_swa else 256, cb_eval=cap.callback)
    toks = model.tokenize(TEXT, add_special=False)[:12]
    first = _queries_at(model, ctx, cap, toks, 0)
    for delta in (173, 4000):
        later = _queries_at(model, ctx, cap, toks, delta)
        for il, q0, q1 in zip(cap.layers, first, later):
            scale = np.abs(q1).max()
            moved = np.abs(rope.rotate(q0, delta) - q1).max() / scale
            unmoved = np.abs(q0 - q1).max() / scale
            if il == 0:  # float32 angles in llama.cpp: ~1e-4 relative at 4K positions
                assert moved < 1e-3, (fixture, delta, moved)
            assert moved < 0.25 * unmoved, (fixture, delta, il, moved, unmoved)


@pytest.mark.slow(39)
def test_events_between_probe_decodes_use_moved_queries(smollm2_model):
    """observe_every=4 decodes the probe for one event in four (and for the prompt's last one); the kept
    sets stay close to those of a probe decoded for every event, and differ (in layer 0 the queries depend on
    the tokens alone, so moving them is exact there; deeper, they were computed over an older cache)."""
    from kvlocal.cli.bench import long_text

    toks = long_text(smollm2_model, 2000)
    probe = smollm2_model.tokenize("\n\nWhat does the text say about patents?", add_special=False)
    kept = {}
    for every in (1, 4):
        eng = Engine(smollm2_model, 256, "criticalkv", max_tokens=len(toks) + 8, observe_every=every, backend="state")
        eng.prefill(toks, probe=probe)
        s = eng.stats
        e = s.compression_events
        assert e > 6 and eng.observations.decoded + s.observations_moved == e
        # decoded for events 0, every, 2·every, ... and for the prompt's last one, whatever its turn
        assert e - s.observations_moved == len(range(0, e, every)) + ((e - 1) % every > 0)
        t = eng.kv.record.true  # [layer, head, cell] source positions
        kept[every] = {(il, h, int(p)) for il, h, c in zip(*np.nonzero(t >= 0)) for p in [t[il, h, c]]}
    jaccard = len(kept[1] & kept[4]) / len(kept[1] | kept[4])
    assert 0.6 < jaccard < 1.0, jaccard


@pytest.mark.slow(30)
def test_a_prompt_reselected_after_is_not_observed_afresh_at_its_end(smollm2_model):
    """``prefill(reselect_after=True)`` with a recall tier — ``kvlocal run``'s prompt before its question, a chat's
    document: the question's re-selection that follows decodes the question afresh — observes the prompt's last event
    as the others, its probe decoded once in ``observe_every`` events; the same engine without the flag decodes it
    afresh (one decode more), and so does an engine without a tier, which nothing re-selects."""
    from kvlocal.cli.bench import long_text

    toks = long_text(smollm2_model, 2000)
    probe = smollm2_model.tokenize("\n\nWhat does the text say about patents?", add_special=False)
    decoded = {}
    for recall, after in ((True, False), (True, True), (False, True)):
        eng = Engine(smollm2_model, 256, "criticalkv", max_tokens=len(toks) + 8, observe_every=4, backend="state",
                     recall=recall)
        eng.prefill(toks, probe=probe, reselect_after=after)
        s = eng.stats
        decoded[recall, after] = (s.compression_events, s.compression_events - s.observations_moved)
    (e, fresh), (e2, reused) = decoded[True, False], decoded[True, True]
    assert e == e2 > 6 and (e - 1) % 4 > 0  # the last event is not one the schedule decodes anyway
    assert fresh == len(range(0, e, 4)) + 1 and reused == len(range(0, e, 4))
    e, without_tier = decoded[False, True]
    assert without_tier == len(range(0, e, 4)) + ((e - 1) % 4 > 0)


@pytest.mark.slow(20)
def test_window_observation_scores_each_event_by_its_chunks_last_queries(smollm2_model):
    """prefill_observe="window": every event of a prompt but its last is scored by the queries its chunk's last
    ``recent`` tokens had while the chunk was decoded (the first event's are llama.cpp's own for the text decoded
    afresh), and the probe is decoded once, with the last chunk — the generic one, or the question."""
    from kvlocal.cli.bench import long_text

    toks = long_text(smollm2_model, 2000)
    question = smollm2_model.tokenize("\n\nWhat does the text say about patents?", add_special=False)
    eng = Engine(smollm2_model, 256, "criticalkv", max_tokens=len(toks) + 8, backend="state", prefill_observe="window")
    events, observed = [], []
    plan, observe = eng.compressor.plan, eng.observer.observe

    def recording_plan(read, q, q_pos, *args):
        events.append((eng.n_past, [qi.copy() for qi in q], np.array(q_pos)))
        return plan(read, q, q_pos, *args)

    eng.compressor.plan = recording_plan
    eng.observer.observe = lambda *a, **k: observed.append(a[0]) or observe(*a, **k)
    eng.prefill(toks)
    s = eng.stats
    assert s.compression_events > 6 and s.observations_window == s.compression_events - 1 and s.observations_moved == 0
    generic = eng._probe_tokens(None)
    assert observed == [] and eng.last_probe == generic  # the last event's probe: decoded with the last chunk
    assert list(events[-1][2]) == list(range(eng.n_past, eng.n_past + len(generic)))
    for n_past, _, q_pos in events[:-1]:
        assert list(q_pos) == list(range(n_past - 32, n_past))

    n0, q0 = events[0][0], events[0][1]
    cap = QueryCapture.for_model(smollm2_model)
    ctx = Context(smollm2_model, 512, cb_eval=cap.callback)
    cap.arm(32)
    try:
        ctx.decode(toks[:n0], list(range(n0)), "last")
    finally:
        cap.disarm()
    fresh = cap.take()
    for a, b in zip(q0, fresh):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()

    asked = Engine(smollm2_model, 256, "criticalkv", max_tokens=len(toks) + 8, backend="state", prefill_observe="window")
    asked.prefill(toks, probe=question)
    t = asked.stats
    assert t.observations_window == t.compression_events - 1 and t.observations_moved == 0 and asked.last_probe == question


@pytest.mark.slow(16)
@pytest.mark.parametrize("fixture", ["smollm2_model", "qwen_model"])
def test_decode_time_events_are_observed_by_the_queries_their_tokens_had(fixture, request):
    """decode_observe="kept": a compression while generating is scored by the prompt probe's queries from its
    decode and the reply's last tokens' from their own decodes, turned to the positions a probe decoded then
    would have — checked against that probe decoded (layer 0: the queries depend on the token and its position
    alone, so kept and decoded must agree to llama.cpp's float32 angles; a token or position off by one would
    not). "probe" decodes it (the default until the generation task measured the two: docs/engine.md)."""
    model = request.getfixturevalue(fixture)
    from kvlocal.cli.bench import long_text

    toks = long_text(model, 300)
    probe = model.tokenize("\n\nWhat does the text say about patents?", add_special=False)
    events = {}
    for how in ("probe", "kept"):
        eng = Engine(model, 96, "criticalkv", chunk=64, max_tokens=len(toks) + 300, decode_observe=how,
                     backend="state")
        eng.prefill(toks, probe=probe)
        e0, decoded0 = eng.stats.compression_events, eng.observations.decoded
        compared = []
        if how == "kept":
            kept_observation = eng.observer.kept

            def both(p, reply, eng=eng, kept_observation=kept_observation):
                kept = kept_observation(p, reply)
                assert kept is not None, "the kept queries were missing at a decode-time event"
                fresh, pos, _ = eng.observer.observe(p)  # the probe decoded after the cache, then removed
                np.testing.assert_array_equal(kept[1], pos)
                scale = np.abs(fresh[0]).max()
                compared.append(np.abs(kept[0][0] - fresh[0]).max() / scale)
                return kept

            eng.observer.kept = both
        list(eng.generate(eng.slack + 40, stop_at_eog=False))  # past one decode-time event
        s = eng.stats
        events[how] = s.compression_events - e0
        assert events[how] >= 1
        if how == "kept":
            assert s.observations_kept == events[how] == len(compared)
            # the probe decodes above are the test's: the engine decoded none of its own
            assert eng.observations.decoded - decoded0 == len(compared)
            assert max(compared) < 1e-3, compared
        else:
            assert s.observations_kept == 0 and eng.observations.decoded - decoded0 == events[how]
    assert events["kept"] == events["probe"]
