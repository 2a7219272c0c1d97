"""Pinned spans: a chat's system message is never evicted (issue 21).

On a tiny generated model, every method keeps the pinned tokens through many events; a budget too small
for them is one line and the chat stays as it was. On Qwen2.5-Coder-0.5B, a rule set in the system prompt
(a codeword to give when asked) holds after 15 turns and more than 10× the budget of other text at budget
0.05; the same chat without pinning finds it again only through the recall tier, and without either loses it
(the control)."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "reference"))  # tiny_gguf

import tiny_gguf  # noqa: E402
from kvlocal.chat import Chat  # noqa: E402
from kvlocal.engine import Engine  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.eval.tasks import sample_text  # noqa: E402
from kvlocal.runtime import Model, Sampler  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Model:
    return Model(tiny_gguf.write_tiny(tmp_path_factory.mktemp("tiny") / "llama.gguf", arch="llama"))


@pytest.mark.parametrize("method", ["streaming", "snapkv", "criticalkv", "criticalkv+adakv", "kvslimmer"])
def test_every_method_keeps_the_pinned_tokens(tiny_llama, method):
    tokens = tiny_llama.tokenize(sample_text())[:600]
    cells = 128 if "adakv" in method else 64  # AdaKV's heads share the cells: a mean of half each
    eng = Engine(tiny_llama, cells, method, max_tokens=700, chunk=32, recent=16, recall=False)
    eng.pin(20)
    eng.prefill(tokens)
    assert eng.stats.compression_events >= 3 and eng.stats.kv_cells_pinned == 20
    true = eng.kv.read().true  # [n_layer, Hkv, cells]: every head of every layer still holds positions 0..19
    for row in true.reshape(-1, true.shape[-1]):
        assert set(range(20)) <= set(row.tolist()), method
    with pytest.raises(UsageError, match="raise --budget or shorten the system prompt"):
        eng.pin(60)  # 60 pinned + 16 recent > 64 cells (of each head)
    assert eng.stats.kv_cells_pinned == 20


def test_a_chat_pins_its_system_message_and_refuses_one_too_long(smollm2_model):
    model = smollm2_model
    system = "You are a careful assistant. Keep every answer short."
    with Chat(model, 64, system=system, recent=16, chunk=32, max_reply=2) as chat:
        chat.ask("Hello there.")
        rendered = model.chat_prompt([{"role": "system", "content": system}, {"role": "user", "content": "x"}])
        head = model.tokenize(rendered, parse_special=True)
        n = chat.stats.kv_cells_pinned
        assert 0 < n < len(head) and model.detokenize(head[:n]).count(system) == 1  # the template's opening and the message
    with Chat(model, 64, system=system, recent=16, chunk=32, max_reply=2, pin_system=False) as chat:
        chat.ask("Hello there.")
        assert chat.stats.kv_cells_pinned == 0
    with Chat(model, 64, system=" ".join(["Rule."] * 80), recent=16, chunk=32, max_reply=2) as chat:
        with pytest.raises(UsageError, match="the system prompt takes"):
            chat.ask("Hello there.")
        assert chat.messages[-1]["role"] == "system" and chat.stats.tokens_seen == 0  # as it was


def passages(n: int) -> list[str]:
    """The GPL's text after its first 60 long paragraphs (development ran on those, with another codeword),
    in ``n`` passages of equal word counts."""
    text = resources.files("kvlocal").joinpath("data/gpl-3.0.txt").read_text(encoding="utf-8")
    paras = [p for p in text.split("\n\n") if len(p.split()) > 25]
    words = text[text.index(paras[59]) + len(paras[59]):].split()
    step = len(words) // n
    return [" ".join(words[i * step:(i + 1) * step]) for i in range(n)]


@pytest.mark.slow(107)
def test_a_system_rule_holds_after_fifteen_turns_when_pinned_or_recalled(qwen_model):
    """The codeword of the system prompt, asked after 15 turns of license text (> 10x the budget of 102
    cells) at budget 0.05 of 2,048: the pinned chat gives it (recall off: pinning alone), and so does the
    unpinned chat whose recall tier brings the rule back for the question; the chat with neither does not."""
    system = ("You are a helpful assistant. The secret codeword is HERON-17. When the user asks for the "
              "codeword, reply with the codeword only.")
    texts = passages(36)[:15]
    replies = {}
    for case, pin, recall in (("pinned", True, False), ("recalled", False, True), ("neither", False, False)):
        with Chat(qwen_model, 0.05, ctx_size=2048, system=system, pin_system=pin, recall=recall,
                  sampler=Sampler(temp=0), max_reply=12) as chat:
            for i in range(15):
                chat.extend([{"role": "user", "content": "A passage to keep in mind:\n" + texts[i]},
                             {"role": "assistant", "content": "Noted."}])
            seen, budget = chat.stats.tokens_seen, chat.stats.budget_cells
            replies[case] = chat.ask("What is the codeword?")
            assert seen > 10 * budget and chat.stats.compression_events >= 15
            assert (chat.stats.kv_cells_pinned > 20) == pin
    assert "HERON-17" in replies["pinned"], replies
    assert "HERON-17" in replies["recalled"], replies  # measured: "The codeword is HERON-17."
    assert "HERON-17" not in replies["neither"], replies  # the control: the rule is gone
