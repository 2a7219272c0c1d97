"""Host bytes a chat copies so that each turn could be undone (a Ctrl-C, a failed turn, ``/regen``).

    python -m tools.rollback                                        # qwen2.5-coder-0.5b, both backends, recall on/off
    python -m tools.rollback smollm2-135m --budget 256 --turns 4 --backends native

A chat reads a document, then asks ``--turns`` questions about it (greedy replies of ``--reply`` tokens). Per turn
the table gives its compression events (a turn's own end, re-selections and answer steps' swaps included), the bytes
a turn copied before turns were undone by what they changed — llama.cpp's whole sequence state, taken before every
turn (``Engine.snapshot``'s blob, measured here by taking it) — and the bytes it copies now
(``Chat.stats.rollback_bytes``: :mod:`kvlocal.engine.undo`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

QUESTIONS = ("What is this text about? Answer in one sentence.", "Name one person or place it mentions.",
             "What happens first?", "What is the last thing it says?", "Summarize it in five words.",
             "Which word does it use most?")


def measure(model, backend: str, recall: bool, args) -> list[dict]:
    """One chat's turns: events, the whole-state copy a turn took before, the bytes it copies now."""
    from kvlocal import Chat
    from kvlocal.runtime import Sampler

    doc = (Path(__file__).resolve().parents[1] / "kvlocal" / "data" / "sample.txt").read_text()[:args.chars]
    rows = []
    with Chat(model, budget=args.budget, backend=backend, recall=recall, sampler=Sampler(), max_reply=args.reply,
              n_threads=args.threads) as chat:
        chat.read(doc, name="sample.txt")
        for i in range(args.turns):
            e = chat.engine
            whole = e.kv.save().nbytes
            events = e.stats.compression_events + e.stats.recall_events + e.stats.recall_steps - e.stats.recall_steps_confident
            chat.ask(QUESTIONS[i % len(QUESTIONS)])
            s = e.stats
            rows.append(dict(backend=e.backend, recall=recall, turn=i + 1, events=s.compression_events + s.recall_events
                             + s.recall_steps - s.recall_steps_confident - events, before=whole,
                             now=chat.stats.rollback_bytes))
    return rows


def main(argv=None) -> int:
    from kvlocal.models import resolve
    from kvlocal.runtime import Model

    ap = argparse.ArgumentParser(prog="python -m tools.rollback", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b")
    ap.add_argument("--budget", default="256")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reply", type=int, default=32, help="most tokens per reply")
    ap.add_argument("--chars", type=int, default=6000, help="characters of the document read first")
    ap.add_argument("--backends", nargs="+", default=["state", "native"])
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    model = Model(resolve(args.model))
    print(f"{args.model}, budget {args.budget}, {args.turns} questions after a {args.chars:,}-character document")
    print(f"{'backend':<8} {'recall':<6} {'turn':>4} {'events':>6} {'before (whole state)':>21} {'now':>12}")
    for backend in args.backends:
        for recall in (True, False):
            for r in measure(model, backend, recall, args):
                print(f"{r['backend']:<8} {'on' if r['recall'] else 'off':<6} {r['turn']:>4} {r['events']:>6} "
                      f"{r['before']:>21,} {r['now']:>12,}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
