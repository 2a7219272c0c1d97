"""The recall tier's development chat: six facts "The locker of NAME holds the number CODE." spread through
~2,000 tokens of prose, read into a chat at a small budget, then asked one per turn. The seeds 77-84 and
these facts are what recall was developed on — not the texts or seeds of the reported eval (docs/eval.md,
seed 11) — so its figures say how a choice was made, not how well kvlocal does (docs/recall.md § Choices).

    .venv/bin/python examples/locker_chat.py [--model qwen2.5-coder-0.5b] [--budget 200] [--seeds 77 78 ...]
        [--cache f16|q8_0|q4_0] [--step-confidence 0.9] [--recall-steps 16] [--room 64] [--low-water 0.75]
        [--observe-every 4] [--prefill-observe probe|window] [--value-norm l1|l2] [--rows]

Prints per seed the facts found of 6, the answer steps (and how many kept their decode), their seconds, and
each miss as (asked code, answer); then the total, and what the misses answered (the next fact's code in the
document, the previous one's, another fact's, or none). ``--rows``: for found and missed facts, the share of
the asked name's rows, its code's and the next fact's code's on the device after the question's swap and after
the answer.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import random
import time

import numpy as np

import kvlocal
from kvlocal.compress import VALUE_NORMS
from kvlocal.engine import (LOW_WATER, OBSERVE_EVERY, PREFILL_OBSERVATIONS, PREFILL_OBSERVE, RECALL_ROOM,
                            RECALL_STEP_CONFIDENCE, RECALL_STEP_EVERY, RECALL_STEPS)
from kvlocal.eval.tasks import Prose, insert_at
from kvlocal.models import resolve
from kvlocal.runtime import Model

NAMES = ["Alder", "Birch", "Cedar", "Hazel", "Maple", "Rowan", "Willow", "Aspen"]


def chat(model: Model, seed: int, args):
    """One chat: the document read, then each locker asked for in turn. Returns ``(found, code, answer)`` per
    fact, the engine's stats and (``--rows``) ``(found, shares)`` per fact, shares ``[6, layers × KV heads]``."""
    rng = random.Random(seed)
    names = rng.sample(NAMES, 6)
    codes = [str(rng.randint(10000, 99999)) for _ in names]
    prose = Prose(lambda s: len(model.tokenize(s, add_special=False)))
    facts = [f"The locker of {n} holds the number {c}." for n, c in zip(names, codes)]
    doc = insert_at(prose.take(2000, rng), [((i + 0.5) / 6, f) for i, f in enumerate(facts)])
    out, rows = [], []
    with kvlocal.Chat(model, ctx_size=len(model.tokenize(doc)) + 1200, budget=args.budget, n_threads=args.threads,
                      cache_type_k=args.cache, cache_type_v=args.cache, recall_steps=args.recall_steps,
                      low_water=args.low_water, value_norm=args.value_norm, observe_every=args.observe_every,
                      prefill_observe=args.prefill_observe) as c:
        r = c.engine.reselection  # the recall tier's re-selection and its settings
        r.step_confidence, r.step_every, r.room = args.step_confidence, args.step_every, args.room
        c.read(doc)
        if args.rows:
            where = fact_positions(model, c.turns.t.fed_text, facts, names, codes)  # the document went in first
            after_question = watch_recall(c.engine)
        for i, (name, code) in enumerate(zip(names, codes)):
            answer = "".join(c.send(f"What number does the locker of {name} hold? Answer with the number only.",
                                    max_tokens=10)).strip()
            out.append((code in answer, code, answer))
            if args.rows:  # the asked fact's name and code rows, and the next fact's code rows, on the device
                shares = [held(state, p) for state in (after_question[0], on_device(c.engine))
                          for p in (*where[i], where[i + 1][1] if i + 1 < len(where) else set())]
                rows.append((code in answer, shares))
        return out, c.engine.stats, rows


def fact_positions(model: Model, fed_text: str, facts, names, codes) -> list[tuple[set, set]]:
    """Per fact, the positions of its name's tokens and of its code's tokens in the chat's first ``fed_text``."""
    pieces = [model.detokenize([t]) for t in model.tokenize(fed_text, add_special=True, parse_special=True)]
    ends = list(itertools.accumulate(len(x) for x in pieces))
    text = "".join(pieces)

    def covering(a: int, b: int) -> set:  # the tokens whose text overlaps text[a:b]
        return {p for p, (end, x) in enumerate(zip(ends, pieces)) if end > a and end - len(x) < b}

    out = []
    for fact, name, code in zip(facts, names, codes):
        at = text.index(fact)
        n, c = at + fact.index(name), at + fact.index(code)
        out.append((covering(n, n + len(name)), covering(c, c + len(code))))
    return out


def on_device(engine) -> list[set]:
    """The positions each (layer, KV head) holds now."""
    true = engine.kv.read().true
    return [set(row[row >= 0].tolist()) for row in true.reshape(-1, true.shape[-1])]


def watch_recall(engine) -> list:
    """A one-item list that holds :func:`on_device` right after each question's swap (``Engine.reselect``)."""
    seen = [None]
    reselect = engine.reselect

    def wrapped(*a, **kw):
        moved = reselect(*a, **kw)
        seen[0] = on_device(engine)
        return moved

    engine.reselect = wrapped
    return seen


def held(state: list[set], positions: set) -> np.ndarray:
    """Per (layer, KV head), the share of ``positions`` on the device (NaN: no positions)."""
    return np.array([len(positions & s) / len(positions) if positions else np.nan for s in state])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--budget", default="200")
    ap.add_argument("--seeds", type=int, nargs="+", default=[77, 78, 79, 80, 81, 82, 83, 84])
    ap.add_argument("--cache", default="f16", help="K and V cache type (llama.cpp's -ctk/-ctv names)")
    ap.add_argument("--step-confidence", type=float, default=RECALL_STEP_CONFIDENCE)
    ap.add_argument("--recall-steps", type=int, default=RECALL_STEPS)
    ap.add_argument("--step-every", type=int, default=RECALL_STEP_EVERY)
    ap.add_argument("--room", type=int, default=RECALL_ROOM,
                    help="cells a question's re-selection leaves for the answer (0: it keeps the budget's rows)")
    ap.add_argument("--low-water", type=float, default=LOW_WATER,
                    help="the share of the budget the reading's events leave before its last (Chat(low_water=))")
    ap.add_argument("--observe-every", type=int, default=OBSERVE_EVERY,
                    help="events one decode of the reading's probe scores (Chat(observe_every=))")
    ap.add_argument("--prefill-observe", default=PREFILL_OBSERVE, choices=PREFILL_OBSERVATIONS,
                    help="how the reading's events before its last are observed (Chat(prefill_observe=))")
    ap.add_argument("--value-norm", default=None, choices=VALUE_NORMS,
                    help="CriticalKV's value norm (Chat(value_norm=); default: the engine's, l2)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rows", action="store_true", help="also: which rows of the asked fact are on the device")
    args = ap.parse_args()
    model = Model(resolve(args.model))
    total, kinds, rows = 0, collections.Counter(), []
    for seed in args.seeds:
        t0 = time.perf_counter()
        results, s, seed_rows = chat(model, seed, args)
        rows += seed_rows
        found = sum(ok for ok, _, _ in results)
        total += found
        kinds.update(miss_kind(results, i) for i, (ok, _, _) in enumerate(results) if not ok)
        print(f"seed {seed}: {found}/6  {time.perf_counter() - t0:.0f} s  steps {s.recall_steps} "
              f"(kept their decode {s.recall_steps_confident}, {s.recall_step_seconds:.1f} s)  misses "
              f"{[(code, answer) for ok, code, answer in results if not ok]}", flush=True)
    print(f"total {total}/{6 * len(args.seeds)}; the misses answered {dict(kinds.most_common())}")
    if args.rows:
        print("share of rows on the device (mean over layers and KV heads): after the question's swap, then after "
              "the answer — the asked name, its code, the next fact's code")
        for found in (True, False):
            shares = np.array([sh for f, sh in rows if f == found], dtype=float)  # [facts, 6, layers * heads]
            if len(shares):
                means = "  ".join(f"{v:.2f}" for v in np.nanmean(shares, axis=(0, 2)))
                print(f"  {'found' if found else 'missed'} ({len(shares)}): {means}")
        code = {f: [sh[1] for ok, sh in rows if ok == f] for f in (True, False)}
        if all(code.values()):  # per (layer, KV head): the share of the asked code after the question
            code = {f: np.nanmean(c, axis=0) for f, c in code.items()}
            heads, n_kv = np.argsort(code[False] - code[True])[:5], model.n_head_kv
            print("  the (layer, KV head)s whose share of the asked code after the question parts found from missed "
                  "facts most: " + ", ".join(f"({h // n_kv}, {h % n_kv}) {code[True][h]:.2f} vs {code[False][h]:.2f}"
                                           for h in heads))


def miss_kind(results, i: int) -> str:
    """What the answer to fact ``i`` gave instead (facts are asked in the order the document holds them)."""
    codes, answer = [code for _, code, _ in results], results[i][2]
    if i + 1 < len(codes) and codes[i + 1] in answer:
        return "the next fact's code"
    if i > 0 and codes[i - 1] in answer:
        return "the previous fact's code"
    return "another fact's code" if any(c in answer for c in codes) else "no fact's code"


if __name__ == "__main__":
    main()
