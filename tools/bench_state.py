"""Time the state KV backend's round trip at a compression event, on a real model's cache: the cells read
(``StateBackend.read``) and a plan's rows written back (``StateBackend.apply``), in place where the cache lies
(``--io view``: numpy views of llama.cpp's memory, the rows written into the first cells) and through llama.cpp's
sequence state (``--io blob``: copied out and parsed, the kept rows gathered into a blob llama.cpp loads).

    python -m tools.bench_state                                   # SmolLM2-135M: 1,400 cells, 1,024 kept
    python -m tools.bench_state qwen2.5-coder-0.5b --cells 1400 --keep 1024
    python -m tools.bench_state --io view blob view blob          # both ways, alternating, in one run

The defaults are an 8K prefill's event on SmolLM2 at budget 0.1 (a chunk's cells on top of the budget's). A context
holds ``--cells`` tokens of ``kvlocal bench``'s text; each repeat reads them, keeps ``--keep`` random rows of every
layer and KV head (a :class:`~kvlocal.compress.Plan`), applies it, then loads the cells as they were (not timed).
Prints milliseconds per event: read, apply and both, the median over ``--repeat``. Only the backend's public methods
are called, so the script times any commit's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvlocal.cli.bench import long_text
from kvlocal.compress import Plan
from kvlocal.models import resolve
from kvlocal.backends import RowRecord, StateBackend
from kvlocal.runtime import CacheBasis, Context, Model


def run(model: Model, cells: int, keep: int, repeat: int, threads: int, flash_attn: bool = False, seed: int = 0,
        io: str = "view"):
    """Median seconds of (read, apply) over ``repeat`` events on a fresh context of ``cells`` tokens; ``io``: in place
    (``view``, where the runtime can) or through the state blob (``blob``)."""
    arch = model.arch
    ctx = Context(model, n_ctx=cells + 64, n_threads=threads, flash_attn=flash_attn)
    tokens = long_text(model, cells)[:cells]
    for i in range(0, cells, 512):
        ctx.decode(tokens[i:i + 512], logits="none")
    layers = arch.full_layers
    basis = CacheBasis.for_cache(None, None, arch.head_dim_k, arch.head_dim_v)
    kv = StateBackend(ctx, layers, arch.n_head_kv, arch.head_dim_k, basis=basis, in_place=io == "view")
    cells_then = kv.save()
    rng = np.random.default_rng(seed)
    reads, applies = [], []
    for _ in range(repeat):
        kv.record = RowRecord.empty(len(layers), arch.n_head_kv)
        t0 = time.perf_counter()
        read = kv.read()
        t1 = time.perf_counter()
        kept = np.sort(np.argsort(rng.random((len(layers), arch.n_head_kv, read.n)), axis=2)[:, :, :keep], axis=2)
        plan = Plan(kept, np.take_along_axis(read.true, kept, axis=2))
        t2 = time.perf_counter()
        kv.apply(read, plan)
        t3 = time.perf_counter()
        reads.append(t1 - t0)
        applies.append(t3 - t2)
        kv.load(cells_then)
    ctx.close()
    return float(np.median(reads)), float(np.median(applies))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--cells", type=int, default=1400, help="cells the cache holds at the event")
    ap.add_argument("--keep", type=int, default=1024, help="rows each layer and KV head keeps")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--flash-attn", action="store_true", help="V stored as rows (flash attention), not transposed")
    ap.add_argument("--io", nargs="+", choices=["view", "blob"], default=["view"],
                    help="in place and/or through the state blob, one run each in this order (default: view)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if not 0 < a.keep <= a.cells:
        ap.error("--keep: give a number of rows between 1 and --cells")
    model = Model(resolve(a.model))
    for io in a.io:
        read, apply = run(model, a.cells, a.keep, a.repeat, a.threads, a.flash_attn, io=io)
        print(f"{model.path.name} · {a.cells:,} cells, {a.keep:,} kept per layer and KV head · V "
              f"{'as rows' if a.flash_attn else 'transposed'} · {io}: read {read * 1e3:.2f} ms, apply "
              f"{apply * 1e3:.2f} ms, round trip {(read + apply) * 1e3:.2f} ms an event (median of {a.repeat})")


if __name__ == "__main__":
    main()
