"""Where a compressed chat loses which value belongs to which key: the full cache's attention against what the
recall tier holds, question by question (docs/recall.md § Similar facts: where the binding is lost).

    python -m tools.recall_binding qwen2.5-coder-0.5b --seed 1
    python -m tools.recall_binding smollm2-135m --task multifact12 --budget 0.1 --tokens 2048 --seed 2 --heads 8

Runs one item of ``kvlocal eval``'s multi-fact task (a document holding facts of one template, read first, each
fact asked in a turn of its own) twice, as the eval does: on the full cache and on CriticalKV with the recall tier
at ``--budget``. For every question:

- **full**: the attention the query that predicts the value's first token gives the document (per layer and KV
  head, the mean over its query heads); the ``--heads`` (layer, KV head)s that give the asked value the most are the
  question's *retrieval heads*;
- **recall**, in those heads: the share of the asked value's rows (and of its key's) among the candidates the
  question's page bounds chose, on the device after the question's swap, and on the device when the value's first
  token is predicted (after the answer's swaps up to it); and the attention the compressed chat's own query gives
  there to the asked value, to the other facts' values and to the chat's history (earlier questions and answers);
- **the query**: per layer, the cosine between the two runs' queries that predict the reply's first token (the
  same token at the same position: what differs is the cache they were computed over), and the share of the full
  cache's attention to the document that went to rows the recall run did not hold.

Before the questions, **the reading**: per layer, the cosine between the keys (and values) of the document's rows the
recall run holds after reading it and the full cache's rows of the same tokens, by quarter of the document — the rows
read after a compression event were computed over the cells it left, and drift (docs/recall.md § Similar facts).

Then the means over the questions answered, confused (another fact's value) and missed. The keys are read and the
attention computed in numpy: 1-3 minutes for a twelve-question chat at 2K tokens on 2 cores (Qwen2.5-Coder-0.5B).
"""

from __future__ import annotations

import argparse
import copy
import itertools
from dataclasses import dataclass, field

import numpy as np

import kvlocal.recall.reselect as reselect
from kvlocal.chat.turns import Turns
from kvlocal.engine import Engine
from kvlocal.eval.runner import Runner, Spec
from kvlocal.models import resolve
from kvlocal.runtime import Model, Sampler

CLASSES = ("value", "key", "other values", "history")  # what a compressed chat's attention is split into


@dataclass
class Fact:
    key: set[int]  # positions of the key's tokens in the document
    value: set[int]  # and of the value's
    text: str  # the value as text


@dataclass
class Moment:
    """The recall run at one re-selection: the reply's length then, the positions each (layer, KV head) holds
    after it, the candidates it scored, and the attention the observation's last query gives each class."""

    reply_len: int
    held: list[list[set]]
    candidates: list[list[set]] | None
    mass: np.ndarray  # [n_layer, Hkv, len(CLASSES)]: by the observation's last query, after the swap


@dataclass
class Turn:
    question: str
    expected: str
    reply: str = ""
    value_step: int = 0  # the reply token whose prediction is the value's first token (full cache)
    full: np.ndarray | None = None  # [n_layer, Hkv, len(CLASSES)]: the full cache's attention, predicting the value
    full_att: list | None = None  # per layer (attention [Hkv, n], positions [Hkv, n]) of that query, full cache
    full_q: list | None = None  # per layer [Hq, d]: the query that predicts the reply's first token, full cache
    comp_q: list | None = None  # and the recall run's
    moments: list[Moment] = field(default_factory=list)
    asked: set[int] = field(default_factory=set)  # the positions of the question's tokens (the recall run)
    first_mass: np.ndarray | None = None  # [n_layer, Hkv, len(CLASSES)]: the recall run's, predicting the reply


def token_spans(model: Model, text: str) -> tuple[list[str], list[int]]:
    """The pieces of ``text`` as the model tokenizes it (specials parsed) and their end offsets."""
    pieces = [model.detokenize([t]) for t in model.tokenize(text, add_special=True, parse_special=True)]
    return pieces, list(itertools.accumulate(len(x) for x in pieces))


def covering(pieces: list[str], ends: list[int], a: int, b: int) -> set[int]:
    """The token positions whose text overlaps ``text[a:b]``."""
    return {p for p, (end, x) in enumerate(zip(ends, pieces)) if end > a and end - len(x) < b}


def fact_positions(model: Model, fed_text: str, facts) -> tuple[list[Fact], int]:
    """Each fact's key and value positions in the chat's first turn, and where that turn ends."""
    pieces, ends = token_spans(model, fed_text)
    text = "".join(pieces)
    out = []
    for key, value, sentence in facts:
        at = text.index(sentence)
        k, v = at + sentence.index(key), at + sentence.index(value)
        out.append(Fact(covering(pieces, ends, k, k + len(key)), covering(pieces, ends, v, v + len(value)), value))
    return out, len(pieces)


def attention(eng: Engine, q: list[np.ndarray], j: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per compressed layer: the attention ``[Hkv, n]`` (the mean over each KV head's query heads) of query ``j``
    of the observation ``q`` over the cells the engine holds now, and the cells' positions ``[Hkv, n]``."""
    read = eng.compressor.read()
    scale = np.sqrt(eng.head_dim)
    att, pos = [], []
    for i, qi in enumerate(q):
        qs = qi[:, j] * eng.compressor.q_scale
        keys = read.kv.k[i].astype(np.float32)
        if eng.basis is not None:
            qs, keys = eng.basis.queries(qs), eng.basis.keys(read.kv.k[i])
        hkv = keys.shape[1]
        group = qs.shape[0] // hkv
        true = read.true[i]
        a = np.zeros(true.shape, np.float64)
        for h in range(hkv):
            logits = qs[h * group:(h + 1) * group] @ keys[:, h].T / scale  # [G, n]
            logits[:, true[h] < 0] = -np.inf
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            a[h] = (p / p.sum(axis=1, keepdims=True)).mean(axis=0)
        att.append(a)
        pos.append(true)
    return att, pos


def class_mass(att, pos, fact: Fact, others: set[int], doc_end: int) -> np.ndarray:
    """[n_layer, Hkv, len(CLASSES)]: the attention each class of positions takes."""
    out = np.zeros((len(att), att[0].shape[0], len(CLASSES)))
    for i, (a, p) in enumerate(zip(att, pos)):
        for c, sel in enumerate((np.isin(p, list(fact.value)), np.isin(p, list(fact.key)), np.isin(p, list(others)),
                                 p >= doc_end)):
            out[i, :, c] = (a * sel).sum(axis=1)
    return out


def on_device(eng: Engine) -> list[list[set]]:
    true = eng.compressor.read().true
    return [[set(row[row >= 0].tolist()) for row in layer] for layer in true]


def last_tokens(eng: Engine) -> list[int]:
    """A one-item list that holds the last token of each turn ``eng.append`` adds (the last prompt token)."""
    seen = [None]
    append = eng.append

    def wrapped(tokens, *a, **kw):
        seen[0] = list(tokens)[-1]
        return append(tokens, *a, **kw)

    eng.append = wrapped
    return seen


def full_turn(eng: Engine, session: Turns, last: list, turn: Turn, fact: Fact, others: set[int],
              doc_end: int, model: Model) -> None:
    """Ask on the full cache; then decode the last prompt token and the reply again with their queries captured
    (the same tokens at the same positions: the cache as it was) to find what the query that predicts the value's
    first token attends to."""
    turn.reply = "".join(session.ask(turn.question, max_tokens=16))  # (the eval's n_generate)
    reply = list(eng._reply)  # every token the reply decoded (an end token too)
    n1 = eng.n_past
    p_last = n1 - len(reply) - 1  # the last prompt token: its query predicts the reply's first token
    turn.value_step = value_step(model, reply, turn.expected)
    probe = [last[0]] + reply[:-1]
    eng.ctx.remove(p_last, -1)
    eng.n_past = p_last
    q = eng.observer.observe(probe)[0]
    att, pos = attention(eng, q, turn.value_step)
    turn.full = class_mass(att, pos, fact, others, doc_end)
    turn.full_att = list(zip(att, pos))
    turn.full_q = [qi[:, 0] for qi in q]
    eng.logits = eng.cells.decode(probe + reply[-1:], list(range(p_last, n1)), "last")
    eng.n_past = n1


def value_step(model: Model, reply: list[int], value: str) -> int:
    """The query (0: the last prompt token's, j: the reply's token j-1's) that predicts the reply's first token of
    ``value``; the first one where the reply does not hold it."""
    pieces = [model.detokenize([t]) for t in reply]
    start = "".join(pieces).find(value)
    ends = list(itertools.accumulate(len(x) for x in pieces))
    return next((j for j, e in enumerate(ends) if e > start), 0) if start >= 0 else 0


def watch(eng: Engine, facts: list[Fact], doc_end: int, now: list) -> None:
    """Record a :class:`Moment` at each of the recall engine's re-selections into ``now[1]`` (``now[0]``: the
    index of the asked fact; ``now[2]``: the positions of the question's own tokens, set when it re-selects)."""
    swap_fn, question_fn, choose = eng.reselection.swap, eng.reselect, reselect.choose_candidates
    chosen, asking = [None], [False]

    def choose_and_keep(tier, q, n_rows):
        cands = choose(tier, q, n_rows)
        chosen[0] = [[set(tier.heads[l][h].pos[ids].tolist()) for h, ids in enumerate(layer)]
                     for l, layer in enumerate(cands.ids)]
        return cands

    def question(probe, pending=None):
        now[2] = set(range(eng.n_past, eng.n_past + (len(probe) if pending is None else pending)))
        asking[0] = True
        try:
            return question_fn(probe, pending)
        finally:
            asking[0] = False

    def wrapped(q, q_pos, *a, **kw):
        chosen[0] = None
        moved = swap_fn(q, q_pos, *a, **kw)
        fact = facts[now[0]]
        others = set().union(*(f.value for f in facts if f is not fact))
        att, pos = attention(eng, q, -1)
        now[1].append(Moment(-1 if asking[0] else len(eng._reply), on_device(eng), chosen[0],
                             class_mass(att, pos, fact, others, doc_end)))
        return moved

    reselect.choose_candidates = choose_and_keep
    eng.reselection.swap, eng.reselect = wrapped, question


def watch_answer(eng: Engine, last: list, facts: list[Fact], doc_end: int, now: list) -> None:
    """Before each reply of the recall engine: the attention of the query that predicts the reply's first token,
    exactly as the decode computed it (the last prompt token decoded again with its query captured, the engine's
    observation state put back), into ``now[3]``."""
    generate = eng.generate

    def wrapped(*a, **kw):
        p_last = eng.n_past - 1
        kept = copy.deepcopy(eng.observations), eng.last_probe
        eng.ctx.remove(p_last, -1)
        eng.n_past = p_last
        q = eng.observer.observe([last[0]])[0]
        fact = facts[now[0]]
        others = set().union(*(f.value for f in facts if f is not fact))
        att, pos = attention(eng, q, -1)
        now[3] = class_mass(att, pos, fact, others, doc_end), [qi[:, -1] for qi in q]
        eng.logits = eng.cells.decode([last[0]], [p_last], "last")
        eng.n_past = p_last + 1
        eng.observer.observations, eng.observer.last_probe = kept
        yield from generate(*a, **kw)

    eng.generate = wrapped


def share(sets: list[list[set]] | None, positions: set[int], heads) -> float:
    """The mean share of ``positions`` that ``sets`` holds over the (layer, KV head)s ``heads``."""
    if sets is None or not positions:
        return float("nan")
    return float(np.mean([len(positions & sets[l][h]) / len(positions) for l, h in heads]))


def verdict(reply: str, fact: Fact, facts: list[Fact]) -> str:
    if fact.text in reply:
        return "answered"
    return "confused" if any(f.text in reply for f in facts) else "missed"


def run(args) -> list[tuple[Turn, Fact, list[Fact], int]]:
    """Both chats, as ``kvlocal eval`` runs them (its engines, budget and room), question by question."""
    path = resolve(args.model)
    runner = Runner(args.model, path, args.threads)
    model = runner.model
    specs = [Spec(args.model, args.task, method, budget, "chat", args.seed, args.tokens)
             for method, budget in (("full", 1.0), (args.method, args.budget))]
    item = runner.items(specs[0], None)[0]
    max_tokens = len(model.tokenize(item.prompt)) + runner.chat_room(item)
    full, comp = (runner.engine(s, max_tokens) for s in specs)
    sessions = [Turns(e, Sampler()) for e in (full, comp)]
    last, last_comp = last_tokens(full), last_tokens(comp)
    for s in sessions:
        s.ask(item.document + "\n\nRead this text; I will ask you about it.", max_tokens=8)
    facts, doc_end = fact_positions(model, sessions[0].t.fed_text, item.facts)
    drift = reading_drift(full, comp, doc_end)
    print(f"the document read: {comp.stats.compression_events} compression events; the cosine of the recall run's "
          f"rows held with the full cache's, by quarter of the document (layers 0, 4, 8, ...):")
    for t, name in enumerate(("keys", "values")):
        for i in range(0, drift.shape[1], 4):
            print(f"  {name} layer {i:2}: " + " ".join(f"{c:.3f}" for c in drift[t, i]))
    order = {value: i for i, (_, value, _) in enumerate(item.facts)}
    now = [0, [], set(), None]
    watch(comp, facts, doc_end, now)
    watch_answer(comp, last_comp, facts, doc_end, now)
    out = []
    for question, expected in item.turns[:args.questions]:
        turn = Turn(question, expected)
        now[0], now[1] = order[expected], turn.moments
        fact = facts[now[0]]
        others = set().union(*(f.value for f in facts if f is not fact))
        full_turn(full, sessions[0], last, turn, fact, others, doc_end, model)
        full_reply = turn.reply
        turn.reply = "".join(sessions[1].ask(question, max_tokens=item.n_generate))
        turn.asked, (turn.first_mass, turn.comp_q) = now[2], now[3]
        if expected not in full_reply:
            print(f"\nQ: {question}\n  the full cache did not answer it ({full_reply.strip()!r}); recall: "
                  f"{turn.reply.strip()!r} ({verdict(turn.reply, fact, facts)}): not analysed")
            continue
        out.append((turn, fact, facts, doc_end))
        report_turn(turn, fact, facts, full_reply, args.heads, doc_end)
    return out


def heads_of(turn: Turn, n: int, c: int = 0) -> list[tuple[int, int]]:
    """The question's retrieval heads: the ``n`` (layer, KV head)s whose full-cache attention gives the asked
    value (class ``c``: :data:`CLASSES`) the most."""
    m = turn.full[..., c]
    best = np.argsort(-m, axis=None)[:n]
    return [tuple(int(x) for x in np.unravel_index(b, m.shape)) for b in best]


def at_value(turn: Turn) -> Moment | None:
    """The recall run's last re-selection before the value's first token was predicted (the question's is -1)."""
    before = [m for m in turn.moments if m.reply_len < turn.value_step]
    return before[-1] if before else None


def figures(turn: Turn, fact: Fact, n: int) -> dict:
    heads = heads_of(turn, n)
    q = next((m for m in turn.moments if m.reply_len < 0), None)
    v = at_value(turn)
    mass = turn.first_mass if turn.value_step == 0 else v.mass if v else None
    keys = heads_of(turn, n, 1)  # the heads that look at the asked key in the document most
    return {**{f"full {c} mass": float(np.mean([turn.full[l, h, i] for l, h in heads])) for i, c in enumerate(CLASSES)},
            "value in candidates": share(q.candidates if q else None, fact.value, heads),
            "key in candidates": share(q.candidates if q else None, fact.key, heads),
            "value held (question)": share(q.held if q else None, fact.value, heads),
            "key held (question)": share(q.held if q else None, fact.key, heads),
            "value held (at value)": share(v.held if v else None, fact.value, heads),
            "key held (at value)": share(v.held if v else None, fact.key, heads),
            "question held (at value)": share(v.held if v else None, turn.asked, heads),
            "key heads: full key mass": float(np.mean([turn.full[l, h, 1] for l, h in keys])),
            "key heads: key held (q)": share(q.held if q else None, fact.key, keys),
            "key heads: recall key mass": (float(np.mean([turn.first_mass[l, h, 1] for l, h in keys]))
                                           if turn.value_step == 0 and turn.first_mass is not None else float("nan")),
            **({f"recall {c} mass": float(np.mean([mass[l, h, i] for l, h in heads])) for i, c in enumerate(CLASSES)}
               if mass is not None else {})}


def lost_by_layer(turn: Turn, doc_end: int) -> np.ndarray | None:
    """Per layer, the share of the full cache's attention to the document (the query that predicts the value, the
    mean over KV heads) that goes to rows the recall run does not hold when that query runs."""
    v = at_value(turn)
    if v is None or turn.full_att is None:
        return None
    out = []
    for l, (att, pos) in enumerate(turn.full_att):
        doc = (pos >= 0) & (pos < doc_end)
        held = np.array([[p in v.held[l][h] for p in row] for h, row in enumerate(pos)])
        total = (att * doc).sum()
        out.append((att * doc * ~held).sum() / total if total > 0 else np.nan)
    return np.array(out)


def reading_drift(full: Engine, comp: Engine, doc_end: int, parts: int = 4) -> np.ndarray:
    """[2, n_layer, parts]: per layer, the mean cosine between the recall run's keys (0) and values (1) of the
    document's rows it holds after the reading and the full cache's of the same positions, by ``parts`` of the
    document (the rows of a part read after a compression event were computed over the cache it left)."""
    a, b = full.compressor.read(), comp.compressor.read()
    out = np.full((2, len(b.true), parts), np.nan)
    for i in range(len(b.true)):
        where = {int(p): c for c, p in enumerate(a.true[i][0]) if p >= 0}  # (the full cache: every head alike)
        for t, (xa, xb) in enumerate(((a.kv.k[i], b.kv.k[i]), (a.kv.v[i], b.kv.v[i]))):
            cos = [[] for _ in range(parts)]
            for h, row in enumerate(b.true[i]):
                for c, p in enumerate(row):
                    if 0 <= p < doc_end and int(p) in where:
                        u, v = xa[where[int(p)], h].astype(np.float32), xb[c, h].astype(np.float32)
                        cos[min(parts - 1, p * parts // doc_end)].append(
                            u @ v / (np.linalg.norm(u) * np.linalg.norm(v) + 1e-9))
            out[t, i] = [np.mean(x) if x else np.nan for x in cos]
    return out


def query_cosines(turn: Turn) -> np.ndarray:
    """Per layer, the mean over query heads of the cosine between the two runs' queries that predict the reply's
    first token (the same tokens at the same positions: what differs is the cache they were computed over)."""
    out = []
    for a, b in zip(turn.full_q, turn.comp_q):
        out.append(float(np.mean(np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-9))))
    return np.array(out)


def report_turn(turn: Turn, fact: Fact, facts: list[Fact], full_reply: str, n: int, doc_end: int) -> None:
    heads = heads_of(turn, n)
    f = figures(turn, fact, n)
    print(f"\nQ: {turn.question}\n  expected {turn.expected}; full: {full_reply.strip()!r}; "
          f"recall: {turn.reply.strip()!r} ({verdict(turn.reply, fact, facts)}); value predicted at step "
          f"{turn.value_step}; swaps {[m.reply_len for m in turn.moments]}")
    print("  retrieval heads (layer, KV head): " + ", ".join(f"({l},{h}) {turn.full[l, h, 0]:.2f}" for l, h in heads))
    print("  key heads: " + ", ".join(f"({l},{h}) {turn.full[l, h, 1]:.2f}" for l, h in heads_of(turn, n, 1)))
    print("  " + "; ".join(f"{k} {v:.2f}" for k, v in f.items()), flush=True)
    if turn.comp_q is not None:
        print("  cosine of the recall run's query predicting the reply with the full cache's, by layer: "
              + " ".join(f"{c:.2f}" for c in query_cosines(turn)), flush=True)
    lost = lost_by_layer(turn, doc_end)
    if lost is not None:
        print("  the full cache's attention to the document on rows recall does not hold, by layer: "
              + " ".join(f"{x:.2f}" for x in lost), flush=True)


def summary(turns, n: int) -> None:
    rows = {}
    for turn, fact, facts, _ in turns:
        rows.setdefault(verdict(turn.reply, fact, facts), []).append(figures(turn, fact, n))
    cos = {}
    for turn, fact, facts, _ in turns:
        if turn.comp_q is not None and turn.value_step == 0:
            cos.setdefault(verdict(turn.reply, fact, facts), []).append(query_cosines(turn))
    for v, cs in sorted(cos.items()):
        print(f"query cosine by layer, {v} ({len(cs)}): " + " ".join(f"{c:.2f}" for c in np.mean(cs, axis=0)))
    print(f"\nmeans over the questions, in each question's {n} retrieval heads:")
    keys = list(next(iter(rows.values()))[0]) if rows else []
    for k in keys:
        print(f"  {k:28}" + "  ".join(f"{v}: {np.nanmean([r.get(k, np.nan) for r in rs]):.2f} ({len(rs)})"
                                      for v, rs in sorted(rows.items())))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--task", default="multifact", choices=("multifact", "multifact12"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--method", default="criticalkv+recall", help="an eval method name (default criticalkv+recall)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8, help="retrieval heads per question (default 8)")
    ap.add_argument("--questions", type=int, default=None, help="ask only the first N questions")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    summary(run(args), args.heads)


if __name__ == "__main__":
    main()
