"""`kvlocal eval`'s multi-fact chat (issue 61): N facts of one shape in a document, each asked in a turn of its own;
a reply with another fact's value is *confused*. The items, the verdicts and loops on hand-written replies, the
summary's cells, and one real run on SmolLM2."""

from __future__ import annotations

import argparse
import math

import pytest

from kvlocal.eval.command import _options, add_arguments
from kvlocal.eval.report import summary, with_loss
from kvlocal.eval.tasks import FACT_TEMPLATES, Item, Prose, loops, make_items, shares, verdict


def _prose() -> Prose:
    return Prose(lambda s: len(s.split()))  # a word is a token: enough to check the generators


@pytest.mark.parametrize("task, n", [("multifact", 6), ("multifact12", 12)])
def test_multifact_asks_every_fact_of_one_shape_in_a_shuffled_order(task, n):
    seen_templates, items = set(), {}
    for seed in range(1, 9):
        item = make_items(task, _prose(), 2048, seed)[0]
        items[seed] = item
        assert item.kind == "chat" and item.task == task and len(item.facts) == len(item.turns) == n
        keys, values = [k for k, _, _ in item.facts], [v for _, v, _ in item.facts]
        assert len(set(keys)) == n and len(set(values)) == n
        assert all(len(v) >= 4 and not any(v in w for w in values if w != v) for v in values)
        template = next(t for t in FACT_TEMPLATES if item.facts[0][2] == t.fact.format(key=keys[0], value=values[0]))
        seen_templates.add(template.name)
        at = []
        for k, v, sentence in item.facts:  # one template; each fact once in the document, in document order
            assert sentence == template.fact.format(key=k, value=v)
            assert item.document.count(sentence) == 1 and item.document.count(v) == 1
            at.append(item.document.index(sentence))
        assert at == sorted(at)
        # spread: the first fact in the document's first half, the last in its second
        assert at[0] < len(item.document) / 2 < at[-1]
        asked = [e for _, e in item.turns]
        assert sorted(asked) == sorted(values) and item.expected == asked and asked != values  # shuffled
        assert [q for q, _ in item.turns] == [template.question.format(key=keys[values.index(e)]) for e in asked]
        assert 2048 <= len(item.document.split()) <= 2048 + 120
    assert len(seen_templates) >= 3  # the seed picks the template
    again = make_items(task, _prose(), 2048, 1)[0]
    assert (again.document, again.turns) == (items[1].document, items[1].turns)
    assert items[1].document != items[2].document and items[1].turns != items[2].turns


def test_multifact_documents_are_about_the_asked_tokens_for_a_real_tokenizer(smollm2_model):
    count = lambda s: len(smollm2_model.tokenize(s, add_special=False))  # noqa: E731
    for task in ("multifact", "multifact12"):
        for seed in (1, 2):
            doc = make_items(task, Prose(count), 1024, seed)[0].document
            assert 0.97 * 1024 <= count(doc) <= 1024 + 100, (task, seed, count(doc))  # the text joined: a few fewer


def test_multiturn_carries_its_four_door_codes_as_facts():
    item = make_items("multiturn", _prose(), 1024, 1)[0]
    assert len(item.facts) == 4 and len(item.turns) == 3
    assert {e for _, e in item.turns} < {v for _, v, _ in item.facts}
    assert all(sentence in item.document and v in sentence for _, v, sentence in item.facts)


def test_a_reply_is_answered_confused_or_missed():
    item = Item("multifact", "3 order numbers", "doc", "", kind="chat",
                facts=[("Oslo", "481302", "…"), ("Lima", "775120", "…"), ("Riga", "230918", "…")])
    assert verdict(item, "481302", "The order number is 481302.") == "answered"
    assert verdict(item, "481302", "481302, or maybe 775120") == "answered"
    assert verdict(item, "481302", "The warehouse in Oslo holds order number 775120.") == "confused"
    assert verdict(item, "481302", "It holds order number 481320.") == "missed"  # a near miss is no other fact
    s = shares(["answered", "confused", "missed", "confused"])
    assert s == {"answered": 0.25, "confused": 0.5, "missed": 0.25} and sum(s.values()) == 1


def test_a_reply_loops_when_one_span_of_three_tokens_comes_three_times():
    words = "The pass code of the pass code of the pass code of".split()
    ids = {w: i for i, w in enumerate(dict.fromkeys(words))}
    assert loops([ids[w] for w in words])
    assert loops([4] * 5) and not loops([4] * 4)  # 5 equal tokens: 3 spans "4 4 4"
    assert not loops(list(range(16))) and not loops([1, 2, 3, 1, 2, 3, 9, 1, 2])  # twice is not a loop
    assert not loops([])


def _record(method, budget, task, score, **extra):
    return {"model": "m", "model_file": "m.gguf", "task": task, "method": method, "budget": budget,
            "observation": "-" if method == "full" else "chat", "seed": 1, "n_tokens": 1024, "prompt_tokens": 1030,
            "score": score, "kv_bytes_allocated": 2**20, **extra}


def test_summary_shows_confused_and_loops_for_chat_tasks_only():
    records = with_loss([
        _record("full", 1.0, "multifact", 1.0, confused=0.0, missed=0.0, loops=0.0),
        _record("full", 1.0, "needle", 1.0),
        _record("criticalkv", 0.1, "multifact", 0.5, confused=1 / 3, missed=1 / 6, loops=1 / 6),
        _record("criticalkv", 0.1, "needle", 0.5)])
    text = summary(records)
    assert "| full | 1 | - | 1.00 c 0.00 l 0.00 | 1.00 |" in text
    assert "| criticalkv | 0.1 | chat | 0.50 (0.50) c 0.33 l 0.17 | 0.50 (0.50) |" in text
    assert "c: the share of chat turns answered with another fact's value" in text
    assert "c: the share" not in summary(with_loss([_record("full", 1.0, "needle", 1.0)]))


def test_summary_of_several_seeds_gives_each_cell_the_mean_over_them():
    """One results file may hold several seeds' runs (one ``kvlocal eval --seed`` each): a cell is their mean, not
    the last one read, and the heading names the seeds."""
    records = with_loss([
        _record("full", 1.0, "multifact", 1.0, confused=0.0, missed=0.0, loops=0.0),
        _record("criticalkv", 0.1, "multifact", 0.5, confused=0.5, missed=0.0, loops=0.0),
        {**_record("full", 1.0, "multifact", 1.0, confused=0.0, missed=0.0, loops=0.0), "seed": 2},
        {**_record("criticalkv", 0.1, "multifact", 1.0, confused=0.0, missed=0.0, loops=0.0), "seed": 2}])
    text = summary(records)
    assert "the mean over seeds 1, 2" in text
    assert "| criticalkv | 0.1 | chat | 0.75 (0.25) c 0.25 l 0.00 |" in text


def test_multifact12_runs_only_when_named():
    p = argparse.ArgumentParser()
    add_arguments(p)
    default = _options(p.parse_args(["--out", "x"]))["tasks"]
    assert "multifact" in default and "multifact12" not in default and "multiturn" in default
    assert _options(p.parse_args(["--out", "x", "--tasks", "multifact", "multifact12"]))["tasks"] == [
        "multifact", "multifact12"]


@pytest.mark.slow(15)
def test_a_real_multifact_run_records_every_turn_and_its_shares(smollm2):
    from kvlocal.eval.runner import Runner, Spec

    runner = Runner("smollm2-135m", smollm2, None)
    rec = runner.run(Spec("smollm2-135m", "multifact", "full", 1.0, "-", 1, 1024))
    assert rec["confused"] + rec["missed"] + rec["score"] == pytest.approx(1)
    assert 0 <= rec["loops"] <= 1
    [item] = rec["items"]
    assert len(item["turns"]) == 6 and [t["expected"] for t in item["turns"]] == runner.items(
        Spec("smollm2-135m", "multifact", "full", 1.0, "-", 1, 1024), None)[0].expected
    for t in item["turns"]:
        assert t["verdict"] in ("answered", "confused", "missed") and t["question"].endswith("only.")
        assert (t["verdict"] == "answered") == (t["expected"] in t["reply"])
    assert item["score"] == sum(t["verdict"] == "answered" for t in item["turns"]) / 6 == rec["score"]
    assert item["confused"] == sum(t["verdict"] == "confused" for t in item["turns"]) / 6
    assert rec["prompt_tokens"] >= 0.97 * 1024 and rec["compression_events"] == 0


@pytest.mark.slow(45)
def test_recall_binding_compares_the_full_caches_attention_with_what_recall_holds(qwen):
    """tools/recall_binding (docs/recall.md § Where the binding is lost) runs the multi-fact chat on the full cache and
    with recall, question by question. What it measures must hold by construction of the two runs: the query that
    predicts the reply's first token is the same token at the same position in both, so in layer 0 (the token's
    embedding, no attention before it) the two queries are one vector; the retrieval heads are the ones that give the
    asked value the most, so their mass on it is at least the mean head's; every share is a share."""
    from tools import recall_binding as rb

    args = argparse.Namespace(model=str(qwen), task="multifact", tokens=1024, budget=0.1, method="criticalkv+recall",
                              seed=5, heads=4, threads=2, questions=3)
    turns = rb.run(args)
    assert turns, "the full cache answered none of the first three questions"
    for turn, fact, facts, _ in turns:
        assert rb.query_cosines(turn)[0] > 0.9999
        assert turn.full[..., 0].max() >= turn.full[..., 0].mean()
        figures = rb.figures(turn, fact, 4)
        shares = [v for k, v in figures.items() if ("held" in k or "candidates" in k) and not math.isnan(v)]
        assert shares and all(0 <= v <= 1 for v in shares)
        assert rb.verdict(turn.reply, fact, facts) in ("answered", "confused", "missed")


def test_freeform_loops_counts_a_tail_of_one_repeated_span_only():
    """tools/freeform_loops.py's verdict: the last ``tail`` tokens one span of at most 16 (and a third of the tail)
    repeated — a reply that ends while still saying new things, or too short to hold the tail, does not loop."""
    from tools.freeform_loops import loops

    span = [11, 12, 13, 14, 15, 16, 17, 18]
    assert loops(list(range(40)) + span * 6, 48)  # "… a woman who is a woman who is …"
    assert not loops(list(range(100)), 48)  # new tokens to the end
    assert not loops(span * 5, 48)  # 40 tokens: shorter than the tail
    assert not loops(list(range(30)) + [7] * 20 + list(range(30)), 48)  # a repeat that ended
    assert not loops(list(range(100, 124)) * 4, 48)  # a span of 24 repeated to the end: over 16


def test_recall_tries_gives_its_options_to_the_try_and_the_rest_to_kvlocal_eval(monkeypatch):
    """tools/recall_tries.py: the try's own options stand before ``--``, kvlocal eval's after it (an argparse
    remainder took the try's options for eval's)."""
    import kvlocal.cli
    import tools.recall_tries as tries

    got = {}
    monkeypatch.setattr(kvlocal.cli, "main", lambda argv: got.setdefault("argv", argv) and 0)
    monkeypatch.setattr(tries, "engine_keywords", lambda values: got.setdefault("set", values))
    assert tries.main(["engine", "--set", '{"recall_steps": 4}', "--", "m", "--seed", "1", "--out", "x"]) == 0
    assert got == {"set": {"recall_steps": 4}, "argv": ["eval", "m", "--seed", "1", "--out", "x"]}
