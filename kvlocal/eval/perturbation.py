"""The CriticalKV paper's output-perturbation analysis, on the PyTorch reference (``kvlocal eval --perturbation``).

Feng et al., "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective"
(https://arxiv.org/abs/2502.03805) argue that which cached entries matter depends not only on the
attention they get but also on their values as ``W_O`` projects them, and measure it on the same prompts:

(a) **per-head output perturbation** ``‖o − ô‖₁``: ``o`` is a query head's attention output for the
    observation-window queries, projected through that head's slice of ``W_O`` (``W_O^h``, columns
    ``h·d:(h+1)·d`` of ``o_proj.weight``), over the full cache; ``ô`` the same over the entries a method
    keeps (the softmax renormalised over them). L1 over the hidden dimension, mean over the window's
    queries and the query heads, per layer, then over the compressed layers.
(b) **hidden-state perturbation**: the window's final hidden state (after the model's last layer and its
    output norm: what the output head reads, HF's ``last_hidden_state``) over the full cache against the
    same tokens run again over every layer's compressed cache: relative L1 ``Σ|h − ĥ| / Σ|h|`` and the
    cosine distance ``1 − cos(h, ĥ)`` (mean over the window's tokens).

What is measured, step by step (all float32, the GGUF file's weights, :mod:`kvlocal.reference`):

1. A prompt of real prose: the eval tasks' own text source (:class:`~kvlocal.eval.tasks.Prose`, a
   seeded start), cut to ``n_tokens`` tokens (llama.cpp's tokenizer, with BOS).
2. The reference model reads all but the last ``window`` tokens (``prefill``), then the last ``window``
   tokens — the observation window — capturing their queries and their final hidden state.
3. Per method and budget, the engine's own selection: :func:`kvlocal.compress.make_scorer` and
   :func:`~kvlocal.compress.plan_layers` on every layer's cache, with the engine's sinks (4), window (32)
   and budget in cells (``max(sinks + window, ceil(ratio · n_tokens))``, :class:`kvlocal.engine.Budget`);
   the plan's rows (:meth:`~kvlocal.compress.Plan.materialize`) become a reference cache layer.
4. (a) from the captured queries over the full and the compressed layer; (b) by running the window's
   tokens again over the compressed caches with the window's own rows taken out (the forward appends
   them anew, computed from the perturbed layers below).

Sliding-window layers (gemma3) are not compressed, as in the engine; they are left out of (a).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
import sys
import time
from pathlib import Path

from kvlocal.errors import UsageError
from kvlocal.eval.tasks import Prose

METHODS_DEFAULT = ("streaming", "snapkv", "criticalkv")
DEFAULTS = {"models": ["smollm2-135m"], "methods": list(METHODS_DEFAULT), "budgets": ["0.05", "0.1", "0.2", "0.4"],
            "tokens": 1024}
QUICK = {"models": ["smollm2-135m"], "methods": list(METHODS_DEFAULT), "budgets": ["0.1", "0.2"], "tokens": 400}
FILE, TABLE = "perturbation.jsonl", "perturbation.md"


# -- the prompt -----------------------------------------------------------------------------------------

def prompt_tokens(lm, n_tokens: int, seed: int) -> list[int]:
    """``n_tokens`` tokens of real prose (with BOS where the model has one), seeded as the eval tasks are
    (a private RNG, ``perturbation:{seed}:{n_tokens}``). Sentences counted one by one make more tokens than
    their joined text, so a little more text is taken and the tokens are cut to ``n_tokens``."""
    prose = Prose(lambda s: len(lm.tokenize(s, add_special=False)))
    for extra in range(64, 16 * n_tokens, 64):
        tokens = lm.tokenize("".join(prose.take(n_tokens + extra, random.Random(f"perturbation:{seed}:{n_tokens}"))))
        if len(tokens) >= n_tokens:
            return tokens[:n_tokens]
    raise ValueError(f"the shipped texts do not make {n_tokens} tokens")


# -- the analysis ----------------------------------------------------------------------------------------

class Perturbation:
    """One prompt read by the reference model; :meth:`measure` compresses its cache and measures (a) and (b).

    After construction: ``cache`` (the full cache, every token), ``queries[il]`` ``[Hq, w, d]`` (the
    window's post-RoPE queries with the model's attention scale folded in, as the engine scores them),
    ``q_pos`` ``[w]``, ``hidden`` ``[w, D]`` (the window's final hidden state over the full cache),
    ``layers`` (the layers compressed) and ``outputs[il]`` ``[Hq, w, D]`` (the per-head ``o`` of (a)).
    """

    def __init__(self, model, tokens, window: int | None = None, n_sink: int | None = None):
        import torch

        from kvlocal.engine import EngineConfig
        from kvlocal.reference import prefill

        self.model, self.args = model, model.args
        self.window = EngineConfig.recent if window is None else window
        self.n_sink = EngineConfig.n_sink if n_sink is None else n_sink
        self.tokens = torch.as_tensor(tokens, dtype=torch.int64)
        self.n = len(self.tokens)
        if self.n < self.window + self.n_sink + 1:
            raise UsageError(f"a prompt of {self.n} tokens is too short for a window of {self.window} and "
                             f"{self.n_sink} sinks")
        t0 = time.perf_counter()
        self.cache = model.new_cache()
        prefill(model, self.tokens[: -self.window], self.cache)
        self.q_pos = torch.arange(self.n - self.window, self.n)
        self.hidden, queries = self._window_pass(self.cache)
        self.queries = [q * layer.attention.q_gain for q, layer in zip(queries, model.layers)]
        self.layers = [il for il in range(self.args.n_layer) if not self.args.swa[il]]
        self.outputs = {il: self.head_outputs(il, self.cache[il]) for il in self.layers}
        self.prefill_seconds = time.perf_counter() - t0

    def _window_pass(self, cache):
        """Run the window's tokens over ``cache`` (appending their rows): (final hidden [w, D], queries)."""
        seen = []
        hook = self.model.norm.register_forward_hook(lambda mod, inp, out: seen.append(out))
        try:
            _, queries = self.model(self.tokens[-self.window :], self.q_pos, cache, capture_queries=True)
        finally:
            hook.remove()
        return seen[-1], queries

    def head_outputs(self, il: int, kv):
        """``[Hq, w, D]``: each query head's attention output for the window over ``kv`` (layer ``il``),
        projected through its slice ``W_O^h``. Summed over the heads (plus ``o_proj``'s bias, if any) it is
        the layer's attention output."""
        from kvlocal.reference.model import attend_window

        attn = self.model.layers[il].attention
        a = attend_window(self.queries[il], self.q_pos, kv, attn.sliding_window)  # [Hq, w, d]
        hq, _, d = a.shape
        wo_h = attn.wo.weight.view(-1, hq, d).permute(1, 2, 0)  # [Hq, d, D]: W_O^h = wo[:, h*d:(h+1)*d].T
        return a @ wo_h

    def budget_cells(self, ratio: float) -> int:
        """The engine's budget for ``ratio`` of this prompt: ``max(sinks + window, ceil(ratio · n))``, at most n."""
        from kvlocal.engine import Budget

        return min(Budget(ratio=ratio).cells_for(self.n, self.n_sink + self.window), self.n)

    def compressed(self, method: str, cells: int, params: dict | None = None) -> dict:
        """``{il: LayerKV}``: every compressed layer's cache as the engine's scorer ``method`` (with
        hyperparameters ``params``, :func:`~kvlocal.compress.make_scorer`) leaves it in ``cells`` slots per layer
        (its :class:`~kvlocal.compress.Plan`, materialized): each head's budget is the scorer's share of them, as
        the engine's (``budget_for_cells``: all of them, or less for AdaKV, whose widest head fills the cells)."""
        import numpy as np
        import torch

        from kvlocal.compress import LayerInputs, make_scorer, plan_layers
        from kvlocal.reference.cache import LayerKV

        full = [self.cache[il] for il in self.layers]

        def inputs():
            for il, kv in zip(self.layers, full):
                yield LayerInputs(k=kv.k.numpy(), v=kv.v.numpy(), pos=kv.pos.numpy(), q=self.queries[il].numpy(),
                                  q_pos=self.q_pos.numpy(), wo=self.model.layers[il].attention.wo.weight.numpy(),
                                  layer=il, n_sink=self.n_sink, recent=self.window)

        scorer = make_scorer(method, **(params or {}))
        plan = plan_layers(scorer, inputs(), scorer.budget_for_cells(cells))
        k, v, counts, bias = plan.materialize([kv.k.permute(1, 0, 2).numpy() for kv in full],
                                              [kv.v.permute(1, 0, 2).numpy() for kv in full])
        return {il: LayerKV(k=torch.from_numpy(np.ascontiguousarray(k[i].transpose(1, 0, 2))),
                            v=torch.from_numpy(np.ascontiguousarray(v[i].transpose(1, 0, 2))),
                            pos=torch.from_numpy(plan.positions[i].copy()), count=torch.from_numpy(counts[i]),
                            bias=torch.from_numpy(bias[i]))
                for i, il in enumerate(self.layers)}

    def _before_window(self, kv):
        """``kv`` without the window's own rows (the last ``window`` slots of every head, checked)."""
        w0, w = int(self.q_pos[0]), self.window
        if not (bool((kv.pos[:, -w:] >= w0).all()) and bool((kv.pos[:, :-w] < w0).all())):
            raise ValueError("the compressed cache does not end with the window's rows in every head")
        return dataclasses.replace(kv, k=kv.k[:, :-w], v=kv.v[:, :-w], pos=kv.pos[:, :-w], count=kv.count[:, :-w],
                                   bias=kv.bias[:, :-w])

    def measure(self, method: str, ratio: float, params: dict | None = None) -> dict:
        """(a) and (b) for one method (and hyperparameters) at one budget ratio (1 keeps every entry: both are 0)."""
        import torch
        import torch.nn.functional as F

        t0 = time.perf_counter()
        cells = self.budget_cells(ratio)
        layers = self.compressed(method, cells, params)
        per_layer, o_norm = [], []
        for il, kv in layers.items():
            o = self.outputs[il]
            per_layer.append(float((o - self.head_outputs(il, kv)).abs().sum(-1).mean()))
            o_norm.append(float(o.abs().sum(-1).mean()))
        cache = self.model.new_cache()  # every layer before the window: compressed, or (sliding) as it was
        for il in range(self.args.n_layer):
            cache.layers[il] = self._before_window(layers[il] if il in layers else self.cache[il])
        hidden, _ = self._window_pass(cache)
        h = self.hidden
        return {"method": method, "params": params or {}, "budget": ratio, "budget_cells": cells,
                "prompt_tokens": self.n, "window": self.window, "n_sink": self.n_sink, "layers": self.layers,
                "head_l1": sum(per_layer) / len(per_layer), "head_l1_per_layer": per_layer,
                "o_l1": sum(o_norm) / len(o_norm), "o_l1_per_layer": o_norm,
                "hidden_rel_l1": float((h - hidden).abs().sum() / h.abs().sum()),
                "hidden_cos": float(1 - F.cosine_similarity(h, hidden, dim=-1).mean()),
                "seconds": time.perf_counter() - t0, "torch_threads": torch.get_num_threads()}


def key(model: str, method: str, budget: float, seed: int, n_tokens: int) -> str:
    return f"{model}|perturbation|{method}|{budget:g}|{seed}|{n_tokens}"


def analyse(name: str, path: Path, methods, budgets, seed: int, n_tokens: int, done: frozenset = frozenset(),
            progress=None):
    """Records (without the command) of every method × budget on one model that is not in ``done`` (keys);
    the model is loaded only if one is missing. ``progress(text)`` is told what happens."""
    todo = [(m, b) for b in budgets for m in methods if key(name, m, b, seed, n_tokens) not in done]
    if not todo:
        return
    from kvlocal.reference import Transformer
    from kvlocal.runtime import Model
    from kvlocal.eval.runner import model_sha256

    say = progress or (lambda text: None)
    say(f"{name}: loading the reference model")
    model, sha = Transformer.from_gguf(path), model_sha256(path)
    tokens = prompt_tokens(Model(path), n_tokens, seed)
    say(f"{name}: reading {len(tokens)} tokens")
    p = Perturbation(model, tokens)
    for method, budget in todo:
        say(f"{name}: {method} at {budget:g}")
        rec = p.measure(method, budget)
        yield {"key": key(name, method, budget, seed, n_tokens), "model": name, "model_file": path.name,
               "model_sha256": sha, "seed": seed, "n_tokens": n_tokens, **rec, "prefill_seconds": p.prefill_seconds}


# -- the report ------------------------------------------------------------------------------------------

def table(records: list[dict]) -> str:
    """The Markdown summary: one row per model, budget and method, CriticalKV/SnapKV ratios on CriticalKV's
    rows; then, per model, in how many (layer, budget) pairs CriticalKV's ``‖o − ô‖₁`` is below SnapKV's
    (and equal: at a budget that sinks and window fill, both keep the same entries)."""
    order = {m: i for i, m in enumerate(METHODS_DEFAULT)}
    runs = dict.fromkeys((r["model"], r["seed"], r["n_tokens"]) for r in records)  # in the order first seen
    by = {(r["model"], r["seed"], r["n_tokens"], r["budget"], r["method"]): r for r in records}
    lines = ["| model | tokens | seed | budget | cells | method | mean ‖o−ô‖₁ | hidden rel. L1 "
             "| hidden cos. dist. | CriticalKV/SnapKV ‖o−ô‖₁ | CriticalKV/SnapKV hidden |", "|" + "---|" * 11]
    notes = []
    for run in runs:
        rows = sorted((r for r in records if (r["model"], r["seed"], r["n_tokens"]) == run),
                      key=lambda r: (r["budget"], order.get(r["method"], len(order)), r["method"]))
        below = equal = total = 0
        for r in rows:
            snap = by.get((*run, r["budget"], "snapkv"))
            ratios = ["–", "–"]
            if r["method"] == "criticalkv" and snap:
                ratios = [_ratio(r["head_l1"], snap["head_l1"]), _ratio(r["hidden_rel_l1"], snap["hidden_rel_l1"])]
                pairs = list(zip(r["head_l1_per_layer"], snap["head_l1_per_layer"]))
                below += sum(c < s for c, s in pairs)
                equal += sum(c == s for c, s in pairs)
                total += len(pairs)
            lines.append(f"| {r['model']} | {r['prompt_tokens']} | {r['seed']} | {r['budget']:g} | {r['budget_cells']} "
                         f"| {r['method']} | {r['head_l1']:.4f} | {r['hidden_rel_l1']:.4f} | {r['hidden_cos']:.5f} "
                         f"| {ratios[0]} | {ratios[1]} |")
        if rows:
            notes.append(f"- {run[0]} (seed {run[1]}): mean ‖o‖₁ over the full cache {rows[0]['o_l1']:.3f}; "
                         + (f"CriticalKV's ‖o−ô‖₁ is below SnapKV's in {below} of {total} (layer, budget) "
                            f"pairs, equal in {equal} (the same entries kept)"
                            if total else "no CriticalKV/SnapKV pair to compare"))
    return "\n".join(lines + [""] + notes) + "\n"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b > 0 else "–"


def read_records(path: Path) -> list[dict]:
    """The records of a perturbation file (a torn last line, from a killed run, is ignored)."""
    from kvlocal.eval.report import load

    return load(path) if path.exists() else []


# -- the command ------------------------------------------------------------------------------------------

def options(args) -> dict:
    """``kvlocal eval --perturbation``'s effective options, validated; task-only flags are refused."""
    from kvlocal.eval.command import budget_ratio, check_choices
    from kvlocal.eval.runner import OBSERVATIONS

    for flag, given in (("--tasks", args.tasks), ("--items", args.items)):
        if given not in (None, []):
            raise UsageError(f"{flag} does not apply to --perturbation (one prompt of prose per model, no tasks)")
    if list(args.observations) != list(OBSERVATIONS):
        raise UsageError("--observations does not apply to --perturbation (the prompt's own last 32 tokens "
                         "are the observation window)")
    from kvlocal.compress import METHODS

    base = QUICK if args.quick else DEFAULTS
    o = {k: getattr(args, k) if getattr(args, k) not in (None, []) else v for k, v in base.items()}
    check_choices("--methods", o["methods"], [m for m in METHODS if m != "full"])
    o["budgets"] = [budget_ratio(b) for b in o["budgets"]]
    if o["tokens"] < 200:
        raise UsageError(f"--tokens {o['tokens']} is too short: give at least 200")
    if args.threads is not None and args.threads < 1:
        raise UsageError("-t/--threads must be at least 1")
    return o


def run(args) -> int:
    """``kvlocal eval --perturbation``: DIR/perturbation.jsonl (resumable) and DIR/perturbation.md."""
    o = options(args)
    try:
        import torch
    except ImportError:
        raise UsageError("--perturbation runs on the PyTorch reference: pip install 'kvlocal[reference]' "
                         "(in a checkout: pip install -e '.[reference]')") from None
    from tqdm import tqdm

    from kvlocal.models import resolve
    from kvlocal.eval.runner import done_keys

    if args.threads:
        torch.set_num_threads(args.threads)
    paths = {m: resolve(m) for m in o["models"]}
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file: give a folder")
    out.mkdir(parents=True, exist_ok=True)
    results = out / FILE
    done = frozenset(done_keys(results))
    command = shlex.join(["kvlocal", *sys.argv[1:]])
    total = len(o["models"]) * len(o["methods"]) * len(o["budgets"])
    bar = tqdm(total=total, desc="kvlocal eval --perturbation", unit="run", file=sys.stderr, dynamic_ncols=True)
    bar.update(sum(key(m, x, b, args.seed, o["tokens"]) in done
                   for m in o["models"] for x in o["methods"] for b in o["budgets"]))
    t0, new = time.perf_counter(), 0
    with results.open("a") as f:
        if results.stat().st_size and not results.read_bytes().endswith(b"\n"):
            f.write("\n")  # a line torn by a killed run stays on its own, ignored
        for name in o["models"]:
            for rec in analyse(name, paths[name], o["methods"], o["budgets"], args.seed, o["tokens"], done,
                               bar.set_postfix_str):
                rec.update(command=command, finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
                f.write(json.dumps(rec) + "\n")
                f.flush()
                new += 1
                bar.update(1)
    bar.close()
    text = table(read_records(results))
    (out / TABLE).write_text(text)
    print(text)
    print(f"kvlocal eval --perturbation: {new} runs in {time.perf_counter() - t0:.0f} s, {total - new} already done; "
          f"{results}, {out / TABLE}", file=sys.stderr)
    return 0
