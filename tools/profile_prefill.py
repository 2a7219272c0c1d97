"""Where a prompt's compression events spend their time, part by part, with the page faults each took.

    python -m tools.profile_prefill smollm2-135m                  # 8,127 tokens at the chat's defaults
    python -m tools.profile_prefill qwen2.5-coder-0.5b --backend native

Reads ``--tokens`` of ``kvlocal bench``'s text, its last 32 tokens the probe, as ``kvlocal bench --overhead``
runs the chat's defaults (CriticalKV at budget 0.1, the recall tier, the probe decoded every 4 events, events
inside the prompt leaving 3/4 of the budget; ``--no-recall`` for the cache alone). The engine's, the backend's,
the state backend's reads and writes (in place: ``view.*``; through the state blob, ``KVLOCAL_STATE_IO=blob``:
``get_blob`` ...) and the tier's functions are wrapped by a wall clock and the process's minor page-fault
count (``tools.parts``). Parts nest: the compressor's ``compress`` holds its ``read``, ``plan`` and ``apply``;
``apply`` the backend's ``apply``, ``evicted`` and ``store_evicted``; the probe is decoded inside the observer's
``decode_chunk``, with a chunk. Prints how long the engine took to make (``EngineStats.setup_seconds``: its one-time work, W_O's factors), the
engine's own breakdown (``EngineStats.compression_breakdown``, what ``kvlocal bench`` reports), then per part the
seconds over the prompt, the calls and the faults. Figures of one run on one machine: compare parts with each
other, or two runs made side by side.
"""

from __future__ import annotations

import argparse
import time

from kvlocal.cli.bench import long_text, read_prompt
from kvlocal.compress.plan import Plan
from kvlocal.engine import Engine
from kvlocal.engine.compressor import Compressor
from kvlocal.engine.observer import Observer
from kvlocal.models import resolve
from kvlocal.recall.tier import HostTier
from kvlocal.runtime import Model
from kvlocal.runtime.hostview import HostView
import kvlocal.engine.compressor as compressor_module
import kvlocal.runtime.state as state_module
from tools.parts import Parts

# the engine's parts' methods, by the class that has them
ENGINE_PARTS = ((Observer, ("decode_chunk",)), (Compressor, ("compress", "read", "plan", "apply")))
# module functions, wrapped in the module that looks them up
MODULE_PARTS = ((compressor_module, ("evicted", "store_evicted")),
                (state_module, ("get_blob", "parse_blob", "build_blob", "set_blob")))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=8127)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--backend", default="state", choices=["state", "native"])
    ap.add_argument("--no-recall", action="store_true", help="the cache alone: no recall tier (events leave the budget)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args(argv)
    model = Model(resolve(a.model))
    tokens = long_text(model, a.tokens)
    recall = not a.no_recall
    eng = Engine(model, a.budget, "criticalkv", max_tokens=a.tokens + 64, n_threads=a.threads, backend=a.backend,
                 recall=recall, observe_every=4, low_water=0.75 if recall else 1.0)
    parts = Parts()
    for owner, names in ENGINE_PARTS + MODULE_PARTS:
        parts.wrap_each(owner, names)
    parts.wrap_each(type(eng.kv), ("read", "apply", "take_rows"), "kv.")
    parts.wrap_each(HostView, ("read", "compact", "write"), "view.")
    parts.wrap_each(HostTier, ("reserve", "add"), "tier ")
    parts.wrap(Plan, "materialize")
    t0 = time.perf_counter()
    read_prompt(eng, tokens, tokens[-32:])  # as kvlocal run reads it
    wall = time.perf_counter() - t0
    s = eng.stats
    share = s.compression_seconds / s.prefill_seconds
    print(f"{model.path.name} · {len(tokens):,} tokens · {eng.kv.name} backend{' in place' if getattr(eng.kv, 'in_place', False) else ''} · recall {'on' if recall else 'off'} · "
          f"engine made in {eng.stats.setup_seconds:.2f} s · prefill {wall:.1f} s · "
          f"compression {s.compression_seconds:.2f} s ({share:.1%}) in {s.compression_events} "
          f"events: " + ", ".join(f"{k} {v:.2f}" for k, v in s.compression_breakdown.items())
          + (f" · then the question's re-selection {s.recall_seconds:.2f} s" if recall else ""))
    print(f"{'part':<20} {'seconds':>8} {'calls':>6} {'faults':>9}")
    for label in parts.by_time():
        print(f"{label:<20} {parts.seconds[label]:>8.3f} {parts.calls[label]:>6} {parts.faults[label]:>9,}")


if __name__ == "__main__":
    main()
