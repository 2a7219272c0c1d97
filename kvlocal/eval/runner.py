"""Methods × budgets × observation modes × tasks × models → one JSON record per run.

A *run* (:class:`Spec`) is one method at one budget and observation mode on every item of one task, for
one model, context length and seed; its record holds the mean score, each item's reply and score (a chat
task's: each turn's, with the shares of turns confused and missed and of replies that loop), the
KV bytes llama.cpp allocated, timing, the exact command, the model's sha256 and the seed. Records are
appended to ``results.jsonl`` as they finish; a run whose key is already there is skipped, so rerunning
the same command continues where a stopped one left off.

Every task also runs on the full F16 cache (``full``, the reference of compression loss and of the
continuation metrics). The memory baselines compression must beat at equal KV bytes: ``full-kv-q8_0``
and ``full-kv-q4_0`` are the full cache with K and V quantized (llama.cpp's ``-ctk``/``-ctv``; a
quantized V cache runs with flash attention), ``full-q8_0`` and ``full-q4_0`` with K alone (``-ctk``).
Compression on such a cache is ``METHOD@CACHE`` (``criticalkv@kv-q8_0``: eviction of q8_0 rows). With
the recall tier, ``METHOD+recall`` (``criticalkv+recall``, ``criticalkv+recall@kv-q8_0``): evicted rows
wait on the host and the question re-selects the cache before it is decoded, as ``kvlocal run`` and a chat
do; without the suffix a method runs with recall off. ``+everyN`` (``criticalkv+every4``): the prompt's compression
events decode the probe once in N and are otherwise scored by its queries moved by RoPE (the engine's
``observe_every``; kvlocal/engine/observation.py). ``+l2`` / ``+l1`` (``criticalkv+l2``, ``criticalkv+l2+recall``): the
value norm CriticalKV ranks by, the paper's L1 (the default) or L2 (its ``value_norm``; docs/engine.md). ``+kept``
(``criticalkv+kept``): a compression while generating is scored by the queries its probe's tokens had when they
were decoded, not by decoding the probe again (the engine's ``decode_observe="kept"``); the ``generation`` task
is where such events happen. ``+window`` (``criticalkv+recall+window``): a prompt's events before its last are
scored by the queries of the chunk's own last tokens, not by a decode of the probe, question or generic (the engine's
``prefill_observe="window"``; no ``+everyN`` with it). ``+lowNN`` (``criticalkv+low60``): the prompt's events before
its last one leave NN% of the budget, so fewer events read it in the same memory (the engine's ``low_water``).
``+whole`` (``criticalkv+recall+whole``): a prompt longer than the free cells is read whole in a reading context on
the host and compressed once, so that every row is computed over all that came before it (the engine's
``read_cells=None``; kvlocal/engine/reading.py).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from kvlocal.engine import Engine
from kvlocal.models import cache_dir, sha256_file
from kvlocal.runtime import Model
from kvlocal.compress import MERGING_METHODS, METHODS, VALUE_NORMS, value_norm_refusal
from kvlocal.runtime import Sampler
from kvlocal.settings import RuntimeSettings
from kvlocal.chat.turns import Turns
from kvlocal.eval.metrics import compare_logits
from kvlocal.eval.tasks import (CHAT_TASKS, GENERATION_TASKS, KL_TASKS, N_GENERATED, Item, Prose, loops, make_items,
                                score, shares, verdict)

# quantized caches, K alone or K and V: ggml types (8 = q8_0, 2 = q4_0; None = F16). llama.cpp stores a
# quantized V cache only with flash attention, which the Engine then turns on
CACHES = {"q8_0": (8, None), "q4_0": (2, None), "kv-q8_0": (8, 8), "kv-q4_0": (2, 2)}
# the full cache quantized: the memory baselines
KV_BASELINES = {f"full-{c}": types for c, types in CACHES.items()}
# every compression method the engine has (eviction, head budgets, merging): the registry, less "full";
# each also runs on a quantized cache as METHOD@CACHE (e.g. criticalkv@kv-q8_0); split_method reads the registry
# itself, so a method discovered after this import runs too
EVICTION = tuple(m for m in METHODS if m != "full")


RECALL = "+recall"  # the suffix of a method run with the recall tier
EVERY = re.compile(r"\+every(\d+)$")  # the suffix of a method whose probe is decoded once in N events
KEPT = "kept"  # a part of a method's name (+kept): decode-time events observed by the queries their tokens had
WINDOW = "window"  # a part of a method's name (+window): a prompt's events observed by their chunk's own last tokens
LOW = re.compile(r"low(\d+)$")  # a part of a method's name (+low60): a prompt's events leave 60% of the budget
WHOLE = "whole"  # a part of a method's name (+whole): a long prompt read whole in a reading context, then compressed


def _parts(name: str) -> list[str]:
    """The ``+`` parts of a method's name after the method itself, before any ``@CACHE``."""
    return name.partition("@")[0].split("+")[1:]


def low_water(name: str) -> float:
    """The engine's ``low_water`` for a method as the eval names it (``+lowNN``: NN% of the budget; 1 without)."""
    lows = [int(m.group(1)) for m in map(LOW.match, _parts(name)) if m]
    return lows[-1] / 100 if lows else 1.0


def method_params(name: str) -> dict:
    """The engine's ``method_params`` for a method as the eval names it (``+l1``, ``+l2``: CriticalKV's
    ``value_norm``, one of :data:`~kvlocal.compress.VALUE_NORMS`). Without one, a method that has a value norm
    ranks by the paper's L1 — not the engine's default — so a name means what it meant in every earlier record."""
    norm = [part for part in _parts(name) if part in VALUE_NORMS]
    if norm:
        return {"value_norm": norm[-1]}
    return {} if value_norm_refusal(split_method(name)[0]) else {"value_norm": "l1"}


def decode_observe(name: str) -> str:
    """The engine's ``decode_observe`` for a method as the eval names it (``+kept``; "probe" without)."""
    return "kept" if KEPT in _parts(name) else "probe"


def prefill_observe(name: str) -> str:
    """The engine's ``prefill_observe`` for a method as the eval names it (``+window``; "probe" without)."""
    return WINDOW if WINDOW in _parts(name) else "probe"


def read_cells(name: str) -> int | None:
    """The engine's ``read_cells`` for a method as the eval names it (``+whole``: None, no cap; 0 without)."""
    return None if WHOLE in _parts(name) else 0


def observe_every(name: str) -> int:
    """The engine's ``observe_every`` for a method as the eval names it (``+everyN``; 1 without)."""
    m = EVERY.search(name.partition("@")[0])
    return int(m.group(1)) if m else 1


def split_method(name: str) -> tuple[str, tuple[int | None, int | None], bool]:
    """A method as the eval names it → (the engine's method, (type_k, type_v), recall); ValueError if
    unknown (or recall with a merging method, which the engine refuses)."""
    if name in KV_BASELINES:
        return "full", KV_BASELINES[name], False
    method, _, cache = name.partition("@")
    every = EVERY.search(method)
    if every and int(every.group(1)) < 1:
        raise ValueError(name)
    method = EVERY.sub("", method)
    norm = any(part in VALUE_NORMS for part in _parts(method))
    kept = KEPT in _parts(method)
    window = WINDOW in _parts(method)
    whole = WHOLE in _parts(method)
    lows = [int(m.group(1)) for m in map(LOW.match, _parts(method)) if m]
    if any(not 1 <= low <= 100 for low in lows):
        raise ValueError(name)
    method = "+".join(part for i, part in enumerate(method.split("+"))
                      if i == 0 or (part not in VALUE_NORMS and part not in (KEPT, WINDOW, WHOLE) and not LOW.match(part)))
    recall = method.endswith(RECALL)
    method = method.removesuffix(RECALL)
    if method not in METHODS or (method == "full" and (cache or recall)) or (cache and cache not in CACHES):
        raise ValueError(name)
    if (recall and method in MERGING_METHODS) or (norm and value_norm_refusal(method)):
        raise ValueError(name)
    if (lows or whole) and method == "full":  # nothing is compressed
        raise ValueError(name)
    if (kept or window) and method in ("full",) + QUERY_FREE:  # nothing observes a probe there
        raise ValueError(name)
    if window and every:  # no probe decode to spread over events
        raise ValueError(name)
    return method, CACHES[cache] if cache else (None, None), recall
QUERY_FREE = ("streaming",)  # methods that never look at the probe: one observation mode, "-"
OBSERVATIONS = ("question", "agnostic")
N_FORCED = 64  # continuation: tokens of real text forced after the prompt
CHAT_ROOM = 256  # chat tasks: tokens past the document for the chat template, the questions and the replies, at least
CHAT_OPENING = 64  # the template's opening and system text, the document's request and its 8-token reply
TURN_TEMPLATE = 16  # a question's turn and its reply's headers, past the question's own tokens
CHAT_SHARES = ("confused", "missed", "loops")  # a chat task's figures besides its score (share answered)


@dataclass(frozen=True)
class Spec:
    model: str  # as given on the command line (a known name or a path)
    task: str
    method: str
    budget: float  # ratio of the tokens seen; 1 for the full caches
    observation: str  # question, agnostic, or "-" where the method ignores the probe
    seed: int
    n_tokens: int

    @property
    def key(self) -> str:
        return f"{self.model}|{self.task}|{self.method}|{self.budget:g}|{self.observation}|{self.seed}|{self.n_tokens}"


def plan(models, tasks, methods, budgets, observations, seed: int, n_tokens: int) -> list[Spec]:
    """Every run, the full-cache reference first for each model and task."""
    specs = []
    for model in models:
        for task in tasks:
            specs.append(Spec(model, task, "full", 1.0, "-", seed, n_tokens))
            specs += [Spec(model, task, m, 1.0, "-", seed, n_tokens) for m in methods if m in KV_BASELINES]
            for budget in budgets:
                for m in (m for m in methods if m not in KV_BASELINES and m != "full"):
                    base = split_method(m)[0]
                    for obs in ("-",) if base in QUERY_FREE else ("chat",) if task in CHAT_TASKS else observations:
                        specs.append(Spec(model, task, m, float(budget), obs, seed, n_tokens))
    return specs


def done_keys(path: Path) -> set[str]:
    """Keys of the records already in a results file (a torn last line, from a killed run, is ignored)."""
    keys = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                keys.add(json.loads(line)["key"])
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
    return keys


def model_sha256(path: Path) -> str:
    """sha256 of a model file, cached by path, size and mtime in the kvlocal cache (hashing 500 MB
    takes seconds)."""
    index = cache_dir() / "sha256.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}
    st = path.stat()
    tag = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if tag not in known:
        known[tag] = sha256_file(path)
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_suffix(f".{os.getpid()}.tmp")  # two processes at once (test workers) each write their own
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, index)
    return known[tag]


class Runner:
    """Runs specs for one model file; keeps the full cache's continuation logits for the other methods."""

    def __init__(self, name: str, path: Path, n_threads: int | None, runtime: RuntimeSettings | None = None):
        self.name, self.path, self.n_threads = name, path, n_threads
        self.model = runtime.load(path) if runtime is not None else Model(path)  # runtime: --rpc, --tensor-split
        self.sha256 = model_sha256(path)
        self.prose = Prose(lambda s: len(self.model.tokenize(s, add_special=False)))
        self._items: dict[tuple, list[Item]] = {}
        self._reference: dict[tuple, np.ndarray] = {}

    def items(self, spec: Spec, n_items: int | None) -> list[Item]:
        k = (spec.task, spec.seed, spec.n_tokens)
        if k not in self._items:
            self._items[k] = make_items(spec.task, self.prose, spec.n_tokens, spec.seed)[:n_items]
        return self._items[k]

    def engine(self, spec: Spec, max_tokens: int) -> Engine:
        method, (type_k, type_v), recall = split_method(spec.method)
        return Engine(self.model, "1" if method == "full" else spec.budget, method, max_tokens=max_tokens,
                      n_threads=self.n_threads, type_k=type_k, type_v=type_v, recall=recall,
                      observe_every=observe_every(spec.method), method_params=method_params(spec.method),
                      decode_observe=decode_observe(spec.method), low_water=low_water(spec.method),
                      prefill_observe=prefill_observe(spec.method), read_cells=read_cells(spec.method))

    def run(self, spec: Spec, n_items: int | None = None) -> dict:
        """One spec over its task's items -> the record (without the command)."""
        t0 = time.perf_counter()
        results, stats = [], []
        for i, item in enumerate(self.items(spec, n_items)):
            r, s = self._run_item(spec, i, item)
            results.append(r)
            stats.append(s)
        rec = {"key": spec.key, **asdict(spec), "model_file": self.path.name, "model_sha256": self.sha256,
               "score": float(np.mean([r["score"] for r in results])),
               "prompt_tokens": int(np.mean([s["prompt_tokens"] for s in stats])),
               "kv_bytes_allocated": max(s["kv_bytes_allocated"] for s in stats),
               "kv_bytes_full": max(s["kv_bytes_full"] for s in stats),
               "kv_bytes_measured": all(s["kv_bytes_measured"] for s in stats),
               "budget_cells": max(s["budget_cells"] for s in stats),
               "n_ctx": max(s["n_ctx"] for s in stats),
               "compression_events": sum(s["compression_events"] for s in stats),
               "prefill_seconds": sum(s["prefill_seconds"] for s in stats),
               "compression_seconds": sum(s["compression_seconds"] for s in stats),
               "host_tier_bytes": max(s["host_tier_bytes"] for s in stats),
               "recall_seconds": sum(s["recall_seconds"] for s in stats),  # the questions' re-selections
               "recall_steps": sum(s["recall_steps"] for s in stats),  # and the answers' first tokens'
               "recall_step_seconds": sum(s["recall_step_seconds"] for s in stats),  # of the steps that swapped
               "recall_steps_confident": sum(s["recall_steps_confident"] for s in stats),  # kept their decode
               "recall_rows_in": sum(s["recall_rows_in"] for s in stats),
               "seconds": time.perf_counter() - t0, "items": results}
        if spec.task in KL_TASKS:
            rec["mean_kl"] = float(np.mean([r["mean_kl"] for r in results]))
        if spec.task in CHAT_TASKS:
            rec.update({k: float(np.mean([r[k] for r in results])) for k in CHAT_SHARES})
        return rec

    def _run_item(self, spec: Spec, index: int, item: Item) -> tuple[dict, dict]:
        m = self.model
        tokens = m.tokenize(item.prompt)
        # question-aware: the question's tokens, or (continuation) the prompt's own end, as `kvlocal run`
        probe = (None if spec.observation == "agnostic"
                 else m.tokenize(item.question, add_special=False) if item.question else tokens[-32:])
        if item.kind == "continuation":
            n_forced = N_GENERATED if spec.task in GENERATION_TASKS else N_FORCED
            forced = m.tokenize(item.forced, add_special=False)[:n_forced]
            eng = self.engine(spec, len(tokens) + len(forced))
            logits = self._forcing(spec)(eng, tokens, probe, forced)
            k = (spec.task, spec.seed, spec.n_tokens, index)
            if k not in self._reference:
                self._reference[k] = logits if spec.method == "full" else self._full_logits(spec, tokens, forced)
            ref = self._reference[k]
            c = compare_logits(ref, logits)  # KL(full ‖ method) per position, greedy agreement
            result = {"item": item.name, "score": c["top1_agreement"], "mean_kl": c["mean_kl"], "max_kl": c["max_kl"]}
        elif item.kind == "chat":
            eng = self.engine(spec, len(tokens) + self.chat_room(item))
            result = {"item": item.name, **self._score_chat(item, self._chat(eng, item))}
        else:
            eng = self.engine(spec, len(tokens) + item.n_generate)
            eng.read_prompt(tokens, probe)
            reply = m.detokenize(list(eng.generate(item.n_generate)))
            result = {"item": item.name, "score": score(item, reply), "reply": reply, "expected": item.expected}
        s = eng.stats.as_dict()
        s["prompt_tokens"] = len(tokens)
        return result, s

    def chat_room(self, item: Item) -> int:
        """Tokens a chat item takes past its document: the opening, then each question with its turn's headers
        and reply — at least :data:`CHAT_ROOM` (the room ``multiturn``'s records were run with: a ratio budget is
        a share of the document and this room)."""
        turns = sum(len(self.model.tokenize(q, add_special=False)) + TURN_TEMPLATE + item.n_generate
                    for q, _ in item.turns)
        return max(CHAT_ROOM, CHAT_OPENING + turns)

    def _score_chat(self, item: Item, replies: list[str]) -> dict:
        """A chat's figures: the share of turns answered (``score``), confused and missed (:func:`verdict`),
        the share of replies that loop (:func:`loops`, on the reply's tokens), and each turn."""
        turns = [{"question": q, "expected": e, "reply": r, "verdict": verdict(item, e, r),
                  "loop": loops(self.model.tokenize(r, add_special=False))} for r, (q, e) in zip(replies, item.turns)]
        share = shares([t["verdict"] for t in turns])
        return {"score": share["answered"], "confused": share["confused"], "missed": share["missed"],
                "loops": float(np.mean([t["loop"] for t in turns])), "turns": turns}

    @staticmethod
    def _chat(eng: Engine, item: Item) -> list[str]:
        """The document as the first user turn (a short greedy reply), then each question in a turn of its
        own; returns the replies to the questions."""
        session = Turns(eng, Sampler())
        "".join(session.ask(item.document + "\n\nRead this text; I will ask you about it.", max_tokens=8))
        return ["".join(session.ask(q, max_tokens=item.n_generate)) for q, _ in item.turns]

    def _forced_logits(self, eng: Engine, tokens, probe, forced) -> np.ndarray:
        """[len(forced), V]: the next-token logits after the prompt and after each forced token. The forced
        tokens go straight into the context's free cells (the engine leaves chunk + window of them after
        the final compression), so no compression event falls inside the continuation."""
        first = eng.read_prompt(tokens, probe)
        rest = eng.ctx.decode(forced[:-1], range(eng.n_past, eng.n_past + len(forced) - 1), "all")
        return np.concatenate([first[None], rest])

    @staticmethod
    def _generated_logits(eng: Engine, tokens, probe, forced) -> np.ndarray:
        """As :meth:`_forced_logits`, but the forced tokens go through the engine's own generation loop (its
        sampler picks the real text's next token), so the compressions of generation fall inside them."""
        eng.read_prompt(tokens, probe)
        rows = []

        def forcing(logits: np.ndarray) -> int:  # the distribution after the prompt, then after each forced token
            rows.append(logits.copy())
            return forced[len(rows) - 1]

        for _ in eng.generate(len(forced), sampler=forcing, stop_at_eog=False):
            pass
        return np.stack(rows)

    def _full_logits(self, spec: Spec, tokens, forced) -> np.ndarray:
        ref = Spec(spec.model, spec.task, "full", 1.0, "-", spec.seed, spec.n_tokens)
        return self._forcing(spec)(self.engine(ref, len(tokens) + len(forced)), tokens, None, forced)

    def _forcing(self, spec: Spec):
        """How a task's forced tokens go in: through the engine's generation loop (``generation``: its
        compressions fall inside them), or straight into the free cells (``continuation``)."""
        return self._generated_logits if spec.task in GENERATION_TASKS else self._forced_logits


def execute(specs: Iterable[Spec], paths: dict[str, Path], out: Path, command: str, n_threads: int | None,
            n_items: int | None = None, progress=None, runtime: RuntimeSettings | None = None) -> Iterator[dict]:
    """Run the specs not yet in ``out`` (results.jsonl), appending each record as it finishes; yields the
    new records. ``progress(spec, skipped)`` is called before each spec; ``runtime``: how the models load (RPC
    servers)."""
    done = done_keys(out)
    runner = None
    with out.open("a") as f:
        if out.stat().st_size and not out.read_bytes().endswith(b"\n"):
            f.write("\n")  # a line torn by a killed run stays on its own, ignored
        for spec in specs:
            if spec.key in done:
                if progress:
                    progress(spec, True)
                continue
            if progress:
                progress(spec, False)
            if runner is None or runner.name != spec.model:
                runner = Runner(spec.model, paths[spec.model], n_threads, runtime)
            rec = runner.run(spec, n_items)
            rec.update(command=command, n_threads=n_threads,
                       finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            f.write(json.dumps(rec) + "\n")
            f.flush()
            yield rec
