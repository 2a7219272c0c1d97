"""What a long reply keeps of itself: decode-time events scored by the question alone vs by the question
and the reply's own tail (the engine's policy, kvlocal/engine.py ``Engine.decode_probe``).

    python examples/decode_probe.py [--model smollm2-135m] [--budget 256] [--reply 400]

Reads the first 1,500 tokens of a licence text (Debian's /usr/share/common-licenses/Apache-2.0, or
kvlocal's GPL-3.0 copy), asks for a point-by-point summary, generates a long greedy reply that passes the
budget several times, and prints how many rows of the reply's first 100 tokens, of the whole reply and
of the question each KV head still holds at the end (means over layers and heads).
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from kvlocal.engine import Engine
from kvlocal.models import resolve
from kvlocal.runtime import Model
from kvlocal.runtime import Sampler

QUESTION = "\n\nSummarize the conditions of this license in detail, point by point.\n"


class QuestionOnly(Engine):
    """The old policy: decode-time events scored by the question's probe alone."""

    def decode_probe(self) -> list[int]:
        return self._probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--reply", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = Model(resolve(args.model))
    path = Path("/usr/share/common-licenses/Apache-2.0")
    text = path.read_text() if path.exists() else resources.files("kvlocal").joinpath("data/gpl-3.0.txt").read_text()
    doc = model.tokenize(text)[:1500]
    q = model.tokenize(QUESTION, add_special=False)
    for name, cls in (("question only", QuestionOnly), ("question + reply (kvlocal)", Engine)):
        # both decode their probe (what is compared is the probe's tokens, not how its queries are had)
        eng = cls(model, args.budget, max_tokens=len(doc) + len(q) + args.reply, chunk=128, n_threads=args.threads,
                  decode_observe="probe")
        eng.prefill(doc + q, probe=q)
        start = eng.n_past
        reply = list(eng.generate(args.reply, Sampler(), stop_at_eog=False))
        pos = eng.last_plan.positions  # [layer, KV head, slot]: source positions kept at the last event
        held = lambda lo, hi: float(((pos >= lo) & (pos < hi)).sum(-1).mean())  # noqa: E731
        print(f"{name:28} {eng.stats.compression_events} events, {len(reply)} reply tokens; rows held per head: "
              f"reply's first 100 {held(start, start + 100):.1f}, whole reply {held(start, start + len(reply)):.1f}, "
              f"question ({len(q)} tokens) {held(start - len(q), start):.1f}")


if __name__ == "__main__":
    main()
