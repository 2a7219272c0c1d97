"""A chat whose conversation really passes the budget still answers about its first turn.

Qwen2.5-Coder-0.5B (SmolLM2-135M does not keep a stated fact reliably even with the full cache), a
256-cell budget, three turns: a fact, a ~700-token text, then a question about the fact. The cache is
compressed while the text is read (scored by that turn's own probe, not knowing the question to come)
and again when the question arrives. StreamingLLM at the same budget, which keeps only the sinks and
the most recent tokens, is the control: it must lose the fact, so the test can fail.
"""

from __future__ import annotations

import pytest

from kvlocal.engine import Engine
from kvlocal.runtime import Model
from kvlocal.runtime import Sampler
from kvlocal.chat.turns import Turns
from kvlocal.eval.tasks import sample_text

BUDGET = 256
TURNS = [
    "Hello! My favourite colour is teal. Please remember it.",
    "Here is a text I like:\n\n" + sample_text()[:3000] + "\n\nWho is speaking in the first lines of dialogue?",
]
QUESTION = "What is my favourite colour?"


def _chat(model: Model, method: str) -> tuple[str, Engine]:
    eng = Engine(model, BUDGET, method=method, max_tokens=4096)
    chat = Turns(eng, Sampler())
    for turn in TURNS:
        "".join(chat.ask(turn, max_tokens=24))
    return "".join(chat.ask(QUESTION, max_tokens=24)), eng


@pytest.mark.slow(21)
@pytest.mark.parametrize("method", ["criticalkv", "streaming"])
def test_chat_past_the_budget_answers_about_its_first_turn(qwen_model, method):
    answer, eng = _chat(qwen_model, method)
    s = eng.stats
    print(f"{method}: {eng.n_past} tokens seen, {s.kv_cells_live} cells live, {s.compression_events} events: {answer!r}")
    assert eng.n_past > 3 * BUDGET and s.compression_events >= 2 and s.kv_cells_live <= eng.ctx.n_ctx
    if method == "streaming":  # the control: the first turn is long gone from a sinks + recent cache
        assert "teal" not in answer.lower()
    else:
        assert "teal" in answer.lower()
