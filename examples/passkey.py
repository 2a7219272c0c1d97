"""Pass-key retrieval inside a KV budget: does the key survive compression?

    python examples/passkey.py [MODEL] --tokens 6000 --depths 0.2 0.5 0.8

A key is hidden at a given depth of ~N tokens of filler; the prompt ends with the question. Each
method runs at each budget with the question's queries scoring every chunk (query-aware: the
prompt's last tokens are the probe) and with the generic probe (agnostic). StreamingLLM does not
look at queries, so it runs once per budget. The full cache runs first as the ceiling.
Default model: qwen2.5-coder-0.5b (the 135M model does not retrieve a key far back even with the full cache).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from kvlocal.engine import Engine
from kvlocal.models import resolve
from kvlocal.runtime import Model

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"


def haystack(model: Model, n_tokens: int, depth: float, key: int) -> list[int]:
    unit = len(model.tokenize(FILLER, add_special=False))
    n_fill = max(1, (n_tokens - 40) // unit)
    at = int(n_fill * depth)
    text = (
        "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
        + FILLER * at
        + f"The pass key is {key}. Remember it. {key} is the pass key. "
        + FILLER * (n_fill - at)
        + QUESTION
    )
    return model.tokenize(text)


def attempt(model, tokens, method, budget, probe, n_threads) -> tuple[str, dict]:
    eng = Engine(model, budget, method, max_tokens=len(tokens) + 8, n_threads=n_threads)
    eng.prefill(tokens, probe=probe)
    out = model.detokenize(list(eng.generate(8)))
    return out, eng.stats.as_dict()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--depths", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    ap.add_argument("--budgets", nargs="+", default=["0.1", "0.2"])
    ap.add_argument("--methods", nargs="+", default=["streaming", "snapkv", "criticalkv"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", help="also write every row to this file")
    args = ap.parse_args()

    model = Model(resolve(args.model))
    rng = random.Random(args.seed)
    configs = [("full", "1", "-")]
    for budget in args.budgets:
        for method in args.methods:
            for mode in (["-"] if method == "streaming" else ["question", "agnostic"]):
                configs.append((method, budget, mode))
    found = {c: 0 for c in configs}
    rows = []
    for depth in args.depths:
        key = rng.randrange(10000, 99999)
        tokens = haystack(model, args.tokens, depth, key)
        for method, budget, mode in configs:
            probe = tokens[-32:] if mode != "agnostic" else None
            t0 = time.perf_counter()
            out, stats = attempt(model, tokens, method, budget, probe, args.threads)
            ok = str(key) in out
            found[(method, budget, mode)] += ok
            rows.append({"depth": depth, "key": key, "method": method, "budget": budget, "mode": mode, "found": ok,
                         "answer": out, "prompt_tokens": len(tokens), "seconds": time.perf_counter() - t0,
                         "kv_cells_live_peak": stats["kv_cells_live_peak"], "n_ctx": stats["n_ctx"]})
            print(f"depth {depth:.2f} key {key} {method:>10} budget {budget:>4} {mode:>9}: "
                  f"{'FOUND' if ok else 'lost '} {out.strip()[:24]!r} ({rows[-1]['seconds']:.0f} s, n_ctx {stats['n_ctx']})",
                  file=sys.stderr, flush=True)
    print(f"\npass key at {len(tokens)} tokens, {model.path.name}, found / {len(args.depths)} depths {args.depths}")
    print(f"{'method':>10} {'budget':>6} {'observation':>12} {'found':>6}")
    for (method, budget, mode), n in found.items():
        print(f"{method:>10} {budget:>6} {mode:>12} {n:>4}/{len(args.depths)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
