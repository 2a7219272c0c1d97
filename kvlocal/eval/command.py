"""``kvlocal eval``: quality vs KV budget, every method on seeded tasks over real text (docs/eval.md)."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from kvlocal.compress import MERGING_METHODS
from kvlocal.errors import UsageError
from kvlocal.eval.runner import CACHES, EVICTION, KV_BASELINES, OBSERVATIONS, execute, plan, split_method
from kvlocal.eval.tasks import TASKS
from kvlocal.settings import add_setting_args, runtime_settings_from_args

OPT_IN_TASKS = ("multifact12",)  # run only when named: twelve chat turns a run (docs/eval.md)
METHOD_CHOICES = (*EVICTION, *(f"{m}+recall" for m in EVICTION if m not in MERGING_METHODS), *KV_BASELINES)
DEFAULTS = {"models": ["smollm2-135m"], "methods": ["streaming", "snapkv", "criticalkv", *KV_BASELINES,
                                                    "snapkv@kv-q8_0", "criticalkv@kv-q8_0"],
            "budgets": ["0.05", "0.1", "0.2", "0.4"], "tasks": [t for t in TASKS if t not in OPT_IN_TASKS],
            "tokens": 2048, "items": None}
# a smoke test: a short run (docs/eval.md times it)
QUICK = {"models": ["smollm2-135m"], "methods": ["streaming", "criticalkv", "full-kv-q8_0"], "budgets": ["0.1", "0.2"],
         "tasks": ["needle", "continuation"], "tokens": 400, "items": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="*", metavar="MODEL", help="known model names or .gguf paths (default: smollm2-135m)")
    p.add_argument("--out", required=True, help="folder for results.jsonl, results.csv, summary.md and the plots; "
                                                "rerunning with the same folder skips the runs already in it")
    p.add_argument("--methods", nargs="+", help=f"of {', '.join(METHOD_CHOICES)}; a method on a quantized cache is "
                                                f"METHOD@CACHE, CACHE of {', '.join(CACHES)} (criticalkv@kv-q8_0); "
                                                f"METHOD+everyN decodes the probe once in N prefill events; "
                                                f"criticalkv+l2 ranks by L2 value norms (+l1: the paper's L1, the "
                                                f"default); +kept observes decode-time events by the queries "
                                                f"their tokens had; +window scores a prompt's events before its "
                                                f"last by the queries of the chunk's own last tokens; +lowNN "
                                                f"(criticalkv+low60) leaves NN%% of the budget after a "
                                                f"prompt's events before its last; the "
                                                f"full F16 cache always runs (default: streaming snapkv criticalkv, the "
                                                f"full-* caches, snapkv@kv-q8_0 criticalkv@kv-q8_0)")
    p.add_argument("--budgets", nargs="+", help="ratios in (0, 1) (default 0.05 0.1 0.2 0.4)")
    p.add_argument("--tasks", nargs="+",
                   help=f"of {', '.join(TASKS)} (default: all but {', '.join(OPT_IN_TASKS)})")
    p.add_argument("--observations", nargs="+", default=list(OBSERVATIONS),
                   help="probes for the methods that use one: question, agnostic (default both)")
    p.add_argument("--tokens", type=int, help="context length of every prompt in tokens (default 2048)")
    p.add_argument("--items", type=int, help="at most this many items per task (default: all of them)")
    p.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: smollm2-135m, 400 tokens, needle and continuation, streaming, criticalkv "
                        "and the q8_0 K+V full cache, budgets 0.1 0.2 (options given explicitly still apply)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="llama.cpp threads (default: cores, at most 8; 1 is faster on a machine already busy)")
    add_setting_args(p, names=("n_gpu_layers", "rpc", "tensor_split"))


def _options(args) -> dict:
    """The effective options: explicit flags, else --quick's, else the defaults; validated."""
    base = QUICK if args.quick else DEFAULTS
    o = {k: getattr(args, k) if getattr(args, k) not in (None, []) else v for k, v in base.items()}
    _check_methods(o["methods"])
    check_choices("--tasks", o["tasks"], TASKS)
    check_choices("--observations", args.observations, OBSERVATIONS)
    o["budgets"] = [budget_ratio(b) for b in o["budgets"]]
    if o["tokens"] < 200:
        raise UsageError(f"--tokens {o['tokens']} is too short: give at least 200")
    if o["items"] is not None and o["items"] < 1:
        raise UsageError("--items must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise UsageError("-t/--threads must be at least 1")
    return o


def _check_methods(given) -> None:
    for m in given:
        try:
            split_method(m)
        except ValueError:
            raise UsageError(f"--methods: unknown {m}; choose from {', '.join(METHOD_CHOICES)}, or METHOD@CACHE with "
                             f"CACHE of {', '.join(CACHES)} (e.g. criticalkv@kv-q8_0), +everyN with N >= 1 (last, "
                             "before any @CACHE), and +l2 or +l1 on a CriticalKV method (criticalkv+l2), +kept, "
                             "+window (without +everyN), +whole and +lowNN (1 <= NN <= 100) on a compressing method"
                             ) from None


def check_choices(flag: str, given, allowed) -> None:
    bad = [x for x in given if x not in allowed]
    if bad:
        raise UsageError(f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")


def budget_ratio(text: str) -> float:
    try:
        b = float(text)
    except ValueError:
        raise UsageError(f"--budgets {text!r} is not a number: give ratios like 0.1 0.2") from None
    if not 0 < b < 1:
        raise UsageError(f"--budgets {text}: a budget must be a ratio in (0, 1) (the full cache always runs)")
    return b


def run(args) -> int:
    from tqdm import tqdm

    from kvlocal.models import resolve
    from kvlocal.eval.report import short_name, write_all

    o = _options(args)
    runtime = runtime_settings_from_args(args)  # --rpc, --tensor-split: refused here, before a model loads
    paths = {m: resolve(m) for m in o["models"]}
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file: give a folder")
    out.mkdir(parents=True, exist_ok=True)
    specs = plan(o["models"], o["tasks"], o["methods"], o["budgets"], args.observations, args.seed, o["tokens"])
    command = shlex.join(["kvlocal", *sys.argv[1:]])
    bar = tqdm(total=len(specs), desc="kvlocal eval", unit="run", file=sys.stderr, dynamic_ncols=True)
    skipped = 0

    def progress(spec, skip: bool) -> None:  # before each run; a finished one advances the bar below
        nonlocal skipped
        if skip:
            skipped += 1
            bar.update(1)
        bar.set_postfix_str(f"{short_name(spec.model)} {spec.task} {spec.method} {spec.budget:g} {spec.observation}")

    t0 = time.perf_counter()
    new = []
    try:
        for rec in execute(specs, paths, out / "results.jsonl", command, args.threads, o["items"], progress, runtime):
            new.append(rec)
            bar.update(1)
    finally:  # an error's line starts on a line of its own; finished runs are recorded (rerun to continue)
        bar.close()
    text, pngs = write_all(out / "results.jsonl", out)
    print(text)
    print(f"kvlocal eval: {len(new)} runs in {time.perf_counter() - t0:.0f} s, {skipped} already done; "
          f"{out / 'results.jsonl'}, results.csv, summary.md, {len(pngs)} plots", file=sys.stderr)
    return 0
