"""``kvlocal bench``: memory and speed of the bounded engine against the full cache, side by side.

One run, one runtime, the same prompt: every figure is a ratio of two measurements taken here.
  - KV bytes allocated for a long prompt at the budget vs the full cache   (target <= 0.15x at 0.1)
  - decode tokens/s at that context, budget vs full                        (target >= 2.5x)
  - compression seconds / prefill seconds of that prompt, per backend      (target <= 5%)
  - K/V bytes compression copied to the host, per backend                  (0 on native)
The compressed run is repeated on each KV backend (``--backends``, default native and state where the
runtime has both): the same prompt, method and budget.

``--frontier`` compares, per context length (``--contexts``), what a user chooses between at long context:
the full F16 cache, llama.cpp's own q8_0 and q4_0 K+V caches, the method at the budget, and the method on a
q8_0 cache — KV bytes, TTFT, decode tokens/s and the compression share, as a table (``--plot FILE``: a
figure of KV bytes, TTFT and decode speed against the context).

``--recall-cost`` measures the recall tier instead, per document length (``--contexts``) and backend: the
document is read with recall on, then one question re-selects the cache (:meth:`kvlocal.engine.Engine.reselect`) and
so do the first ``RECALL_STEPS`` tokens of its answer, which goes on until the compression that returns the cache to
the budget; their seconds (the probe decodes included) as a share of the document's prefill (target <= 3%), the rows that crossed, and the host tier's bytes next to the device's KV bytes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from importlib import resources

from kvlocal.compress import VALUE_NORMS, value_norm_refusal
from kvlocal.engine import (DECODE_OBSERVATIONS, DECODE_OBSERVE, LOW_WATER, PREFILL_OBSERVATIONS, PREFILL_OBSERVE,
                            RECALL_ROOM, RECALL_STEP_CONFIDENCE, RECALL_STEP_EVERY, RECALL_STEPS, Engine)
from kvlocal.engine.config import check_low_water, resolve_method_params
from kvlocal.errors import UsageError
from kvlocal.backends import resolve_backend
from kvlocal.runtime import CACHE_TYPES, Model, cache_type
from kvlocal.settings import add_setting_args, read_cells_flag, runtime_settings_from_args


RECALL = {"off": False, "on": True, "auto": None}  # --recall → Engine(recall=)


def recall_of(args) -> bool | None:
    """``--recall`` → the compressed runs' ``Engine(recall=)`` (off when not given)."""
    return RECALL[args.recall or "off"]


def long_text(model: Model, n_tokens: int) -> list[int]:
    """n_tokens of real English (the GPL-3 text, repeated as needed)."""
    text = resources.files("kvlocal").joinpath("data/gpl-3.0.txt").read_text()
    tokens = model.tokenize(text)
    body = model.tokenize(text, add_special=False)
    while len(tokens) < n_tokens:
        tokens += body
    return tokens[:n_tokens]


def read_prompt(eng: Engine, tokens: list[int], question: list[int] | None) -> None:
    """Read ``tokens``, whose last ones are ``question`` (None: a document before any question), as the front doors
    do: ``kvlocal run`` (:meth:`Engine.read_prompt`, without the answer's re-selecting steps, which ``--recall-cost``
    measures), or a chat's document read for the question that comes next (``Engine.prefill(reselect_after=)``)."""
    if question:
        eng.read_prompt(tokens, question, tail=len(question), answer=False)
    else:
        eng.prefill(tokens, reselect_after=True)


def measure(model: Model, tokens: list[int], method: str, budget: str, n_decode: int, threads: int | None,
            backend: str = "auto", cache: str = "f16", probe: str = "question", **engine) -> dict:
    """Prefill ``tokens`` and decode ``n_decode`` more on a new engine; its stats with the decode speed.
    ``cache``: the K and V cache type (llama.cpp's -ctk/-ctv names); ``probe``: "question", the prompt's last 32
    tokens are its question, or "generic", it is read as a chat reads a document before any question (the engine's
    generic probe); ``engine``: more Engine keywords. With a recall tier the prompt is read as ``kvlocal run`` reads
    it — its question re-selects the cache before its own tokens are decoded (``recall_seconds``, in
    ``ttft_seconds``) — and a document as a chat reads it, for the question that comes next; the decode that follows
    is the cache's (the answer's re-selecting first tokens are ``--recall-cost``'s to measure)."""
    t = None if cache == "f16" else cache_type(cache)
    eng = Engine(model, budget, method, max_tokens=len(tokens) + n_decode + 1, n_threads=threads,
                 backend=backend, type_k=t, type_v=t, **engine)
    read_prompt(eng, tokens, tokens[-32:] if probe == "question" else None)
    # greedy decode without stopping at end-of-text: a fixed number of steps at this context
    t0 = time.perf_counter()
    n = sum(1 for _ in eng.generate(n_decode, stop_at_eog=False))
    s = eng.stats.as_dict()
    s.update(device_transfers=eng.ctx.counters()["transfers"])  # with the swaps of the question's recall
    s.update(method=method, budget=budget, prompt_tokens=len(tokens), decode_tok_s=n / (time.perf_counter() - t0),
             low_water=eng.cfg.low_water, recall=eng.tier is not None, prefill_observe=eng.cfg.prefill_observe,
             probe=probe, probe_tokens=len(eng.last_probe), ttft_seconds=s["prefill_seconds"] + s["recall_seconds"])
    return s


def read_label(cells: int | None) -> str:
    """A ``--read-cells`` value as the tables print it."""
    return "whole" if cells is None else f"{cells:,}"


def default_backends() -> list[str]:
    """native and state where the runtime has both, else state."""
    try:
        resolve_backend("native")
    except UsageError:
        return ["state"]
    return ["native", "state"]


# options only some modes read, and those modes: given without one of them, an option would be ignored
MODE_OPTIONS = {
    "--contexts": ("--frontier", "--recall-cost"),
    "--configs": ("--frontier",),
    "--plot": ("--frontier",),
    "--step-confidence": ("--recall-cost",),
    "--step-every": ("--recall-cost",),
    "--decode-observe": ("--recall-cost",),
    "--chunks": ("--overhead",),
    "--observe-every": ("--overhead",),
    "--low-waters": ("--overhead",),
    "--read-cells": ("--overhead",),
    "--probes": ("--overhead",),
    "--prefill-observe": ("--overhead",),
    "--value-norms": ("--overhead",),
}


def check_mode_options(args) -> None:
    """UsageError naming the mode to add for an option given without any mode that reads it (an option left at its
    default is not "given")."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flag, modes in MODE_OPTIONS.items():
        dest = flag[2:].replace("-", "_")
        if getattr(args, dest) != parser.get_default(dest) and not any(getattr(args, m[2:].replace("-", "_")) for m in modes):
            raise UsageError(f"{flag} is an option of {' and '.join(modes)}: add {' or '.join(modes)}")


def run(args) -> int:
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"-t/--threads {args.threads}: give at least 1 (default: the cores, at most 8)")
    if args.n_gpu_layers < -1:
        raise UsageError(f"-ngl/--n-gpu-layers {args.n_gpu_layers}: give a number of layers, 0 for none or -1 for all")
    if args.cache not in CACHE_TYPES:
        raise UsageError(f"--cache {args.cache!r}: choose one of {', '.join(CACHE_TYPES)}")
    mode = next((f for f, on in (("--frontier", args.frontier), ("--recall-cost", args.recall_cost),
                                 ("--overhead", args.overhead)) if on), None)
    if args.recall_cost and args.recall is not None:
        raise UsageError("--recall-cost always reads the document with the recall tier: leave --recall out")
    if mode and args.cache != "f16":
        raise UsageError(f"--cache applies to the side-by-side run only: {mode} runs on f16"
                         + (" (and has its own q8_0 and q4_0 rows)" if mode == "--frontier" else "")
                         + ": leave --cache out")
    if not all(0 <= p <= 1 for p in args.step_confidence):
        raise UsageError("--step-confidence: give probabilities between 0 and 1 (1: every answer step swaps)")
    if min(args.step_every) < 1:
        raise UsageError("--step-every: give whole numbers of at least 1 (1: any answer step may swap)")
    if args.overhead and (min(args.chunks) < 1 or min(args.observe_every) < 1):
        raise UsageError("--chunks and --observe-every: give whole numbers of at least 1")
    for w in args.low_waters:
        if w is not None:
            check_low_water(w, "--low-waters")
    check_mode_options(args)
    if "full" not in args.configs:
        raise UsageError("--configs: include full, the cache every ratio of the table is to")
    if args.value_norms and value_norm_refusal(args.method):
        raise UsageError(f"--value-norms: --method {args.method} {value_norm_refusal(args.method)}")
    model = runtime_settings_from_args(args).load(args.model_path)  # -ngl, --rpc, --tensor-split
    if args.recall_cost or args.frontier:
        if any(n < 256 for n in args.contexts):
            raise UsageError("--contexts: give document lengths of at least 256 tokens")
        if any(n > model.n_ctx_train for n in args.contexts):
            raise UsageError(f"--contexts: {model.path.name} was trained on {model.n_ctx_train:,} tokens; "
                             f"give lengths up to that")
        return run_recall_cost(args, model) if args.recall_cost else run_frontier(args, model)
    if args.overhead:
        return run_overhead(args, model)
    backends = args.backends or default_backends()
    long = long_text(model, args.long)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    n = 1 + len(backends)
    log(f"[1/{n}] full {args.cache} cache, {len(long)}-token prompt + {args.decode} decoded")
    full = measure(model, long, "full", "1", args.decode, args.threads, cache=args.cache)
    runs = {}
    for i, backend in enumerate(backends, 2):
        log(f"[{i}/{n}] {args.method} at budget {args.budget} on the {backend} backend, same prompt")
        runs[backend] = measure(model, long, args.method, args.budget, args.decode, args.threads, backend,
                                cache=args.cache, recall=recall_of(args))
    result = {
        "full": full,
        "backends": {b: {"kv_bytes_ratio": r["kv_bytes_allocated"] / full["kv_bytes_allocated"],
                         "decode_speedup": r["decode_tok_s"] / full["decode_tok_s"],
                         "compression_over_prefill": r["compression_seconds"] / r["prefill_seconds"],
                         "host_kv_bytes": r["host_kv_bytes"], "run": r} for b, r in runs.items()},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    mib = 2**20
    print(f"model {model.path.name} · method {args.method} · budget {args.budget} · {len(long):,}-token prompt · "
          f"{args.cache} K+V cache · threads {args.threads or 'default'}")
    print(f"{'':34}{'full':>12}" + "".join(f"{b:>14}" for b in backends) + "  target")
    res = result["backends"]

    def row(label, full_text, cells, target=""):
        print(f"{label:34}{full_text:>12}" + "".join(f"{c:>14}" for c in cells) + (f"  {target}" if target else ""))

    row("KV bytes allocated", f"{full['kv_bytes_allocated'] / mib:.1f} MiB",
        [f"{runs[b]['kv_bytes_allocated'] / mib:.1f} MiB" for b in backends])
    row("  ratio to full", "", [f"{res[b]['kv_bytes_ratio']:.3f}x" for b in backends], "<= 0.15x")
    row("n_ctx (cells)", f"{full['n_ctx']:,}", [f"{runs[b]['n_ctx']:,}" for b in backends])
    row("decode tokens/s", f"{full['decode_tok_s']:.1f}", [f"{runs[b]['decode_tok_s']:.1f}" for b in backends])
    row("  ratio to full", "", [f"{res[b]['decode_speedup']:.2f}x" for b in backends], ">= 2.5x")
    row("engine setup seconds", f"{full['setup_seconds']:.2f}", [f"{runs[b]['setup_seconds']:.2f}" for b in backends],
        "once per model: not in TTFT")
    row("time to the first token, s", f"{full['ttft_seconds']:.2f}", [f"{runs[b]['ttft_seconds']:.2f}" for b in backends])
    row("  ratio to full", "", [f"{runs[b]['ttft_seconds'] / full['ttft_seconds']:.2f}x" for b in backends], "<= 0.7x")
    row("prefill seconds", f"{full['prefill_seconds']:.2f}", [f"{runs[b]['prefill_seconds']:.2f}" for b in backends])
    row("compression seconds", "", [f"{runs[b]['compression_seconds']:.2f}" for b in backends])
    row("  share of prefill", "", [f"{100 * res[b]['compression_over_prefill']:.1f}%" for b in backends], "<= 5%")
    row("compression events", "", [f"{runs[b]['compression_events']}" for b in backends])
    row("  milliseconds per event", "", [f"{1000 * runs[b]['compression_seconds'] / max(1, runs[b]['compression_events']):.1f}"
                                        for b in backends])
    row("  backend transfers per event", "", [f"{runs[b]['device_transfers'] / max(1, runs[b]['compression_events']):,.0f}"
                                             for b in backends], "O(layers), not O(rows)")
    row("K/V copied to the host", "", [f"{runs[b]['host_kv_bytes'] / mib:,.1f} MiB" for b in backends],
        "0 on native without a tier")
    row("recall tier (host memory)", "", [f"{runs[b]['host_tier_bytes'] / mib:,.1f} MiB" if runs[b]["recall"] else "off"
                                          for b in backends])
    row("  the question's re-selection, s", "", [f"{runs[b]['recall_seconds']:.2f}" if runs[b]["recall"] else "-"
                                                for b in backends], "in TTFT, not in the share")
    for step in ("observe", "read", "score", "apply"):
        row(f"  {step} seconds", "", [f"{runs[b]['compression_breakdown'].get(step, 0.0):.2f}" for b in backends])
    return 0


def run_overhead(args, model: Model) -> int:
    """``--overhead``: what each lever against compression's cost buys, side by side on one prompt: every
    ``--chunks`` (fewer, larger events; more cells) × ``--low-waters`` (fewer, larger events; the same cells) ×
    ``--observe-every`` (fewer probe decodes) × ``--prefill-observe`` (no probe decode: the chunk's own window) ×
    ``--value-norms`` (CriticalKV's L1 or L2, the default) × ``--probes`` (the prompt's question, or a chat's generic
    probe) × ``--backends`` (default: the one ``auto`` picks), against the full cache."""
    long = long_text(model, args.long)
    grid = itertools.product(args.backends or ["auto"], args.chunks, args.low_waters, args.prefill_observe or [None],
                             args.observe_every, args.value_norms or [None], args.probes, args.read_cells)
    # a window-observed prompt decodes no probe to spread over events: one row, whatever --observe-every
    grid = list(dict.fromkeys((b, c, lw, obs, None if obs == "window" else every, norm, probe, read)
                              for b, c, lw, obs, every, norm, probe, read in grid))
    print(f"[1/{1 + len(grid)}] full cache, {len(long)}-token prompt + {args.decode} decoded", file=sys.stderr, flush=True)
    full = measure(model, long, "full", "1", args.decode, args.threads)
    rows = []
    for i, (backend, chunk, low, obs, every, norm, probe, read) in enumerate(grid, 2):
        observe = "observed by each chunk's window" if every is None else f"observe every {every}"
        print(f"[{i}/{1 + len(grid)}] {args.method} {args.budget} ({backend} backend), chunk {chunk}, "
              f"low water {low or 'default'}, {observe}" + (f", {norm} value norms" if norm else "")
              + f", {probe} probe" + (f", read in {read_label(read)} cells" if read != 0 else ""),
              file=sys.stderr, flush=True)
        params = {"value_norm": norm} if norm else None
        r = measure(model, long, args.method, args.budget, args.decode, args.threads, backend, chunk=chunk,
                    recall=recall_of(args), low_water=low, observe_every=every or 1, method_params=params,
                    prefill_observe=obs or PREFILL_OBSERVE, probe=probe, read_cells=read)
        rows.append(dict(chunk=chunk, low_water=r["low_water"], recall=r["recall"],
                         host_tier_bytes=r["host_tier_bytes"], prefill_observe=r["prefill_observe"],
                         observe_every=None if r["prefill_observe"] == "window" else every,
                         value_norm=resolve_method_params(args.method, params).get("value_norm"),
                         kv_bytes=r["kv_bytes_allocated"], n_ctx=r["n_ctx"],
                         ttft=r["ttft_seconds"], decode_tok_s=r["decode_tok_s"], events=r["compression_events"],
                         moved=r["observations_moved"], windows=r["observations_window"],
                         compression_seconds=r["compression_seconds"], reselect_seconds=r["recall_seconds"],
                         share=r["compression_seconds"] / r["prefill_seconds"], breakdown=r["compression_breakdown"],
                         backend=r["backend"], probe=probe, probe_tokens=r["probe_tokens"], read_cells=read,
                         reading_bytes=r["reading_bytes_peak"]))
    if _json_or_title(args, model, "overhead", [dict(full=True, kv_bytes=full["kv_bytes_allocated"],
                                                     ttft=full["ttft_seconds"], decode_tok_s=full["decode_tok_s"]),
                                                *rows], f"{len(long):,}-token prompt, {args.decode} decoded"):
        return 0
    mib = 2**20
    print(f"full cache: {full['kv_bytes_allocated'] / mib:.1f} MiB, TTFT {full['ttft_seconds']:.1f} s, "
          f"decode {full['decode_tok_s']:.1f} tok/s; recall tier in the compressed runs: "
          + ("on" if rows[0]["recall"] else "off"))
    print(f"{'backend':>8} {'probe':>8} {'chunk':>6} {'low':>5} {'observe':>8} {'norm':>5} {'read':>6} {'n_ctx':>6} {'KV vs full':>10} {'read vs full':>12} {'TTFT vs full':>12} {'decode vs full':>14} "
          f"{'events':>7} {'decoded':>8} {'share':>7} {'observe s':>10} {'score s':>8} {'apply s':>8}   target: share <= 5%")
    for r in rows:
        b = r["breakdown"]
        observe = "window" if r["observe_every"] is None else r["observe_every"]
        print(f"{r['backend']:>8} {r['probe']:>8} {r['chunk']:>6} {r['low_water']:>5g} {observe:>8} {r['value_norm'] or '-':>5} {read_label(r['read_cells']):>6} {r['n_ctx']:>6,} {r['kv_bytes'] / full['kv_bytes_allocated']:>9.3f}x "
              f"{r['reading_bytes'] / full['kv_bytes_allocated']:>11.3f}x "
              f"{r['ttft'] / full['ttft_seconds']:>11.2f}x {r['decode_tok_s'] / full['decode_tok_s']:>13.2f}x "
              f"{r['events']:>7} {r['events'] - r['moved'] - r['windows']:>8} {100 * r['share']:>6.1f}% {b.get('observe', 0):>10.2f} "
              f"{b.get('score', 0) + b.get('read', 0):>8.2f} {b.get('apply', 0):>8.2f}")
    print("probe: the prompt's last 32 tokens as its question, or generic: read before any question, as a chat reads a "
          "document (--probes); low: the share of the budget a prompt's events leave before its last (--low-waters); "
          "decoded: events whose probe was decoded (the others were scored by its queries moved by RoPE, or by their "
          "chunk's window); observe: --observe-every, or window: each event but the prompt's last scored by its "
          "chunk's own last tokens (--prefill-observe window); score s includes reading the cells; read: the cells a "
          "long prompt may be read in before one compression (--read-cells; 0: the budget's context), read vs full: "
          "the host memory that reading context held")
    return 0


# what --frontier compares, by the names --configs takes: (method, budget, cache type); "method" is --method at --budget
FRONTIER_CONFIGS = {"full": ("full", "1", "f16"), "full-kv-q8_0": ("full", "1", "q8_0"),
                    "full-kv-q4_0": ("full", "1", "q4_0"), "method": (None, None, "f16"),
                    "method@kv-q8_0": (None, None, "q8_0")}


def frontier_configs(method: str, budget: str, names=tuple(FRONTIER_CONFIGS)) -> list[tuple[str, str, str, str]]:
    """(label, method, budget, cache type) of each configuration ``--frontier`` compares, of ``names`` (the keys
    of :data:`FRONTIER_CONFIGS`, in its order)."""
    rows = []
    for name, (m, b, cache) in FRONTIER_CONFIGS.items():
        if name in names:
            label = name if m else name.replace("method", method) + f" {budget}"
            rows.append((label, m or method, b or budget, cache))
    return rows


def run_frontier(args, model: Model) -> int:
    """``--frontier``: the configurations of :func:`frontier_configs` at each ``--contexts`` length."""
    configs = frontier_configs(args.method, args.budget, args.configs)
    rows = []
    for n in args.contexts:
        tokens = long_text(model, n - args.decode - 1)
        for i, (label, method, budget, cache) in enumerate(configs, 1):
            print(f"[{n:,} tokens {i}/{len(configs)}] {label}", file=sys.stderr, flush=True)
            r = measure(model, tokens, method, budget, args.decode, args.threads, cache=cache,
                        recall=recall_of(args))
            rows.append(dict(tokens=n, config=label, kv_bytes=r["kv_bytes_allocated"], ttft=r["ttft_seconds"],
                             decode_tok_s=r["decode_tok_s"], compression_seconds=r["compression_seconds"],
                             share=r["compression_seconds"] / r["prefill_seconds"], events=r["compression_events"]))
    if args.plot:
        _plot_frontier(rows, args.plot, f"{model.path.name} · {args.method} at {args.budget}")
    if _json_or_title(args, model, "frontier", rows, f"{args.decode} decoded"):
        return 0
    mib = 2**20
    print(f"{'tokens':>8}  {'configuration':<26}{'KV MiB':>8} {'vs full':>8} {'TTFT s':>8} {'vs full':>8} "
          f"{'decode t/s':>11} {'vs full':>8} {'compression':>12}")
    for r in rows:
        full = next(f for f in rows if f["tokens"] == r["tokens"] and f["config"] == "full")
        share = f"{100 * r['share']:.1f}%" if r["events"] else "-"
        print(f"{r['tokens']:>8,}  {r['config']:<26}{r['kv_bytes'] / mib:>8.1f} {r['kv_bytes'] / full['kv_bytes']:>7.3f}x "
              f"{r['ttft']:>8.2f} {r['ttft'] / full['ttft']:>7.2f}x {r['decode_tok_s']:>11.1f} "
              f"{r['decode_tok_s'] / full['decode_tok_s']:>7.2f}x {share:>12}")
    return 0


def _json_or_title(args, model: Model, key: str, rows: list[dict], what: str) -> bool:
    """``--json``: print ``{key: rows}`` and return True; else print the table's title line."""
    if args.json:
        print(json.dumps({key: rows}, indent=1))
        return True
    print(f"model {model.path.name} · method {args.method} · budget {args.budget} · {what} · "
          f"threads {args.threads or 'default'}")
    return False


def _plot_frontier(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for label in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == label]
        x = [r["tokens"] for r in rs]
        for ax, key, scale in zip(axes, ("kv_bytes", "ttft", "decode_tok_s"), (2**-20, 1, 1)):
            ax.plot(x, [r[key] * scale for r in rs], marker="o", label=label)
    for ax, name in zip(axes, ("KV MiB", "TTFT (s)", "decode tokens/s")):
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


QUESTION = "\n\nQuestion: which obligations does the text above put on someone who conveys the work?\nAnswer:"


def run_recall_cost(args, model: Model) -> int:
    """``--recall-cost``: one question's re-selections against the document's prefill, per length: the
    question's, then its answer's first ``RECALL_STEPS`` tokens' (each with its own query)."""
    rows = []
    question = model.tokenize(QUESTION, add_special=False)
    backends = args.backends or default_backends()
    texts = {n: long_text(model, n) for n in args.contexts}  # one document per length, read by every run of it
    runs = itertools.product(args.contexts, backends, args.step_confidence, args.step_every, args.decode_observe)
    n_answer = RECALL_STEPS + RECALL_ROOM + 1  # past the answer's room: the compression back to the budget
    for n, backend, confidence, every, observe in runs:
        tokens = texts[n]
        print(f"reading {n:,} tokens with recall on ({backend} backend), then one question and {n_answer} "
              f"tokens of its answer (step confidence {confidence:g}, a swap at most every {every} steps)",
              file=sys.stderr, flush=True)
        eng = Engine(model, args.budget, args.method, max_tokens=n + len(question) + n_answer + 8,
                     n_threads=args.threads, recall=True, backend=backend, recall_step_confidence=confidence,
                     recall_step_every=every, decode_observe=observe)
        eng.prefill(tokens, reselect_after=True)  # a document read before any question (the generic probe), as a chat reads it
        s = eng.stats
        out0, in0, copied0, comp0 = s.recall_rows_out, s.recall_rows_in, eng.kv.host_kv_bytes, s.compression_seconds
        observe0 = s.compression_breakdown.get("observe", 0.0)
        eng.append(question, probe=question, question=True)
        decode0 = s.decode_seconds
        answer = len(list(eng.generate(n_answer, stop_at_eog=False)))
        back = s.compression_seconds - comp0  # the turn's compressions: back to the budget past the answer's room
        seconds = s.recall_seconds + s.recall_step_seconds + back
        rows.append(dict(tokens=n, backend=backend, step_confidence=confidence, step_every=every,
                         decode_observe=observe,
                         prefill_seconds=s.prefill_seconds,
                         question_seconds=s.recall_seconds, question_share=s.recall_seconds / s.prefill_seconds,
                         steps=s.recall_steps, step_seconds=s.recall_step_seconds,
                         confident_steps=s.recall_steps_confident, back_seconds=back,
                         back_observe_seconds=s.compression_breakdown.get("observe", 0.0) - observe0,
                         back_kept=s.observations_kept,
                         answer_tokens=answer, answer_seconds=s.decode_seconds - decode0, recall_seconds=seconds,
                         share=seconds / s.prefill_seconds, rows_in=s.recall_rows_in - in0,
                         rows_out=s.recall_rows_out - out0, candidates=s.recall_candidates,
                         prefill_host_kv_bytes=copied0, recall_host_kv_bytes=eng.kv.host_kv_bytes - copied0,
                         host_tier_bytes=s.host_tier_bytes, kv_bytes_allocated=s.kv_bytes_allocated,
                         budget_cells=s.budget_cells, compression_events=s.compression_events))
        eng.tier.close()
    if _json_or_title(args, model, "recall", rows, f"one question after the document, {RECALL_STEPS + RECALL_ROOM + 1} answer tokens"):
        return 0
    mib = 2**20
    print(f"{'tokens':>8} {'backend':>8} {'budget':>7} {'conf':>5} {'every':>5} {'back by':>7} {'prefill s':>10} {'question s':>11} {'q share':>8} {'steps':>6} {'sure':>5} {'steps s':>8} {'back s':>7} "
          f"{'share':>7} {'scored':>8} {'rows in':>8} {'rows out':>9} {'tier MiB':>9} {'KV MiB':>7} {'copied MiB':>11}"
          f"   target: share <= 3%")
    for r in rows:
        print(f"{r['tokens']:>8,} {r['backend']:>8} {r['budget_cells']:>7,} {r['step_confidence']:>5g} {r['step_every']:>5} {r['decode_observe']:>7} {r['prefill_seconds']:>10.1f} "
              f"{r['question_seconds']:>11.2f} {100 * r['question_share']:>7.2f}% {r['steps']:>6} {r['confident_steps']:>5} {r['step_seconds']:>8.2f} {r['back_seconds']:>7.2f} {100 * r['share']:>6.2f}% "
              f"{r['candidates']:>8,} {r['rows_in']:>8,} {r['rows_out']:>9,} {r['host_tier_bytes'] / mib:>9.1f} "
              f"{r['kv_bytes_allocated'] / mib:>7.1f} {r['recall_host_kv_bytes'] / mib:>11.1f}")
    print("conf: --step-confidence; every: --step-every; back by: --decode-observe; question s: the question's re-selection (its probe decode included); q share: it alone, of the prefill; steps: the "
          "answer's tokens that re-selected with their own query (sure: of them, those whose decode predicted the next "
          "token above conf, or came fewer than every steps after the last swap, and was kept: no swap, their time is decoding's); steps s: the others' time; back s: the turn's compressions (the answer's, back to the budget once it outgrows the room the question left it); share: the three, of the prefill; copied: K/V bytes they moved between "
          "llama.cpp's cache and kvlocal's memory (state: the kept rows written back in place on the CPU, the cache "
          "out and back through the state blob elsewhere; native: only the rows brought back in and the evicted rows "
          "out)")
    return 0


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", default=None, help="a .gguf file or known model (default qwen2.5-coder-0.5b)")
    p.add_argument("--budget", default="0.1")
    p.add_argument("--method", default="criticalkv")
    p.add_argument("--long", type=int, default=8192 - 64 - 1, help="tokens of the long prompt (default 8127: 8K with decode)")
    p.add_argument("--decode", type=int, default=64, help="tokens to decode for the speed figure (default 64)")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    add_setting_args(p, names=("rpc", "tensor_split"))
    p.add_argument("--recall", default=None, choices=list(RECALL),
                   help="the recall tier in the compressed runs: off (the default: the cache alone, as the figures in "
                        "the docs were measured), on, or auto (kvlocal chat's default: on for the eviction methods); "
                        "--recall-cost always reads with it")
    p.add_argument("--backends", nargs="+", choices=("native", "state"), default=None,
                   help="the KV backends to run the compressed prompt on (default: native and state where both run; "
                        "--overhead: the one auto picks)")
    p.add_argument("--cache", default="f16", metavar="TYPE",
                   help="the K and V cache type of the full and the compressed runs side by side (llama.cpp's "
                        "-ctk/-ctv names: f16, q8_0, q4_0, ...; default f16); refused with --frontier (it has its own "
                        "q8_0 and q4_0 rows), --recall-cost and --overhead (they run on f16)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--recall-cost", action="store_true",
                   help="measure one question's re-selection by the recall tier against the document's prefill, "
                        "per --contexts length (target <= 3%%), instead of the backends")
    p.add_argument("--step-confidence", type=float, nargs="+", default=[RECALL_STEP_CONFIDENCE], metavar="P",
                   help="with --recall-cost: an answer step whose decode predicts the next token above P swaps nothing "
                        "and its query waits for the next swap (Engine(recall_step_confidence=); default %(default)s; "
                        "1: every step swaps); several: side by side")
    p.add_argument("--step-every", type=int, nargs="+", default=[RECALL_STEP_EVERY], metavar="N",
                   help="with --recall-cost: an answer step swaps only when N steps past the last swap, the ones "
                        "between keep their decode and hold their queries for it (Engine(recall_step_every=); "
                        "default %(default)s); several: side by side")
    p.add_argument("--decode-observe", nargs="+", choices=list(DECODE_OBSERVATIONS), default=[DECODE_OBSERVE],
                   help="with --recall-cost: how the answer's compression back to the budget is observed — "
                        "probe: its probe decoded, kept: the queries its tokens had (Engine(decode_observe=); "
                        "default %(default)s); several: side by side")
    p.add_argument("--frontier", action="store_true",
                   help="per --contexts length: the full F16 cache, the q8_0 and q4_0 K+V caches, the method at the "
                        "budget and on a q8_0 cache — KV bytes, TTFT, decode speed, compression share")
    p.add_argument("--configs", nargs="+", choices=list(FRONTIER_CONFIGS), default=list(FRONTIER_CONFIGS),
                   metavar="NAME", help="with --frontier: the configurations to run, of %(choices)s (method: "
                   "--method at --budget; default all; full is needed, every ratio is to it) — at 32K a CPU "
                   "takes hours for llama.cpp's quantized caches alone")
    p.add_argument("--overhead", action="store_true",
                   help="compression's cost per lever: every --chunks × --observe-every on the --long prompt, against the full cache")
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 512], metavar="N", help="with --overhead (default 128 512)")
    p.add_argument("--low-waters", type=float, nargs="+", default=[None], metavar="F",
                   help=f"with --overhead: the share of the budget a prompt's compression events leave before its last "
                        f"one (Engine(low_water=); fewer, larger events in the same cells; default: the engine's, "
                        f"{LOW_WATER} with a recall tier and 1 without, which this bench runs)")
    p.add_argument("--read-cells", type=read_cells_flag, nargs="+", default=[0], metavar="N|whole",
                   help="with --overhead: the cells a prompt longer than the free cells may be read in, on the host, "
                        "before one compression (Engine(read_cells=); whole: no cap; default 0: read in the "
                        "budget's context)")
    p.add_argument("--observe-every", type=int, nargs="+", default=[1, 4], metavar="N",
                   help="with --overhead: events one probe decode scores (default 1 4)")
    p.add_argument("--probes", nargs="+", choices=["question", "generic"], default=["question"], metavar="PROBE",
                   help="with --overhead: how the prompt is read — question: its last 32 tokens are its question "
                        "(the probe), generic: before any question, as a chat reads a document, scored by the "
                        "engine's generic probe (default question)")
    p.add_argument("--prefill-observe", nargs="+", choices=list(PREFILL_OBSERVATIONS), metavar="MODE",
                   help="with --overhead: how the prompt's events before its last are observed — probe: its "
                        "probe decoded (once in --observe-every events), window: the queries of the chunk's own "
                        "last tokens (Engine(prefill_observe=); default: the engine's, probe)")
    p.add_argument("--value-norms", nargs="+", choices=list(VALUE_NORMS), metavar="NORM",
                   help="with --overhead and a CriticalKV method: the value norm's lever, l1 and/or l2 "
                        "(default: the engine's, l2; docs/engine.md)")
    p.add_argument("--plot", metavar="FILE", help="with --frontier: a figure (PNG) of the table against the context")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384], metavar="N",
                   help="context lengths for --recall-cost and --frontier (default 4096 8192 16384)")
