"""Where an answer step's swap spends its time: the recall tier's re-selection, part by part.

    python -m tools.profile_recall qwen2.5-coder-0.5b --tokens 4096
    python -m tools.profile_recall smollm2-135m --tokens 4096 --backend native --step-confidence 0.9

Reads ``--tokens`` of ``kvlocal bench``'s text with recall on (CriticalKV, budget 0.1), asks its question, then
decodes ``--steps`` answer tokens, each re-selecting the cache with its own query (``--step-confidence 1``,
the default here: every step swaps, so every step is a sample). Each part of a swap is timed by wrapping the
engine's and the tier's functions with a wall clock and the process's page-fault count (``tools.parts``); the
table gives milliseconds and minor page faults per swap (parts nest: the re-selection's ``swap`` holds
``with_candidates`` and the compressor's ``plan`` and ``apply``; the layers are planned on threads, and
``attention_keep``, the plan's kernel, adds up their times; a last line says how many rows the plan scored a swap).
With ``--step-confidence`` below 1, the re-selection's ``step`` and the observer's ``observe`` also hold the decodes
of the steps that kept theirs (divided by the swaps all the same). Figures of one run on one machine: compare parts with each other, or two runs made side by side.
"""

from __future__ import annotations

import argparse
import threading

from kvlocal.cli.bench import QUESTION, long_text
from kvlocal import kernels
from kvlocal.engine import Engine
from kvlocal.engine.compressor import Compressor
from kvlocal.engine.observer import Observer
from kvlocal.models import resolve
from kvlocal.recall import Reselection
from kvlocal.recall.tier import HeadStore, HostTier
from kvlocal.runtime import Model
from tools.parts import Parts
import kvlocal.engine.compressor as compressor_module
import kvlocal.recall.reselect as reselect_module

# the engine's parts' methods, by the class that has them
ENGINE_PARTS = ((Reselection, ("step", "swap")), (Observer, ("observe",)), (Compressor, ("read", "plan", "apply")))
# the module-level functions a swap calls, by the module that calls them (wrapped where they are looked up)
MODULE_PARTS = ((reselect_module, ("choose_candidates", "with_candidates")),
                (compressor_module, ("evicted", "store_evicted")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--backend", default="state", choices=["state", "native"])
    ap.add_argument("--step-confidence", type=float, default=1.0)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    model = Model(resolve(args.model))
    question = model.tokenize(QUESTION, add_special=False)
    eng = Engine(model, 0.1, "criticalkv", max_tokens=args.tokens + len(question) + args.steps + 8,
                 n_threads=args.threads, recall=True, backend=args.backend,
                 recall_step_confidence=args.step_confidence)
    eng.prefill(long_text(model, args.tokens), reselect_after=True)  # a document, as a chat reads it
    eng.append(question, probe=question, question=True)

    parts = Parts()
    for owner, names in ENGINE_PARTS + MODULE_PARTS:
        parts.wrap_each(owner, names)
    parts.wrap_each(type(eng.kv), ("extend", "apply", "take_rows"), "kv.")
    parts.wrap(HeadStore, "rows_into", "tier rows_into")
    parts.wrap(HostTier, "add", "tier add")
    parts.wrap(kernels, "attention_keep", "attention_keep")  # on the planning threads: their times added up
    scored = count_rows_scored(type(eng.scorer))
    for _ in eng.generate(args.steps, stop_at_eog=False):
        pass

    s = eng.stats
    swaps = max(1, s.recall_steps - s.recall_steps_confident)
    print(f"{model.path.name} · {args.tokens:,} tokens read · {args.backend} backend · {s.recall_steps} steps, "
          f"{swaps} swapped · prefill {s.prefill_seconds:.1f} s · swaps {s.recall_step_seconds:.2f} s")
    print(f"{'part':<20} {'ms/swap':>8} {'faults/swap':>11} {'calls':>6}")
    for label in parts.by_time():
        print(f"{label:<20} {parts.seconds[label] * 1000 / swaps:>8.1f} {parts.faults[label] / swaps:>11,.0f} "
              f"{parts.calls[label]:>6}")
    rows = scored[0] / swaps
    print(f"the plan scores {rows:,.0f} rows a swap (the device's cells and the candidates, every layer and KV head): "
          f"attention_keep {parts.seconds['attention_keep'] * 1e9 / max(1, scored[0]):.0f} ns a row, its threads' "
          f"times added up")


def count_rows_scored(scorer_class) -> list[int]:
    """Count the rows (live or empty) of every layer ``scorer_class`` plans from now on: ``[rows]``, kept up to date."""
    rows, lock, plan_layer = [0], threading.Lock(), scorer_class.plan_layer

    def counted(self, layer, budget):
        with lock:
            rows[0] += layer.pos_h.size
        return plan_layer(self, layer, budget)

    scorer_class.plan_layer = counted
    return rows


if __name__ == "__main__":
    main()
