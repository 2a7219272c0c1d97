"""Time the W_O work CriticalKV's L2 value norms ask of each compression event, on a model's shapes.

    python -m tools.bench_wo                          # an 8B Llama's: 32 layers, W_O 4096 x 4096, 32 query heads
    python -m tools.bench_wo --layers 30 --dim 576 --heads 9      # SmolLM2-135M's

Writes a GGUF of ``--layers`` random Q4_0 ``attn_output`` tensors (``--dim`` square) to a temporary folder, then reads
every layer's factor for L2 norms as an event does, ``--events`` times, two ways: through W_O
(``OutputProjections[il]``, the W_O cache of ``--cache-mib`` (the first layers that fit), then ``shared_l2_factor``, which
keeps a factor as long as its W_O array lives: what the state backend did before the factors were kept), and
``OutputProjections.l2_factor`` (each layer's factor kept: what it does now). Prints seconds per event. The timings do
not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def write_gguf(path: Path, layers: int, dim: int, seed: int = 0) -> None:
    import gguf
    from gguf import quants

    w = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(seed)
    for il in range(layers):
        q = quants.quantize((rng.standard_normal((dim, dim)) * 0.02).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
        w.add_tensor(f"blk.{il}.attn_output.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv=None) -> None:
    from kvlocal.compress.criticalkv import shared_l2_factor
    from kvlocal.backends.weights import OutputProjections

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=4096, help="the model's width: W_O is dim x dim")
    ap.add_argument("--heads", type=int, default=32, help="query heads")
    ap.add_argument("--events", type=int, default=3)
    ap.add_argument("--cache-mib", type=float, default=256, help="the W_O cache's bound (KVLOCAL_WO_CACHE_MIB)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "wo.gguf"
        write_gguf(path, a.layers, a.dim)
        bound = int(a.cache_mib * 2**20)
        print(f"{a.layers} layers, W_O {a.dim} x {a.dim} Q4_0, {a.heads} query heads, W_O cache {a.cache_mib:g} MiB "
              f"({a.layers * a.dim * a.dim * 4 / 2**20:,.0f} MiB of float32 W_O): seconds an event")
        ways = {"through W_O (shared_l2_factor)": lambda wo, il: shared_l2_factor(wo[il], a.heads),
                "factors kept (OutputProjections.l2_factor)": lambda wo, il: wo.l2_factor(il, a.heads)}
        for name, factor in ways.items():
            wo = OutputProjections(str(path), max_bytes=bound)
            times = []
            for _ in range(a.events):
                t0 = time.perf_counter()
                for il in range(a.layers):
                    factor(wo, il)
                times.append(time.perf_counter() - t0)
            print(f"  {name:44} " + "  ".join(f"{t:6.2f}" for t in times))


if __name__ == "__main__":
    main()
