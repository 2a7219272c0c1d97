"""Span-coherent recall (kvlocal.recall.spans): a question brings back the text around what it attends to most in
every head of every compressed layer, and the answer's steps keep it. Real llama.cpp on a tiny generated model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "reference"))  # tiny_gguf

import tiny_gguf  # noqa: E402
from kvlocal.engine import Engine  # noqa: E402
from kvlocal.eval.tasks import sample_text  # noqa: E402
from kvlocal.recall.spans import span_positions  # noqa: E402
from kvlocal.runtime import Model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Model:
    return Model(tiny_gguf.write_tiny(tmp_path_factory.mktemp("tiny") / "llama.gguf", arch="llama"))


def test_spans_go_around_the_largest_attention_apart_from_each_other():
    a = np.zeros(200)
    a[[2, 50, 52, 120, 190]] = [9.0, 5.0, 4.0, 3.0, 1.0]
    got = span_positions(a, skip=4, n_spans=3, radius=5)
    # position 2 is a sink (below skip); 52 is inside 50's span, so the spans go around 50, 120 and 190
    assert got.tolist() == list(range(45, 56)) + list(range(115, 126)) + list(range(185, 196))
    assert len(span_positions(a, skip=4, n_spans=3, radius=5, limit=11)) == 11  # one span fits the limit
    assert len(span_positions(np.zeros(50), skip=0)) == 0  # no attention, no span


def test_a_questions_spans_come_back_in_every_head_and_the_steps_keep_them(tiny_llama):
    tokens = tiny_llama.tokenize(sample_text())
    eng = Engine(tiny_llama, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True, recall_steps=4,
                 recall_step_confidence=1.0)
    eng.prefill(tokens[:500], probe=tokens[500:516])
    held_before = [set(row[row >= 0].tolist()) for layer in eng.kv.read().true for row in layer]
    eng.append(tokens[600:620], recall=True)
    spans = set(eng._spans.tolist())
    assert spans and len(spans) <= eng.recall_spans * 25
    # every head of every compressed layer holds every span position, whatever it held before
    after = [set(row[row >= 0].tolist()) for layer in eng.kv.read().true for row in layer]
    assert all(spans <= held for held in after)
    assert any(not spans <= held for held in held_before)  # (the question brought some of them back)
    list(eng.generate(6, stop_at_eog=False))  # four steps swap, each by its own query: the spans stay
    assert eng.stats.recall_steps == 4
    assert all(spans <= set(row[row >= 0].tolist()) for layer in eng.kv.read().true for row in layer)
    eng.append(tokens[700:720])  # a turn that is not a question forgets them
    assert eng._spans is None


def test_spans_off_leave_the_per_head_choice(tiny_llama):
    tokens = tiny_llama.tokenize(sample_text())
    eng = Engine(tiny_llama, 64, "criticalkv", max_tokens=1000, chunk=32, recent=16, recall=True)
    eng.recall_spans = 0
    eng.prefill(tokens[:500], probe=tokens[500:516])
    eng.append(tokens[600:620], recall=True)
    assert eng._spans is None
