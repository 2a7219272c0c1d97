"""The recall tier in the engine, the chat and the CLI (kvlocal.recall): rows that leave the cache wait on
the host and a question brings back the ones it needs.

Mechanics run on a tiny generated model (real llama.cpp, random weights); what recall is for — a chat's
later questions find facts an earlier eviction dropped — runs on Qwen2.5-Coder-0.5B against the full
cache, with recall off and StreamingLLM as the controls that must lose."""

from __future__ import annotations

import random
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "reference"))  # tiny_gguf

import tiny_gguf  # noqa: E402
from conftest import REPO, assert_usage_error, run_cli  # noqa: E402
from kvlocal.engine import Engine  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.eval.tasks import Prose, insert_at, sample_text  # noqa: E402
from kvlocal.recall.tier import PAGE  # noqa: E402
from kvlocal.runtime import Model  # noqa: E402
from kvlocal.runtime.state import read_seq  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Model:
    return Model(tiny_gguf.write_tiny(tmp_path_factory.mktemp("tiny") / "llama.gguf", arch="llama"))


def device_rows(eng: Engine):
    """Per compressed layer and KV head: {true position: (K row, V row)} of the rows on the device now."""
    read = eng.kv.read()
    out = []
    for l in range(len(eng.layers)):
        heads = []
        for h in range(eng.model.n_head_kv):
            live = np.flatnonzero(read.true[l, h] >= 0)
            heads.append({int(read.true[l, h, c]): (read.kv.k[l][c, h].copy(), read.kv.v[l][c, h].copy()) for c in live})
        out.append(heads)
    return out


def test_a_question_swaps_rows_with_the_tier_and_both_stay_consistent(tiny_llama):
    tokens = tiny_llama.tokenize(sample_text())
    eng = Engine(tiny_llama, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True)
    eng.prefill(tokens[:500], probe=tokens[500:516])
    tier = eng.tier
    before = device_rows(eng)
    assert eng.stats.compression_events >= 3 and tier.n_rows > 0
    # every row that left is in the tier, once: what was read = what is on the device + what the tier holds
    for l, heads in enumerate(before):
        for h, rows in enumerate(heads):
            s = tier.heads[l][h]
            stored = set(s.pos[:s.n].tolist())
            assert len(stored) == s.n and not stored & set(rows), (l, h)
            assert stored | set(rows) == set(range(500)), (l, h)

    came_back = eng.reselect(tokens[600:620])  # the 20 tokens of a question to come
    after = device_rows(eng)
    assert came_back == eng.stats.recall_rows_in > 0 and eng.stats.recall_events == 1
    # the context's headroom (its cells past the budget's) holds recalled rows while the question is answered, with
    # room left for the question's 20 tokens and the answer's first recall_room: no cell more is allocated
    assert eng.slot_cells < eng.live_cells() <= eng.ctx.n_ctx - eng._reserve() - 20 - eng.reselection.room
    moved = 0
    for l, heads in enumerate(after):
        for h, rows in enumerate(heads):
            s = tier.heads[l][h]
            on = set(s.pos[:s.n][s.on_device[:s.n]].tolist())
            assert on == set(rows) & set(s.pos[:s.n].tolist()), (l, h)  # the flags say exactly what is back
            assert set(rows) | set(s.pos[:s.n].tolist()) == set(range(500)), (l, h)  # nothing lost
            for p in set(rows) - set(before[l][h]):  # a row that came back is the row that left, byte for byte
                k, v = rows[p]
                i = s.index_of(np.array([p]))[0]
                tk, tv = s.rows(np.array([i]))
                assert np.array_equal(k, tk[0]) and np.array_equal(v, tv[0]), (l, h, p)
                moved += 1
    assert moved == came_back
    # the engine goes on: the question is decoded after the swap, then a reply
    eng.append(tokens[600:620], probe=tokens[600:620])
    assert len(list(eng.generate(8, stop_at_eog=False))) == 8


def test_an_answers_first_tokens_reselect_with_their_own_queries(tiny_llama):
    tokens = tiny_llama.tokenize(sample_text())
    eng = Engine(tiny_llama, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True, recall_steps=5,
                 recall_step_candidates=0.25, recall_step_confidence=1.0)
    eng.prefill(tokens[:500], probe=tokens[500:516])
    eng.append(tokens[600:620], question=True)  # a question: it re-selects, then its answer's first 5 tokens do
    s = eng.stats
    assert s.recall_events == 1 and s.recall_steps == 0
    in_after_question, scored_by_question = s.recall_rows_in, s.recall_candidates
    reply = list(eng.generate(8, stop_at_eog=False))
    assert s.recall_steps == 5 and s.recall_step_seconds > 0
    # these steps score a quarter of a head's budget of tier rows (whole pages), the question four budgets
    per_step = (s.recall_candidates - scored_by_question) / 5
    heads = len(eng.layers) * tiny_llama.n_head_kv
    assert 0 < per_step <= heads * (int(0.25 * eng.head_budget) + PAGE - 1) < scored_by_question
    assert eng.last_probe == reply[4:5]  # the last step was observed by its token's own query
    assert s.recall_rows_in > in_after_question  # the steps brought rows back
    # the last step's swap filled the headroom (less the answer's room), then reply[4:8] was decoded
    assert eng.slot_cells < eng.live_cells() <= eng.ctx.n_ctx - eng._reserve() - eng.reselection.room + 4
    # nothing read is lost, and the tier's flags say exactly what is on the device
    for l, heads in enumerate(device_rows(eng)):
        for h, rows in enumerate(heads):
            st = eng.tier.heads[l][h]
            stored = st.pos[:st.n]
            assert set(stored[st.on_device[:st.n]].tolist()) == set(rows) & set(stored.tolist()), (l, h)
            assert set(rows) | set(stored.tolist()) == set(range(500)) | set(range(500, eng.n_past)), (l, h)
    # text that is not a question (a document, a plain continuation) does not re-select
    eng.append(tokens[700:720])
    list(eng.generate(4, stop_at_eog=False))
    assert s.recall_steps == 5 and s.recall_events == 1
    assert eng.live_cells() <= eng.slot_cells + 4  # and its prefill compressed back to the budget
    off = Engine(tiny_llama, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True, recall_steps=0)
    off.prefill(tokens[:500])
    off.append(tokens[600:620], question=True)
    list(off.generate(8, stop_at_eog=False))
    assert off.stats.recall_events == 1 and off.stats.recall_steps == 0
    with pytest.raises(UsageError, match="recall_steps"):
        Engine(tiny_llama, 64, "criticalkv", max_tokens=500, recall=True, recall_steps=-1)
    with pytest.raises(UsageError, match="recall_room"):
        Engine(tiny_llama, 64, "criticalkv", max_tokens=500, recall=True, recall_room=-1)


def test_a_confident_step_keeps_its_decode_and_swaps_nothing(tiny_llama):
    """A step whose decode already predicts the next token above ``recall_step_confidence`` is the token's
    decode: nothing swapped, nothing decoded twice — at 0 every step is, and the answer is exactly the one
    without steps; at 1 none is. What the threshold costs and finds: docs/recall.md § Choices."""
    tokens = tiny_llama.tokenize(sample_text())
    replies, stats = {}, {}
    for name, kw in {"no steps": dict(recall_steps=0), "all confident": dict(recall_step_confidence=0.0),
                     "none confident": dict(recall_step_confidence=1.0)}.items():
        eng = Engine(tiny_llama, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True, **kw)
        eng.prefill(tokens[:500], probe=tokens[500:516])
        eng.append(tokens[600:620], question=True)
        rows_in = eng.stats.recall_rows_in
        replies[name] = list(eng.generate(8, stop_at_eog=False))
        stats[name] = (eng.stats.recall_steps, eng.stats.recall_steps_confident, eng.stats.recall_rows_in - rows_in,
                       eng.n_past, len(eng.kv.positions()))
    assert stats["all confident"] == (8, 8, 0) + stats["no steps"][3:]  # each token decoded once, its cell kept
    assert replies["all confident"] == replies["no steps"]
    steps, confident, rows_in, n_past, _ = stats["none confident"]
    assert steps == 8 and confident == 0 and rows_in > 0 and n_past == stats["no steps"][3]


def test_a_confident_steps_query_observes_the_next_swap(tiny_llama, monkeypatch):
    """A step that keeps its decode holds its query: the next step that swaps is observed by the held queries
    and its own (a swap serves the tokens after it: docs/recall.md § Choices), and then holds nothing."""
    import kvlocal.recall.reselect as reselect_module

    top = iter([0.95, 0.95, 0.5, 0.95, 0.5])  # the steps' top probabilities: kept, kept, swap, kept, swap
    monkeypatch.setattr(reselect_module, "top_probability", lambda logits: next(top))
    tokens = tiny_llama.tokenize(sample_text())
    eng = Engine(tiny_llama, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True, recall_steps=5,
                 recall_step_confidence=0.9)
    eng.prefill(tokens[:500], probe=tokens[500:516])
    eng.append(tokens[600:620], question=True)
    observed, swap = [], eng.reselection.swap
    monkeypatch.setattr(eng.reselection, "swap",
                        lambda q, q_pos, c: observed.append((q_pos.tolist(), {x.shape[1] for x in q})) or swap(q, q_pos, c))
    p0 = eng.n_past
    list(eng.generate(6, stop_at_eog=False))
    assert observed == [([p0, p0 + 1, p0 + 2], {3}), ([p0 + 3, p0 + 4], {2})]
    assert (eng.stats.recall_steps, eng.stats.recall_steps_confident) == (5, 3) and eng.n_past == p0 + 6


def test_steps_swap_at_most_every_n_and_the_ones_between_hold(tiny_llama, monkeypatch):
    """``recall_step_every=2``: a step right after a swap keeps its decode whatever its confidence (it is not
    even asked) and holds its query; the next one swaps unless confident — then it holds too."""
    import kvlocal.recall.reselect as reselect_module

    top = iter([0.95, 0.5, 0.5])  # asked at steps 1, 2 and 4 only: kept (confident), swap, swap
    monkeypatch.setattr(reselect_module, "top_probability", lambda logits: next(top))
    tokens = tiny_llama.tokenize(sample_text())
    eng = Engine(tiny_llama, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True, recall_steps=6,
                 recall_step_confidence=0.9, recall_step_every=2)
    eng.prefill(tokens[:500], probe=tokens[500:516])
    eng.append(tokens[600:620], question=True)
    observed, swap = [], eng.reselection.swap
    monkeypatch.setattr(eng.reselection, "swap",
                        lambda q, q_pos, c: observed.append(q_pos.tolist()) or swap(q, q_pos, c))
    p0 = eng.n_past
    list(eng.generate(7, stop_at_eog=False))
    assert observed == [[p0, p0 + 1, p0 + 2], [p0 + 3, p0 + 4]]  # step 5 kept: one past the swap at 4
    assert (eng.stats.recall_steps, eng.stats.recall_steps_confident) == (6, 4) and eng.n_past == p0 + 7
    with pytest.raises(UsageError, match="recall_step_every"):
        Engine(tiny_llama, 64, "criticalkv", max_tokens=500, recall=True, recall_step_every=0)


def test_a_capped_tier_keeps_its_newest_rows_byte_for_byte_under_the_cap(tiny_llama):
    # the same reading in three engines: no cap, the default cap (not reached: the tier is the uncapped one, array for
    # array) and a cap of three blocks a head (reached): that tier stays under it, holds each head's newest rows
    # exactly as the uncapped tier does, counts the others as dropped and says so; a question still swaps rows with it
    from kvlocal.recall import CHUNK, default_recall_mem

    tokens = tiny_llama.tokenize(sample_text())
    kw = dict(max_tokens=2000, chunk=32, recent=16, recall=True)
    free = Engine(tiny_llama, 64, "criticalkv", recall_mem="none", **kw)
    default = Engine(tiny_llama, 64, "criticalkv", **kw)
    heads = len(free.layers) * tiny_llama.n_head_kv
    cap = 3 * heads * free.tier.chunk_bytes
    capped = Engine(tiny_llama, 64, "criticalkv", recall_mem=cap, **kw)
    for e in (free, default, capped):
        e.prefill(tokens[:1200], probe=tokens[1200:1216])
    assert free.tier.pool.memory.limit is None and default.tier.pool.memory.limit == default_recall_mem()
    a, b = free.tier.to_arrays(), default.tier.to_arrays()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    for x, y in zip(device_rows(free), device_rows(capped)):  # the tier does not change the cache
        assert [{p: (k.tobytes(), v.tobytes()) for p, (k, v) in h.items()} for h in x] == \
            [{p: (k.tobytes(), v.tobytes()) for p, (k, v) in h.items()} for h in y]

    t, f = capped.tier, capped.kv_figures()
    assert t.pool.memory.used <= cap and f["host_tier_cap_used"] <= f["host_tier_cap"] == cap
    assert f["host_tier_past_cap"] == "drop_oldest" and f["host_tier_dropped_rows"] == t.cap_dropped_rows > 0
    assert free.tier.n_rows - t.n_rows == t.cap_dropped_rows and t.n_rows > 2 * heads * CHUNK
    for l in range(len(free.layers)):
        for h in range(tiny_llama.n_head_kv):
            s, u = t.heads[l][h], free.tier.heads[l][h]
            np.testing.assert_array_equal(s.pos[:s.n], u.pos[u.n - s.n:u.n])  # the newest rows
            ku, vu = u.rows(np.arange(u.n - s.n, u.n))
            ks, vs = s.rows(np.arange(s.n))
            assert np.array_equal(ks, ku) and np.array_equal(vs, vu), (l, h)
            np.testing.assert_array_equal(s.vnorm[:s.n], u.vnorm[u.n - s.n:u.n])
    assert capped.reselect(tokens[1300:1320]) > 0
    for l, rows in enumerate(device_rows(capped)):  # what came back is the row that left, byte for byte
        for h, held in enumerate(rows):
            u = free.tier.heads[l][h]
            for p, (k, v) in held.items():
                i = u.index_of(np.array([p]))[0]
                if i >= 0:
                    assert np.array_equal(k, u.rows(np.array([i]))[0][0]), (l, h, p)
    assert t.pool.memory.used <= cap
    for e in (free, default, capped):
        e.close()


@pytest.mark.slow(8)
def test_a_turn_is_undone_after_the_cap_dropped_rows(smollm2_model):
    """/regen undoes a turn by reading the rows it evicted back from the tier: the cap keeps those (and the rows the
    device held when the turn began) while the turn may be undone, and drops others, so a chat past its cap regenerates
    and goes on; the tier stays under the cap."""
    from kvlocal import Chat
    from kvlocal.runtime import Sampler

    text = sample_text()
    with Chat(smollm2_model, budget=64, recall_mem="16M", sampler=Sampler(), n_threads=2) as chat:
        chat.read(text[:3000])
        chat.ask("Who is the single man?", 8)
        tier = chat.engine.tier
        assert tier.cap_dropped_rows > 0
        dropped = tier.cap_dropped_rows
        assert "".join(chat.regen(8)).strip()
        assert chat.ask("And then? " + text[3000:3600], 8).strip() and tier.cap_dropped_rows > dropped
        assert "".join(chat.regen(8)).strip() and tier.pool.memory.used <= 16 << 20


def test_a_restored_snapshot_forgets_the_undone_rows(tiny_llama):
    tokens = tiny_llama.tokenize(sample_text())
    eng = Engine(tiny_llama, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True)
    eng.prefill(tokens[:300])
    snap = eng.snapshot()
    n0 = eng.tier.n_rows
    eng.append(tokens[300:500], question=True)
    assert eng.tier.n_rows > n0
    eng.restore(snap)
    assert eng.tier.n_rows == n0  # the undone turn's tokens are gone from the tier too
    on_device = device_rows(eng)
    for l, heads in enumerate(on_device):
        for h, rows in enumerate(heads):
            s = eng.tier.heads[l][h]
            assert set(s.pos[:s.n][s.on_device[:s.n]].tolist()) == set(rows) & set(s.pos[:s.n].tolist())


@pytest.fixture(scope="module")
def tiny_llama64(tmp_path_factory) -> Model:
    """Heads of 64 dimensions: whole q8_0 blocks, and llama.cpp's Hadamard rotation of a quantized K."""
    return Model(tiny_gguf.write_tiny(tmp_path_factory.mktemp("tiny64") / "llama.gguf", arch="llama", head_dim=64))


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_moving_positions_back_keeps_the_tiers_latest_history(tiny_llama64, cache):
    """An endless chat moves its positions back under the trained context: the tier keeps the latest history
    that fits (it is not cleared), renumbered with the cells — per head, tier and device rows distinct, the
    tier in order, all below n_past — and its keys turned by RoPE exactly as llama.cpp's K-shift turns the
    cells' (measured on the device rows); the same on both backends, and a question then finds rows in it."""
    model, t = tiny_llama64, {"f16": 1, "q8_0": 8}[cache]
    tokens = model.tokenize(sample_text())
    tiers = {}
    for backend in ("state", "native"):
        eng = Engine(model, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True, endless=True,
                     type_k=t, type_v=t, backend=backend, method_params={"value_norm": "l1"})  # one arithmetic on both
        eng.prefill(tokens[:600], probe=tokens[600:616])
        tier, basis, rope = eng.tier, eng.basis, eng.observations.rope
        before = [[(s.pos[:s.n].copy(), s.on_device[:s.n].copy(), s.rows(np.arange(s.n))[0]) for s in layer]
                  for layer in tier.heads]
        read0 = read_seq(eng.ctx) if backend == "state" else None  # a host copy: the cells change below
        eng.position_limit = eng.n_past  # the next token would pass it
        eng.positions.move(1)
        list(eng.generate(1, stop_at_eog=False))  # llama.cpp turns the moved cells' keys at this decode
        assert eng.stats.repositions == 1 and eng.n_past <= 0.75 * 600 + 1
        read1 = eng.kv.read()
        kept_old, dropped_old = [], []
        for l, layer in enumerate(tier.heads):
            for h, s in enumerate(layer):
                pos0, on0, k0 = before[l][h]
                off = np.flatnonzero(~on0)
                off = off[np.argsort(pos0[off])]
                n = s.n
                kept, gone = off[len(off) - n:], off[:len(off) - n]  # the latest of each head's rows stay
                kept_old.append(pos0[kept]), dropped_old.append(pos0[gone])
                pos1 = s.pos[:n]
                assert np.all(np.diff(pos1) > 0) and pos1.max(initial=-1) < eng.n_past
                assert not np.isin(pos1, read1.true[l, h]).any() and not s.on_device[:n].any()
                # each kept key turned by its own move (the turn is checked against llama.cpp below)
                want = basis.keys(basis.turn_keys(k0[kept], lambda x: rope.rotate(x, pos1 - pos0[kept]))[0])
                np.testing.assert_allclose(basis.keys(s.rows(np.arange(n))[0]), want, atol=1e-6)
                q = np.random.default_rng(l * 7 + h).standard_normal((3, basis.keys(k0[:1]).shape[-1])).astype(np.float32)
                keys = basis.keys(s.rows(np.arange(n))[0])
                bound = s.page_bounds(q)
                assert np.all((q @ keys.T).max(axis=0) <= np.repeat(bound, PAGE)[:n] + 1e-4)  # fresh page bounds
        kept_old, dropped_old = np.concatenate(kept_old), np.concatenate(dropped_old)
        assert len(kept_old) > 0 and len(dropped_old) > 0 and dropped_old.max() < kept_old.min()
        if read0 is not None:  # Rope.rotate is llama.cpp's K-shift: every moved device key, as the cache holds it
            o0, o1 = np.argsort(read0.pos), np.argsort(read1.pos)[:read0.n]
            delta = read1.pos[o1] - read0.pos[o0]
            assert (delta != 0).mean() > 0.5
            for l in range(len(eng.layers)):
                k0, k1 = basis.keys(read0.k[l][o0]), basis.keys(read1.kv.k[l][o1])
                turned = basis.keys(basis.turn_keys(read0.k[l][o0], lambda x: rope.rotate(x, delta[:, None]))[0])
                tol = 2e-3 if cache == "f16" else 0.02 * np.abs(k1).max()
                np.testing.assert_allclose(turned, k1, atol=tol)
                assert np.abs(k0 - k1).max() > 20 * tol  # the keys did move
        rows_in = tier.rows_in
        eng.reselect(tokens[700:716])
        assert tier.rows_in > rows_in
        for l, heads in enumerate(device_rows(eng) if backend == "state" else []):
            for h, rows in enumerate(heads):
                s = tier.heads[l][h]
                assert np.array_equal(s.on_device[:s.n], np.isin(s.pos[:s.n], list(rows))), (l, h)
        tiers[backend] = tier.to_arrays()
    for name, a in tiers["state"].items():  # the norms: numpy's on one, the device's on the other
        check = np.testing.assert_allclose if name == "tier_vnorm" else np.testing.assert_array_equal
        check(a, tiers["native"][name], err_msg=name, **({"rtol": 1e-5} if name == "tier_vnorm" else {}))


def test_a_swap_on_a_quantized_cache_reads_no_stale_bytes(tiny_llama64):
    """A swap's new rows are not zeroed first (it copies in the keys, and the values of the rows it keeps): a row it
    does not write must never be read. A quantized cache's values are decoded whole for the scorers, so there the
    rows it does not copy are zero bytes. The backend's buffers are filled with F16 infinities first (every q8_0
    block's scale): each value row the scorers decode must be finite."""
    eng = Engine(tiny_llama64, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True, type_k=8,
                 type_v=8, backend="state")
    tokens = tiny_llama64.tokenize(sample_text())
    eng.prefill(tokens[:600], probe=tokens[600:616])
    for i in range(len(eng.kv.layers)):
        for name in ("k", "v"):
            eng.kv.scratch.take((name, i), (1 << 19,), np.uint16)[...] = 0x7C00

    class Checked:  # the backend's basis, its decoded values checked as the scorers read them
        def __init__(self, basis):
            self.basis, self.rows = basis, 0

        def __getattr__(self, name):
            return getattr(self.basis, name)

        def values(self, rows):
            out = self.basis.values(rows)
            assert np.isfinite(out).all(), "a value row the swap did not write was decoded"
            self.rows += out.shape[0] * out.shape[1]
            return out

    eng.kv.basis = checked = Checked(eng.kv.basis)
    assert eng.reselect(tokens[700:720]) > 0 and checked.rows > 0


def test_recall_refusals_and_defaults(tiny_llama):
    with pytest.raises(UsageError, match="merged row"):
        Engine(tiny_llama, 64, "kvslimmer", max_tokens=500, recall=True)
    assert Engine(tiny_llama, 64, "criticalkv", max_tokens=500, recall=None, backend="native").tier is not None
    assert Engine(tiny_llama, 64, "kvslimmer", max_tokens=500, recall=None).tier is None  # auto: off for merging
    assert Engine(tiny_llama, 64, "criticalkv", max_tokens=500, recall=None).tier is not None
    assert Engine(tiny_llama, 64, "full", max_tokens=500, recall=True).tier is None  # nothing is evicted


def test_cli_bad_recall_settings_are_one_line(smollm2, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text(sample_text()[:1500])
    base = ["run", str(smollm2), "--prompt-file", str(prompt), "-n", "2", "--budget", "64", "-t", "1"]
    assert_usage_error(run_cli(*base, "--recall-mem", "1K"), "--recall-mem", "below one block")
    assert_usage_error(run_cli(*base, "--recall-mem", "lots"), "--recall-mem", "not a size")
    assert_usage_error(run_cli(*base, "--recall-dir", str(tmp_path / "nope"), "--recall-mem", "1M"), "no such folder")
    assert_usage_error(run_cli(*base, "--recall", "on", "--method", "kvslimmer"), "merged row")
    assert_usage_error(run_cli(*base, "--recall-steps", "-1"), "--recall-steps -1", ">= 0")
    assert_usage_error(run_cli(*base, "--recall-mem", "0"), "--recall-mem 0", "none for no limit")
    # --recall-dir's folder is optional: written just before the model, it would take the model as its folder
    assert_usage_error(run_cli("run", "--prompt-file", str(prompt), "-n", "2", "--recall-dir", str(smollm2)),
                       "--recall-dir took", "give the model before --recall-dir")


def test_cli_a_bare_recall_dir_spills_to_the_cache_folder(smollm2, tmp_path):
    """--recall-dir without a folder: past the cap, rows go to a file in kvlocal's cache folder (made if missing, the
    file unlinked), none dropped — said in --json."""
    import json

    prompt = tmp_path / "p.txt"
    prompt.write_text(sample_text()[:1500])
    cache = tmp_path / "cache"
    r = run_cli("run", str(smollm2), "--prompt-file", str(prompt), "-n", "2", "--budget", "64", "-t", "1", "--json",
                "--recall-mem", "64K", "--recall-dir", env={"KVLOCAL_CACHE": str(cache)})
    out = json.loads(r.stdout)
    assert out["host_tier_past_cap"] == "spill" and out["host_tier_cap"] == 64 << 10, r.stderr
    assert out["host_tier_file_bytes"] > 0 and out["host_tier_dropped_rows"] == 0
    assert (cache / "recall").is_dir() and not any((cache / "recall").iterdir())


def test_a_full_disk_is_one_line_and_nothing_half_done(smollm2, tmp_path):
    """The tier's file cannot grow (a file-size limit stands in for a full disk): exit 2, one line."""
    prompt = tmp_path / "p.txt"
    prompt.write_text(sample_text()[:3000])

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill, as a full disk gives ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    r = subprocess.run([sys.executable, "-m", "kvlocal", "run", str(smollm2), "--prompt-file", str(prompt), "-n", "2",
                        "--budget", "64", "-t", "1", "--recall-mem", "64K", "--recall-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=REPO, preexec_fn=limit)
    assert_usage_error(r, "the recall tier cannot grow", "File too large")
    assert list(tmp_path.iterdir()) == [prompt]  # no tier file left behind


@pytest.mark.slow(4)
def test_a_saved_chat_carries_its_tier(smollm2_model, tmp_path):
    import kvlocal
    from kvlocal.runtime import Sampler  # greedy: the replies before and after loading are compared

    text = sample_text()[:2500]
    with kvlocal.Chat(smollm2_model, sampler=Sampler(), budget=64, n_threads=1, recall_steps=3) as chat:
        chat.read(text)
        "".join(chat.send("Who is speaking?", max_tokens=4))
        rows = chat.engine.tier.n_rows
        assert rows > 0 and chat.stats.host_tier_bytes > 0
        chat.save(tmp_path / "s.kvl")
        want = "".join(chat.send("And then?", max_tokens=8))
    with kvlocal.Chat.load(tmp_path / "s.kvl", model=smollm2_model, sampler=Sampler(), n_threads=1) as again:
        assert again.engine.tier.n_rows == rows
        assert again.engine.reselection.steps == 3  # the saved settings, answer steps included
        assert "".join(again.send("And then?", max_tokens=8)) == want  # the same rows came back, the same reply


# -- what recall is for ------------------------------------------------------------------------------------

FACTS = [  # six facts of different forms, each asked in a turn of its own after the document
    ("The red lighthouse on Kettle Point was built in 1873.", "In which year was the red lighthouse on Kettle Point built?", "1873"),
    ("Mrs Abernathy keeps exactly 47 goats on her farm.", "How many goats does Mrs Abernathy keep on her farm?", "47"),
    ("The secret room of the old library opens with the code 6251.", "Which code opens the secret room of the old library?", "6251"),
    ("The river Quenby is 318 kilometres long.", "How long is the river Quenby, in kilometres?", "318"),
    ("Captain Ferro's ship carried 902 barrels of oil.", "How many barrels of oil did Captain Ferro's ship carry?", "902"),
    ("The clock tower of Marlow chimes 13 times at midnight.", "How many times does the clock tower of Marlow chime at midnight?", "13"),
]


def ask_all(model: Model, doc: str, n_doc: int, **chat) -> list[bool]:
    import kvlocal
    from kvlocal.runtime import Sampler

    # greedy: configurations are compared on the same decoding
    with kvlocal.Chat(model, sampler=Sampler(), ctx_size=n_doc + 800, **chat) as c:  # room for the six turns
        c.read(doc)
        return [want in "".join(c.send(q + " Answer with the number only.", max_tokens=10)) for _, q, want in FACTS]


@pytest.mark.slow(95)
def test_questions_after_the_document_find_what_eviction_dropped(qwen_model):
    rng = random.Random(20261202)
    prose = Prose(lambda s: len(qwen_model.tokenize(s, add_special=False)))
    doc = insert_at(prose.take(700, rng), [((i + 0.5) / len(FACTS), fact) for i, (fact, _, _) in enumerate(FACTS)])
    n_doc = len(qwen_model.tokenize(doc))
    full = ask_all(qwen_model, doc, n_doc, method="full", budget=1)
    assert all(full), full  # the model can answer every question from the whole document
    budget = round(0.1 * n_doc)  # cells: a tenth of the document
    on = ask_all(qwen_model, doc, n_doc, budget=budget, recall=True)
    off = ask_all(qwen_model, doc, n_doc, budget=budget, recall=False)
    streaming = ask_all(qwen_model, doc, n_doc, budget=budget, method="streaming", recall=False)  # sinks, recent span
    print(f"found: full {sum(full)}/6, recall on {sum(on)}/6, recall off {sum(off)}/6, streaming {sum(streaming)}/6")
    # recall finds all that the full cache finds (measured: 6 of 6 since the answer reads the context's headroom, on
    # 1,215 tokens and on these 780; 5 before, 4 before an answer's first tokens re-selected too: docs/recall.md); the
    # control, which keeps only what the document's own reading chose, loses them, and so does StreamingLLM, which
    # keeps none of the document
    assert on == full, on
    assert sum(off) + 3 <= sum(on) and sum(streaming) + 3 <= sum(on)


@pytest.mark.slow(4)
def test_profile_recall_times_every_part_of_a_swap(smollm2):
    """tools/profile_recall (where a swap's time goes) runs on the engine as it is and times each part it names: a
    part renamed or moved (as when re-selection left engine.py) fails here instead of in the next profile."""
    r = subprocess.run([sys.executable, "-m", "tools.profile_recall", str(smollm2), "--tokens", "700", "--steps", "3",
                        "-t", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    head, _, *table, scored = r.stdout.splitlines()
    rows = {line[:20].strip(): int(line.split()[-1]) for line in table if line.strip()}  # part -> calls
    parts = ("step", "swap", "plan", "apply", "with_candidates", "choose_candidates", "store_evicted",
             "evicted", "tier add", "attention_keep")
    assert all(rows.get(p, 0) > 0 for p in parts), r.stdout  # each part ran in the 3 swaps
    assert "3 steps, 3 swapped" in head, r.stdout
    assert rows["attention_keep"] == 3 * 30, r.stdout  # the plan's kernel: once per layer and swap (SmolLM2: 30 layers)
    per_swap = int(re.search(r"the plan scores ([\d,]+) rows a swap", scored)[1].replace(",", ""))
    assert per_swap >= 30 * 3, r.stdout  # at least a row per layer and KV head


def test_probe_cost_measures_the_probe_beside_what_the_engine_counts(smollm2):
    """tools/probe_cost (a probe decoded with a chunk: its marginal cost against the token share the engine counts as
    ``observe``) runs on the runtime as it is and prints its three decodes and the comparison."""
    r = subprocess.run([sys.executable, "-m", "tools.probe_cost", str(smollm2), "--cells", "64", "--chunk", "48",
                        "--probe", "8", "--repeat", "1", "-t", "1"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    head, decodes, cost = r.stdout.splitlines()
    assert "64 cells held · chunk 48 · probe 8 · 1 repeats" in head, r.stdout
    assert re.fullmatch(r"  chunk alone [\d.]+, with the probe [\d.]+, with its queries captured [\d.]+",
                        decodes), r.stdout
    assert re.fullmatch(r"  the probe's cost: tokens -?[\d.]+ \+ capture -?[\d.]+ = -?[\d.]+; counted by token share "
                        r"[\d.]+ \(-?[\d.]+x\)", cost), r.stdout


@pytest.mark.slow(4)
def test_recall_bounds_measures_the_page_bounds_against_the_exact_logits(smollm2):
    """tools/recall_bounds (how many of the rows a re-selection's queries attend to most the page bounds' candidates
    hold, and the attention mass the bounds allow against the exact one) runs on the engine as it is: candidates of
    more budgets are more pages in the same order, so they hold at least as many of those rows; a bound is a bound,
    so the mass it allows is at least the exact one."""
    r = subprocess.run([sys.executable, "-m", "tools.recall_bounds", str(smollm2), "--tokens", "700", "--steps", "2",
                        "--top", "16", "-t", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    head, _, *budgets, mass = r.stdout.splitlines()
    assert re.search(r"700 tokens read · head budget \d+ · 3 re-selections", head), r.stdout
    shares = [float(re.search(r"\): ([\d.]+) \(", line)[1]) for line in budgets]
    assert len(shares) == 3 and 0 <= shares[0] <= shares[1] <= shares[2] <= 1, r.stdout
    numbers = re.search(r"by the page bounds ([\d.e+-]+|inf), exactly ([\d.e+-]+)", mass).groups()
    bound, exact = (float(x) for x in numbers)
    assert bound >= exact >= 0, r.stdout


@pytest.mark.slow(5)
def test_profile_prefill_times_every_part_of_an_event(smollm2):
    """tools/profile_prefill (where a prompt's compression events spend their time, with their page faults) runs on
    the engine as it is, times each part it names, and its engine breakdown is the one `kvlocal bench` reports. It
    reads the prompt as `kvlocal run` does: the question's re-selection after the events is one more read, plan and
    apply, written whole (a union of cells and tier rows), not moved in place."""
    r = subprocess.run([sys.executable, "-m", "tools.profile_prefill", str(smollm2), "--tokens", "900", "-t", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    head, _, *table = r.stdout.splitlines()
    events = int(re.search(r"in (\d+) events: observe [\d.]+, read [\d.]+, score [\d.]+, apply [\d.]+", head)[1])
    calls = {line[:20].strip(): int(line.split()[-2]) for line in table if line.strip()}
    assert "state backend in place" in head  # the patched runtime's CPU cache: read, and rows moved, where it lies
    assert events > 1 and all(calls.get(p) == events for p in ("compress", "view.compact")), r.stdout
    assert all(calls.get(p) == events + 1 for p in ("plan", "apply", "kv.read", "kv.apply", "view.read",
                                                    "store_evicted")) and calls.get("view.write") == 1, r.stdout
    assert re.search(r"then the question's re-selection [\d.]+ s", head), head
    assert "get_blob" not in calls, r.stdout
    assert calls["tier add"] > 0 and all(int(line.split()[-1].replace(",", "")) >= 0 for line in table), r.stdout
