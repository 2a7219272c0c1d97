"""Loops in free-form replies over a long text: the full cache against a compressed one (issue 61, docs/recall.md §
Loops).

    python -m tools.freeform_loops qwen2.5-coder-0.5b --bytes 20000 -n 160 -t 2

The first ``--bytes`` of *Persuasion* (kvlocal/data/persuasion-1.txt) are read into one chat (as ``kvlocal chat
--file``), then each question below is asked in a turn of its own, decoded greedily without a repeat penalty and without the loop guard — the
model's raw tendency, which the chat's defaults (a repeat penalty, the guard) then curb. A reply **loops** when its
last ``--tail`` tokens are one span of at most 16 tokens repeated (what the loop guard would have cut); the first
and last words of each reply are printed so that the verdicts can be read. The questions are about the novel's
first chapters and were written for this tool (none of them was used to tune anything).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvlocal import Chat
from kvlocal.runtime import Sampler

TEXT = Path(__file__).resolve().parent.parent / "kvlocal" / "data" / "persuasion-1.txt"
QUESTIONS = [
    "What book does Sir Walter Elliot like to read, and why?",
    "How many daughters does Sir Walter have? Name them.",
    "Who is Lady Russell, and what is she to the family?",
    "Why must the Elliots change how they live?",
    "Who is Mr Shepherd?",
    "Describe Anne Elliot in a few sentences.",
]
CONFIGS = {  # name: Chat keywords
    "full": dict(method="full"),
    "criticalkv 0.1": dict(method="criticalkv", budget=0.1, recall=False),
    "criticalkv+recall 0.1, read in chunks": dict(method="criticalkv", budget=0.1, recall=True, read_cells=0),
    "criticalkv+recall 0.1": dict(method="criticalkv", budget=0.1, recall=True),  # the document read whole
}


def loops(tokens: list[int], tail: int) -> bool:
    """Whether the last ``tail`` tokens are one span of at most 16 tokens (and a third of ``tail``) repeated."""
    end = tokens[-tail:]
    return len(end) == tail and any(all(end[i] == end[i + p] for i in range(tail - p))
                                    for p in range(1, min(16, tail // 3) + 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b")
    p.add_argument("--bytes", type=int, default=20000, help="how much of the novel is read (default 20000)")
    p.add_argument("-n", type=int, default=160, help="tokens a reply may take (default 160)")
    p.add_argument("--tail", type=int, default=48, help="tokens that must repeat one span to count as a loop")
    p.add_argument("-t", "--threads", type=int, default=None)
    args = p.parse_args()
    text = TEXT.read_text(encoding="utf-8")[:args.bytes]
    for name, kw in CONFIGS.items():
        t0 = time.monotonic()
        chat = Chat(args.model, sampler=Sampler(temp=0, repeat_penalty=1.0), n_threads=args.threads, loop_guard=0,
                    max_reply=args.n, **kw)
        try:
            n_read = chat.read(text, name="persuasion.txt")  # as `kvlocal chat --file`: it opens the first question
            looped = 0
            for q in QUESTIONS:
                reply = chat.ask(q, max_tokens=args.n)
                tokens = chat.model.tokenize(reply, add_special=False)
                hit = loops(tokens, args.tail)
                looped += hit
                words = reply.split()
                print(f"  {name:22} {'LOOP' if hit else 'ok  '} {q[:40]:40} | {' '.join(words[:12])} … {' '.join(words[-6:])}")
            print(f"{name}: {looped} of {len(QUESTIONS)} replies loop ({n_read:,} tokens read, "
                  f"{time.monotonic() - t0:.0f} s)", flush=True)
        finally:
            chat.close()


if __name__ == "__main__":
    main()
