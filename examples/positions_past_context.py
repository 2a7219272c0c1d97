"""What moving positions back under the trained context costs: a pass key near the end and one far
from it, in a chat whose position limit is lowered so that a 3K-token document crosses it several times,
with and without the moves, with the recall tier off and on (docs/chat.md, "Past the trained context").

    .venv/bin/python examples/positions_past_context.py [--model smollm2-135m] [--budget 400] [--limit 1200]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kvlocal
from kvlocal.models import resolve
from kvlocal.runtime import Model

KEY = "58213"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget", default="400")
    ap.add_argument("--limit", type=int, default=1200, help="position limit in place of the trained context")
    args = ap.parse_args()
    text = (Path(kvlocal.__file__).parent / "data" / "gpl-3.0.txt").read_text()
    model = Model(resolve(args.model))
    print(f"{'key at char':>11}  {'limit':>6}  recall  moves  move s  reply")
    for at in (2500, 11000):  # ~2,500 and ~640 tokens before the question
        doc = text[:at] + f"\n\nThe pass key is {KEY}. Remember it: the pass key is {KEY}.\n\n" + text[at:14000]
        for limit in (None, args.limit):
            for recall in (False, True):
                with kvlocal.Chat(model, budget=args.budget, recall=recall) as chat:
                    if limit:
                        chat.engine.position_limit = limit
                    chat.read(doc)
                    reply = chat.ask("What is the pass key?", 16)
                    found = "found" if KEY in reply else "LOST "
                    print(f"{at:>11}  {limit or model.n_ctx_train:>6}  {'on' if recall else 'off':>6}  "
                          f"{chat.stats.repositions:>5}  {chat.engine.stats.reposition_seconds:6.2f}  {found} {reply!r}",
                          flush=True)
    model.close()


if __name__ == "__main__":
    main()
