"""The decode's compute buffer at a real model's shape: stock llama.cpp against kvlocal's patched runtime, before and
after a compression event.

    python -m tools.compute_buffer                      # Llama-3-8B's attention shape (random weights), -c 8192
    python -m tools.compute_buffer --shape llama3-8b -c 32768 --cells 16384

Each runtime creates a context of ``-c`` cells on a random-weight GGUF (``ggml_patches/random_gguf.py``) and says
what llama.cpp reserved for the decode's graph (its own log line, "compute buffer size", on both runtimes; the
patched one's ``llama_kvlocal_get_counters`` too). The patched runtime then runs an event on ``--cells`` cells of
random rows — value norms of every cell, merges of 40 members, a compaction to a tenth — decodes a token and says the
decode's buffer again, with the largest buffers kvlocal's graphs took on their own scheduler (given back after each).
Had those graphs run on the decode's scheduler, as before they had one of their own, its buffers would have stayed at
the larger of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


def reserved_bytes(log: str) -> int:
    """The compute buffers llama.cpp's log says it reserved at context creation, over its backends."""
    return int(sum(float(m) for m in re.findall(r"compute buffer size =\s*([\d.]+) MiB", log)) * MIB)


def child(model_path: str, n_ctx: int, cells: int, event: bool) -> dict:
    """In a process whose stderr the parent reads: the context, and on the patched runtime the event."""
    import numpy as np

    from kvlocal.runtime import Context, Model
    from kvlocal.runtime.seqstate import SeqKV
    from kvlocal.runtime.state import read_seq, write_seq

    m = Model(model_path)
    ctx = Context(m, n_ctx=n_ctx, n_batch=512, n_threads=2)
    out = {"counters_at_creation": ctx.counters()}
    if not event:
        return out
    ctx.decode([1, 2], [0, 1], "none")
    like = read_seq(ctx)
    rng = np.random.default_rng(0)
    n_layer, hkv, d, hq = m.n_layer, m.n_head_kv, m.arch.head_dim_k, m.n_head
    rows = lambda: [rng.standard_normal((cells, hkv, d)).astype(np.float16) for _ in range(n_layer)]  # noqa: E731
    write_seq(ctx, SeqKV(pos=np.arange(cells, dtype=np.int32), k=rows(), v=rows(), v_trans=like.v_trans,
                         k_type=like.k_type, v_type=like.v_type))
    t0 = time.perf_counter()
    q = rng.standard_normal((n_layer, hq, 8, d)).astype(np.float32)
    ctx.score(q, d ** -0.5, vnorm_cells=np.arange(cells))
    groups = np.stack([rng.permutation(cells)[:64 * 40].reshape(64, 40) for _ in range(n_layer)]).reshape(-1, 40)
    w = np.full(groups.shape, 1 / 40)
    ctx.merge(np.full(n_layer, 64), groups, rng.integers(0, hkv, len(groups)), w, w)
    keep = cells // 10
    ctx.compact(np.tile(np.arange(keep, dtype=np.int32), (n_layer, hkv, 1)), np.arange(keep))
    out["event_seconds"] = time.perf_counter() - t0
    ctx.decode([3], [keep], "last")
    out["counters_after_event"] = ctx.counters()
    return out


def run(runtime: Path | None, model_path: Path, n_ctx: int, cells: int) -> dict:
    env = dict(os.environ, KVLOCAL_VERBOSE="1")
    if runtime is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(runtime), env.get("PYTHONPATH", "")])
    code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r}); from tools.compute_buffer import child; "
            f"print(json.dumps(child({str(model_path)!r}, {n_ctx}, {cells}, {runtime is None})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"the {'stock' if runtime else 'patched'} run failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["reserved_by_log"] = reserved_bytes(r.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b-attn", help="a random_gguf.py shape (default: llama3-8b-attn)")
    ap.add_argument("-c", "--ctx-size", type=int, default=8192)
    ap.add_argument("--cells", type=int, default=8192, help="cells the event scores (at most -c)")
    ap.add_argument("--stock", type=Path, help="the stock runtime's folder (default: the test suite's)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "ggml_patches"))
    import random_gguf
    from build import cache_dir

    stock = args.stock or cache_dir() / "stock-runtime"
    if not (stock / "llama_cpp").is_dir():
        sys.exit(f"no stock runtime in {stock}: run `python ggml_patches/build.py --stock {stock}`")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{args.shape}.gguf"
        random_gguf.write(str(path), args.shape)
        cells = min(args.cells, args.ctx_size - 256)
        s, p = run(stock, path, args.ctx_size, cells), run(None, path, args.ctx_size, cells)
    before, after = p["counters_at_creation"], p["counters_after_event"]
    print(f"{args.shape}, -c {args.ctx_size:,}, F16 cache; an event on {cells:,} cells took {p['event_seconds']:.1f} s")
    print(f"{'decode compute buffer, stock (its log)':58}{s['reserved_by_log'] / MIB:10.1f} MiB")
    print(f"{'decode compute buffer, patched (its log)':58}{p['reserved_by_log'] / MIB:10.1f} MiB")
    print(f"{'decode compute buffer, patched, at creation (counters)':58}{before['compute_bytes'] / MIB:10.1f} MiB")
    print(f"{'decode compute buffer, patched, after the event':58}{after['compute_bytes'] / MIB:10.1f} MiB")
    print(f"{'largest buffers of a kvlocal graph (own scheduler, freed)':58}{after['kv_compute_peak'] / MIB:10.1f} MiB")
    print(f"{'  the decode buffer had they run on its scheduler':58}"
          f"{max(before['compute_bytes'], after['kv_compute_peak']) / MIB:10.1f} MiB  (the larger of the two)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
