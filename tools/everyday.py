"""Everyday prompts: does a model answer them in a chat, and does it loop?

    python -m tools.everyday                                   # the known models, the chat's defaults, the report set
    python -m tools.everyday smollm2-135m --configs greedy chat chat-noguard --seeds 2 3
    python -m tools.everyday --set dev --configs chat chat-rp1.0 --seeds 1 --out /tmp/everyday.jsonl
    python -m tools.everyday --table /tmp/everyday.jsonl                 # the table again, from the records

Each item of ``tools/everyday_prompts.json`` is a short conversation (a fact, arithmetic, a summary of a pasted
paragraph, a follow-up question) run through :class:`kvlocal.Chat` as ``kvlocal chat`` runs it (its budget, method
and recall tier), a new chat per item. A reply is **correct** when its last reply matches every pattern the item
expects; **looped** when a reply of the conversation repeated one span (the loop guard ended it, or — with the guard
off — the guard would have: 64 tokens that are one span repeated); else **wrong**, which covers garbage. The
configurations (``--configs``):

- ``greedy``: temperature 0, no repeat penalty, no loop guard — ``kvlocal chat``'s sampling before it had defaults;
- ``chat``: the chat's defaults (the model's own sampling if its GGUF declares one, else temperature 0.8, top-k 40,
  top-p 0.95, min-p 0.05, repeat penalty 1.1) and the loop guard;
- ``chat-noguard``: the same sampling without the loop guard;
- ``chat-rpX``: the chat's defaults with repeat penalty X (``chat-rp1.0``: none); ``chat-rpX-noguard`` without the guard.

The table gives, per model and configuration, the counts over every seed, and loops per prompt (looped replies over
conversations). ``--set dev`` is what the defaults were chosen on; ``--set report`` (the default) is held out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().with_name("everyday_prompts.json")
MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")


def sampling(config: str, model) -> tuple[dict, int]:
    """(Sampler keywords, loop guard tokens) of a configuration's name."""
    from kvlocal.engine.loops import LOOP_GUARD
    from kvlocal.runtime import chat_sampling

    if config == "greedy":
        return dict(temp=0.0, repeat_penalty=1.0), 0
    m = re.fullmatch(r"chat(-rp([0-9.]+))?(-noguard)?", config)
    if not m:
        raise SystemExit(f"everyday: unknown configuration {config!r}: greedy, chat, chat-rpX, chat-noguard, chat-rpX-noguard")
    params = chat_sampling(model)
    if m.group(2):
        params["repeat_penalty"] = float(m.group(2))
    return params, 0 if m.group(3) else LOOP_GUARD


def looped(model, text: str) -> bool:
    """Whether a reply holds 64 tokens that are one span repeated (what the loop guard ends)."""
    from kvlocal.engine.loops import LOOP_GUARD, LoopGuard

    guard = LoopGuard(LOOP_GUARD)
    return any(guard.feed(t) for t in model.tokenize(text, add_special=False))


def run_item(model, item: dict, config: str, seed: int, max_reply: int) -> dict:
    from kvlocal import Chat
    from kvlocal.runtime import Sampler

    params, guard = sampling(config, model)
    replies, finishes = [], []
    with Chat(model, sampler=Sampler(**params, seed=seed), max_reply=max_reply, loop_guard=guard) as chat:
        for turn in item["turns"]:
            replies.append(chat.ask(turn))
            finishes.append(chat.finish_reason)
    loop = any(f == "loop" for f in finishes) or any(looped(model, r) for r in replies)
    correct = all(re.search(p, replies[-1], re.IGNORECASE) for p in item["expect"])
    verdict = "correct" if correct and not loop else "looped" if loop else "wrong"
    return dict(kind=item["kind"], prompt=item["turns"][-1][:80], verdict=verdict, finishes=finishes,
                reply=replies[-1], reply_tokens=sum(len(model.tokenize(r, add_special=False)) for r in replies))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.everyday", description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=list(MODELS), help=f"models (default: {' '.join(MODELS)})")
    ap.add_argument("--set", default="report", choices=("report", "dev"), help="the prompts (default: report, held out)")
    ap.add_argument("--configs", nargs="+", default=["greedy", "chat", "chat-noguard"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[2, 3], help="sampling seeds (default 2 3; dev: 1)")
    ap.add_argument("-n", "--max-reply", type=int, default=512, help="most tokens a reply (default 512: the chat's)")
    ap.add_argument("--out", help="append every conversation's record to this JSONL file")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each reply")
    ap.add_argument("--table", metavar="JSONL", help="print the table of an --out file's records and stop")
    args = ap.parse_args(argv)
    if args.table:
        print_table([json.loads(line) for line in open(args.table)])
        return 0

    from kvlocal.models import resolve
    from kvlocal.runtime import Model

    items = json.loads(PROMPTS.read_text())[args.set]
    out = open(args.out, "a") if args.out else None
    records = []
    for name in args.models:
        model = Model(resolve(name))
        try:
            for config in args.configs:
                t0 = time.perf_counter()
                for seed in args.seeds:
                    for i, item in enumerate(items):
                        r = dict(model=name, config=config, seed=seed, set=args.set, item=i,
                                 **run_item(model, item, config, seed * 1000 + i, args.max_reply), max_reply=args.max_reply)
                        records.append(r)
                        if args.verbose:
                            print(f"  {name} {config} seed {seed} #{i} {r['verdict']}: {r['reply'][:120]!r}", file=sys.stderr)
                        if out:
                            out.write(json.dumps(r) + "\n")
                            out.flush()
                done = [r for r in records if r["model"] == name and r["config"] == config]
                print(f"{name} · {config}: {sum(r['verdict'] == 'correct' for r in done)}/{len(done)} correct, "
                      f"{sum(r['verdict'] == 'looped' for r in done)} looped ({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
        finally:
            model.close()
    print_table(records)
    return 0


def print_table(records: list[dict]) -> None:
    """Per model and configuration: correct, wrong and looped conversations over every seed and set in ``records``."""
    latest = {(r["model"], r["config"], r["set"], r["seed"], r["item"]): r for r in records}  # a rerun replaces
    groups: dict[tuple, list[dict]] = {}
    for r in latest.values():
        groups.setdefault((r["model"], r["config"]), []).append(r)
    sets = sorted({r["set"] for r in records})
    seeds = sorted({r["seed"] for r in records})
    limit = max((r.get("max_reply", 512) for r in records), default=512)
    print(f"\n{'/'.join(sets)} set, seeds {' '.join(map(str, seeds))}; replies up to {limit} tokens\n")
    print("| model | sampling | correct | wrong or garbage | looped | loops per prompt | reply tokens per prompt |")
    print("|---|---|---|---|---|---|---|")
    for (name, config), rs in groups.items():
        n = len(rs)
        c = {v: sum(r["verdict"] == v for r in rs) for v in ("correct", "wrong", "looped")}
        tokens = sum(r["reply_tokens"] for r in rs)
        print(f"| {name} | {config} | {c['correct']}/{n} | {c['wrong']}/{n} | {c['looped']}/{n} | "
              f"{c['looped'] / n:.2f} | {tokens / n:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
