"""``kvlocal bench``: memory and speed of the bounded engine against the full cache, side by side.

One run, one runtime, the same prompt: every figure is a ratio of two measurements taken here.
  - KV bytes allocated for a long prompt at the budget vs the full cache   (target <= 0.15x at 0.1)
  - decode tokens/s at that context, budget vs full                        (target >= 2.5x)
  - compression seconds / prefill seconds on a shorter prompt              (target <= 5%)
"""

from __future__ import annotations

import json
import sys
import time
from importlib import resources

from .engine import Budget, Engine
from .runtime import Model


def long_text(model: Model, n_tokens: int) -> list[int]:
    """n_tokens of real English (the GPL-3 text, repeated as needed)."""
    text = resources.files("kvlocal").joinpath("data/gpl-3.0.txt").read_text()
    tokens = model.tokenize(text)
    body = model.tokenize(text, add_special=False)
    while len(tokens) < n_tokens:
        tokens += body
    return tokens[:n_tokens]


def measure(model: Model, tokens: list[int], method: str, budget: str, n_decode: int, threads: int | None) -> dict:
    eng = Engine(model, Budget.parse(budget), method, max_tokens=len(tokens) + n_decode + 1, n_threads=threads)
    eng.prefill(tokens, probe=tokens[-32:])
    # greedy decode without stopping at end-of-text: a fixed number of steps at this context
    t0 = time.perf_counter()
    n = sum(1 for _ in eng.generate(n_decode, stop_at_eog=False))
    s = eng.stats.as_dict()
    s.update(method=method, budget=budget, prompt_tokens=len(tokens), decode_tok_s=n / (time.perf_counter() - t0))
    return s


def run(args) -> int:
    model = Model(args.model_path, n_gpu_layers=args.n_gpu_layers)
    rows = {}
    long = long_text(model, args.long)
    short = long_text(model, args.short)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    log(f"[1/3] full cache, {len(long)}-token prompt + {args.decode} decoded")
    rows["full_long"] = measure(model, long, "full", "1", args.decode, args.threads)
    log(f"[2/3] {args.method} at budget {args.budget}, same prompt")
    rows["budget_long"] = measure(model, long, args.method, args.budget, args.decode, args.threads)
    log(f"[3/3] {args.method} at budget {args.budget}, {len(short)}-token prompt")
    rows["budget_short"] = measure(model, short, args.method, args.budget, 1, args.threads)
    f, b, s = rows["full_long"], rows["budget_long"], rows["budget_short"]
    result = {
        "kv_bytes_ratio": b["kv_bytes_allocated"] / f["kv_bytes_allocated"],
        "decode_speedup": b["decode_tok_s"] / f["decode_tok_s"],
        "compression_over_prefill": s["compression_seconds"] / s["prefill_seconds"],
        "runs": rows,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"model {model.path.name} · method {args.method} · budget {args.budget} · threads {args.threads or 'default'}")
    print(f"{'':34}{'full':>14}{'budget ' + args.budget:>16}{'ratio':>10}  target")
    print(f"{'KV bytes allocated (' + str(len(long)) + ' tok)':34}{f['kv_bytes_allocated'] / 2**20:11.1f} MiB{b['kv_bytes_allocated'] / 2**20:13.1f} MiB"
          f"{result['kv_bytes_ratio']:9.3f}x  <= 0.15x")
    print(f"{'n_ctx (cells)':34}{f['n_ctx']:14,}{b['n_ctx']:16,}")
    print(f"{'decode tokens/s':34}{f['decode_tok_s']:14.1f}{b['decode_tok_s']:16.1f}{result['decode_speedup']:9.2f}x  >= 2.5x")
    print(f"{'prefill seconds (' + str(len(short)) + ' tok)':34}{'':14}{s['prefill_seconds']:16.2f}")
    print(f"{'compression seconds (' + str(s['compression_events']) + ' events)':34}{'':14}{s['compression_seconds']:16.2f}"
          f"{100 * result['compression_over_prefill']:8.1f}%   <= 5%")
    steps = ", ".join(f"{k} {v:.2f} s" for k, v in s["compression_breakdown"].items())
    print(f"{'  by step':34}{'':14}  {steps}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", default=None, help="a .gguf file or known model (default smollm2-135m)")
    p.add_argument("--budget", default="0.1")
    p.add_argument("--method", default="criticalkv")
    p.add_argument("--long", type=int, default=8192 - 64 - 1, help="tokens of the long prompt (default 8127: 8K with decode)")
    p.add_argument("--short", type=int, default=4096, help="tokens of the compression-overhead prompt (default 4096)")
    p.add_argument("--decode", type=int, default=64, help="tokens to decode for the speed figure (default 64)")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    p.add_argument("--json", action="store_true")
