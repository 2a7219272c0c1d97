"""A turn undone by what it changed (kvlocal.engine.undo): after an undone turn the engine is the one that never had
it — the same cells (positions, biases, every live row's K and V), records, logits, observation, recall tier and
statistics — and it goes on to the same greedy tokens with bit-identical logits; on both backends, with and without a
recall tier, for merging methods, across positions moved back and on a sliding-window model. A turn copies no K/V
where the recall tier holds what its events evicted, and only the evicted rows without one. Then kvlocal.Chat on
SmolLM2: a message cancelled while it is read, /regen, and /regen after a document read since."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "reference"))  # tiny_gguf

import tiny_gguf  # noqa: E402

from conftest import REPO  # noqa: E402
from kvlocal import Chat  # noqa: E402
from kvlocal.engine import Engine  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.eval.tasks import sample_text  # noqa: E402
from kvlocal.runtime import Model, Sampler  # noqa: E402
from kvlocal.runtime.state import read_seq  # noqa: E402

THREADS = 2
NGL = int(os.environ.get("KVLOCAL_TEST_NGL", "0"))  # 99: the cache on a GPU (as tests/backends/test_native.py)
# figures an undone turn keeps as they are: work really done (llama.cpp's transfers), memory really held (the
# tier's blocks, kept for its next rows), the copies made for the undo, and times
KEPT = ("device_transfers", "host_tier_bytes", "rollback_bytes", "rollback_copies", "compression_breakdown")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Model]:
    """Tiny models with 64-dimension heads (a real model's ratio of a row to its record), and Gemma 3's iSWA."""
    d = tmp_path_factory.mktemp("undo")
    return {arch: Model(tiny_gguf.write_tiny(d / f"{arch}.gguf", arch=arch, head_dim=64, n_swa=16, swa_pattern=3),
                        n_gpu_layers=NGL) for arch in ("llama", "gemma3")}


def state(e: Engine) -> dict:
    """What the engine's next steps depend on. Empty rows (a head's cells that hold no token, masked by a -inf bias)
    are left out: the native backend leaves whatever a cell held there."""
    r = e.kv.record
    kv = read_seq(e.ctx)
    live = r.rows(kv.pos.astype(np.int64))[0] >= 0  # [n_layer, Hkv, n]
    out = dict(cells=kv.pos, slots=r.pos, true=r.true, vnorm=r.vnorm, count=r.count, n_past=e.n_past,
               last_token=e.last_token, logits=e.logits, settled=e.compressor.settled, probe=e._probe, reply=e._reply,
               bias=None if kv.bias is None else np.stack(kv.bias))
    for i, (k, v) in enumerate(zip(kv.k, kv.v)):
        mask = live[i].T[..., None]
        out[f"k{i}"], out[f"v{i}"] = np.where(mask, k, 0), np.where(mask, v, 0)
    out.update({f"stats.{k}": v for k, v in e.stats.as_dict().items() if k not in KEPT and not k.endswith("seconds")})
    if e.tier is not None:
        out.update({f"tier.{k}": v for k, v in e.tier.to_arrays().items()})
    return out


def differences(a: Engine, b: Engine) -> list[str]:
    sa, sb = state(a), state(b)
    return [k for k in sa if not _equal(sa[k], sb[k])]


def _equal(x, y) -> bool:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return x is not None and y is not None and x.shape == y.shape and np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
    return x == y


def twins(model: Model, tokens: list[int], n_read: int, method: str = "criticalkv", **kw) -> tuple[Engine, Engine]:
    """Two identical engines that read ``n_read`` tokens and generated four."""
    pair = []
    for _ in range(2):
        e = Engine(model, 64, method, max_tokens=4000, chunk=32, recent=16, n_threads=THREADS, endless=True, **kw)
        e.prefill(tokens[:n_read], probe=tokens[400:416])
        list(e.generate(4, Sampler(), stop_at_eog=False))
        pair.append(e)
    return pair[0], pair[1]


def undone_turn(e: Engine, tokens: list[int], n_gen: int = 8) -> dict:
    """A question and the start of its answer on ``e``, then undone; what the turn did and copied."""
    s = e.stats
    events0, moved0, copied0 = s.compression_events + s.recall_events, s.repositions, s.rollback_bytes
    mark = e.mark()
    e.append(tokens, probe=tokens[-16:], question=True)
    list(e.generate(n_gen, Sampler(), stop_at_eog=False))
    s = e.stats
    did = dict(events=s.compression_events + s.recall_events - events0, moved=s.repositions - moved0,
               copied=s.rollback_bytes - copied0, log=len(mark.log), whole=mark.cells is not None)
    e.undo(mark)
    return did


def continue_alike(a: Engine, b: Engine, tokens: list[int]) -> None:
    """Both engines take the same next turn: the same greedy tokens, bit-identical logits, the same state."""
    outs = []
    for e in (a, b):
        e.append(tokens, probe=tokens[-16:], question=True)
        outs.append((list(e.generate(24, Sampler(), stop_at_eog=False)), e.logits))
    assert outs[0][0] == outs[1][0] and np.array_equal(outs[0][1], outs[1][1])
    assert differences(a, b) == []


@pytest.mark.parametrize("backend", ["state", "native"])
@pytest.mark.parametrize("method,recall", [("criticalkv", True), ("criticalkv", False), ("kvslimmer", False),
                                           ("criticalkv+kvslimmer", False)])
def test_an_undone_turn_leaves_the_engine_as_if_it_never_ran(tiny, backend, method, recall):
    model = tiny["llama"]
    tokens = model.tokenize(sample_text())
    a, b = twins(model, tokens, 400, backend=backend, method=method, recall=recall)
    whole = a.kv.save().nbytes
    turns = []
    for turn, n_gen in ((tokens[500:510], 3), (tokens[600:650], 8), (tokens[600:1000], 8)):
        turns.append(undone_turn(a, turn, n_gen))
        assert differences(a, b) == []
    short, medium, long = turns
    assert short["log"] >= 1 and not short["whole"]  # undone event by event
    if recall:  # the rows its events evicted are the tier's: nothing copied
        assert medium["log"] > short["log"] and not medium["whole"] and short["copied"] == medium["copied"] == 0
    elif method == "criticalkv":  # the evicted rows only: less than a copy of the cells
        assert not medium["whole"] and 0 < short["copied"] < medium["copied"] < whole
    else:  # a merge overwrites rows too: they are copied with the evicted ones
        assert short["copied"] > 0
    # a turn that evicts more than the cells hold (6 times their tokens) copies them at the event that would pass them
    assert long["whole"] and long["copied"] > whole
    continue_alike(a, b, tokens[1000:1040])


@pytest.mark.parametrize("backend", ["state", "native"])
def test_a_turn_that_moves_positions_back_is_undone_exactly(tiny, backend):
    """Positions moved back re-rotate every key and renumber the tier: the cells and the tier are copied before."""
    model = tiny["llama"]
    tokens = model.tokenize(sample_text())
    assert model.n_ctx_train < 1900 + 300  # the turn passes the trained context
    a, b = twins(model, tokens, 1900, backend=backend, recall=True)
    did = undone_turn(a, tokens[600:900])
    assert did["moved"] >= 1 and did["whole"] and did["copied"] > 0
    assert differences(a, b) == []
    continue_alike(a, b, tokens[1000:1040])


@pytest.mark.parametrize("backend", ["state", "native"])
def test_a_sliding_window_model_copies_its_cells_with_the_mark(tiny, backend):
    """Gemma 3's sliding cache drops cells as it decodes: the cells are copied when the turn begins."""
    model = tiny["gemma3"]
    tokens = model.tokenize(sample_text())
    a, b = twins(model, tokens, 400, backend=backend, recall=True)
    whole = a.kv.save().nbytes
    copied = a.stats.rollback_bytes
    undone_turn(a, tokens[600:900])
    assert a.stats.rollback_bytes - copied == whole and a.stats.rollback_copies == 1
    assert differences(a, b) == []
    continue_alike(a, b, tokens[1000:1040])


def test_a_mark_undone_past_is_refused(tiny):
    model = tiny["llama"]
    tokens = model.tokenize(sample_text())
    e = Engine(model, 64, max_tokens=2000, chunk=32, recent=16, n_threads=THREADS)
    e.prefill(tokens[:200])
    first = e.mark()
    e.append(tokens[200:220])
    second = e.mark()
    e.undo(first)  # closes the later mark too
    with pytest.raises(UsageError, match="can no longer be undone"):
        e.undo(second)


DOC = (REPO / "kvlocal" / "data" / "sample.txt").read_text()[:3000]


@pytest.mark.slow(60)
@pytest.mark.parametrize("backend", ["state", "native"])
def test_a_chat_undoes_a_cancelled_message_and_regenerates_on_smollm2(smollm2_model, backend):
    """A message cancelled while it is read, a reply regenerated, and one regenerated after a document was read since
    (regen takes the chat back to before that message): each time the chat goes on as one that never had what was
    undone — the same greedy reply, the same logits — and with the recall tier no turn copied any K/V."""
    def chat():  # (documents read in the budget's context: a turn read whole copies the budget's cells for its undo,
        # tests/engine/test_reading.py)
        return Chat(smollm2_model, budget=256, backend=backend, sampler=Sampler(), max_reply=12, n_threads=THREADS,
                    read_cells=0)

    with chat() as a, chat() as b:
        for c in (a, b):
            c.read(DOC, name="doc.txt")
            c.ask("What is this text about?")

        def cancel(done, total):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            next(a.send("Name every person it mentions, with what each one does.", progress=cancel))
        assert a.ask("Name one place.") == b.ask("Name one place.")
        assert np.array_equal(a.engine.logits, b.engine.logits)

        first = a.ask("What happens first?")
        assert "".join(a.regen()) == first == b.ask("What happens first?")
        assert np.array_equal(a.engine.logits, b.engine.logits) and a.messages == b.messages

        a.ask("What is the last thing it says?")
        a.read(DOC[:800], name="again.txt")
        "".join(a.regen())  # back to before the question: the document read after it goes too
        b.ask("What is the last thing it says?")
        assert a.messages == b.messages and np.array_equal(a.engine.logits, b.engine.logits)
        assert a.ask("Summarize it.") == b.ask("Summarize it.")
        assert a.stats.rollback_bytes_total == 0 and a.engine.stats.recall_events > 0
