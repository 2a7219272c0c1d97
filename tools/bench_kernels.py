"""Time the scoring of one compression event, step by step, native kernels against numpy.

    python -m tools.bench_kernels                 # SmolLM2-135M shapes: 30 layers, 9/3 heads, d 64, D 576
    python -m tools.bench_kernels --n 4096 --budget 2048 --simd generic
    python -m tools.bench_kernels --plan --n 1500 --budget 750   # one event's plan_layers, every method
    python -m tools.bench_kernels --layers 24 --n 2096 --budget 416 --heads 14 2 --hidden 896 --window 1 \
        --known-norms 0.999                      # a recall swap on Qwen2.5-Coder-0.5B at 4K

Random inputs of a real model's shapes (the timings do not depend on the values). Each step is timed
per layer (median over layers and repeats) and for all layers (median over repeats); "numpy" replaces
the two scoring kernels (:func:`kvlocal.kernels.window_votes`, :func:`kvlocal.kernels.vnorm`) by
their readable numpy definitions (:mod:`kvlocal.compress.numpy_kernels`) and the F16 cache's conversion
(:func:`kvlocal.kernels.f16_heads_f32`) by numpy's; pooling and top-k stay native in both. The "event"
rows' C column is ``keep()`` in one call (:func:`kvlocal.kernels.attention_keep`), except the last
row's: the scorers' numpy steps around the C kernels, what the one call replaces. The two alternate layer by layer, so the ratio holds on a busy machine. numpy's BLAS may use
several threads: set ``OPENBLAS_NUM_THREADS=1`` on a machine shared with other work.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import numpy as np

from kvlocal import kernels
from kvlocal.compress import snapkv
from kvlocal.compress import make_scorer, numpy_kernels
from kvlocal.compress.base import LayerInputs, Scorer, native_scoring, plan_layers, select
from kvlocal.compress.criticalkv import VALUE_NORMS, CriticalKV
from kvlocal.compress.snapkv import SnapKV
from kvlocal.engine import VALUE_NORM


def make_layers(n_layer: int, n: int, n_head: int, n_kv: int, d: int, big_d: int, w: int, seed: int = 0,
                known: float = 0.0):
    """Random layers; ``known``: the share of cells whose projected value norm is already known (as the engine
    carries them between events: only the new rows' are computed), 0 = none given."""
    rng = np.random.default_rng(seed)
    pos = rng.permutation(n)  # cells in shuffled order, as after evictions
    q_pos = np.arange(n - w, n)
    wo = (rng.standard_normal((big_d, n_head * d)) * 0.05).astype(np.float32)
    layers = []
    for il in range(n_layer):
        v = rng.standard_normal((n_kv, n, d), dtype=np.float32)
        vnorm = None
        if known > 0:
            group = n_head // n_kv
            vnorm = np.stack([kernels.vnorm(v[g], wo, g * group, group) for g in range(n_kv)])
            vnorm[rng.random(vnorm.shape) >= known] = np.nan
        layers.append(LayerInputs(k=rng.standard_normal((n_kv, n, d), dtype=np.float32), v=v, pos=pos,
                                  q=rng.standard_normal((n_head, w, d), dtype=np.float32), q_pos=q_pos, wo=wo,
                                  layer=il, vnorm=vnorm))
    return layers


def fresh(layer: LayerInputs) -> LayerInputs:
    """``layer`` with its own copy of the known norms (a CriticalKV keep writes the ones it computes)."""
    return layer if layer.vnorm is None else dataclasses.replace(layer, vnorm=layer.vnorm.copy())


def numpy_f16_heads(x: np.ndarray) -> np.ndarray:
    """numpy's conversion of half-float rows [H, n, d] (a transposed view of the cells) to float32."""
    return np.ascontiguousarray(x, dtype=np.float32)


@contextlib.contextmanager
def numpy_definitions():
    """Swap the two scoring kernels and the F16 conversion for their numpy definitions, and run keep() as the
    scorers' numpy steps (not :func:`kvlocal.compress.snapkv.fused_keep`)."""
    saved = kernels.window_votes, kernels.vnorm, kernels.f16_heads_f32
    kernels.window_votes, kernels.vnorm = numpy_kernels.window_votes, numpy_kernels.vnorm
    kernels.f16_heads_f32 = numpy_f16_heads
    snapkv.FUSED = False
    try:
        yield
    finally:
        kernels.window_votes, kernels.vnorm, kernels.f16_heads_f32 = saved
        snapkv.FUSED = True


def timed(fn, layers, repeat: int, clock=time.perf_counter) -> dict[str, tuple[float, float]]:
    """{"C": (median ms per layer, median ms for all layers), "numpy": (...)} of ``fn(layer)``.

    The two variants alternate layer by layer, so that both see the same load on a shared machine.
    """
    per_layer = {"C": [], "numpy": []}
    totals = {"C": [], "numpy": []}
    for _ in range(repeat):
        total = {"C": 0.0, "numpy": 0.0}
        for layer in layers:
            for variant in ("C", "numpy"):
                with numpy_definitions() if variant == "numpy" else contextlib.nullcontext():
                    t0 = clock()
                    fn(layer)
                    dt = clock() - t0
                per_layer[variant].append(dt)
                total[variant] += dt
        for variant in total:
            totals[variant].append(total[variant])
    return {v: (1e3 * float(np.median(per_layer[v])), 1e3 * float(np.median(totals[v]))) for v in per_layer}


def steps(budget: int, value_norm: str = VALUE_NORM):
    snap, crit = SnapKV(), CriticalKV(SnapKV(), value_norm=value_norm)

    def votes(layer):
        kernels.window_votes(layer.q[:, -snap.window_size :], layer.q_pos[-snap.window_size :], layer.k, layer.pos_h)

    def vnorm_all(layer):
        group = layer.n_head // layer.n_kv
        matrix, p = crit.norm_weights(layer)
        for g in range(layer.n_kv):
            kernels.vnorm(layer.v[g], matrix, g * group, group, p=p)

    def stage2_rows(layer, scores):
        b = np.full(layer.n_kv, min(budget, layer.n))
        return crit.rerank(fresh(layer), scores, b)

    cache, cells = {}, {}

    def f16_keys(layer):  # an F16 cache's cells [n, Hkv, d] as the scorers take them, [Hkv, n, d] float32
        if layer.layer not in cells:
            cells[layer.layer] = np.ascontiguousarray(layer.k.transpose(1, 0, 2), dtype=np.float16)
        kernels.f16_heads_f32(cells[layer.layer].transpose(1, 0, 2))

    def score(layer):
        cache[layer.layer] = snap.score(layer)

    return [
        ("F16 cells -> float32 keys [Hkv, n, d]", f16_keys),
        ("window votes [Hq, n]", votes),
        ("SnapKV score (votes + pool + group mean)", score),
        ("select: top-k + sort by position", lambda layer: select(cache[layer.layer], budget, layer.pos)),
        (f"projected value norms ({value_norm.upper()}), all cells", vnorm_all),
        ("CriticalKV rerank (stage 1 + norms of stage-2 cells)", lambda layer: stage2_rows(layer, cache[layer.layer])),
        ("event: SnapKV keep", lambda layer: snap.keep(layer, budget)),
        ("event: CriticalKV(SnapKV) keep", lambda layer: crit.keep(fresh(layer), budget)),
        ("event: CriticalKV(SnapKV) keep, numpy steps", lambda layer: Scorer.keep(crit, fresh(layer), budget)),
    ]


PLAN_METHODS = ("snapkv", "criticalkv", "adakv", "criticalkv+adakv", "kvslimmer", "meanmerge", "criticalkv+kvslimmer")


def plan_times(layers, budget: int, repeat: int, clock=time.perf_counter) -> None:
    """Print, per method, the median time of one event's ``plan_layers`` over all layers, and its slots.

    CriticalKV computes every projected value norm it needs (the engine carries them between events).
    """
    print(f"{'method':24s} {'plan ms (all layers)':>21s} {'ms/layer':>9s} {'slots B':>8s}")
    for name in PLAN_METHODS:
        scorer, times = make_scorer(name), []
        for _ in range(repeat):
            t0 = clock()
            plan = plan_layers(scorer, layers, budget)
            times.append(clock() - t0)
        ms = 1e3 * float(np.median(times))
        print(f"{name:24s} {ms:21.1f} {ms / len(layers):9.2f} {plan.n_slots:8d}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--n", type=int, default=1400, help="cells in the cache at the event")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--heads", type=int, nargs=2, default=(9, 3), metavar=("HQ", "HKV"))
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--known-norms", type=float, default=0.0, metavar="SHARE",
                    help="share of cells whose value norm is known (a recall swap: 0.999; default 0: every one computed)")
    ap.add_argument("--value-norm", choices=VALUE_NORMS, default=VALUE_NORM,
                    help="CriticalKV's value norms: l2 (through W_O's d x d factor) or l1 (the paper's, through W_O); "
                         "default: the engine's, %(default)s")
    ap.add_argument("--simd", choices=kernels.SIMD_LEVELS, help="cap the kernels' instruction set")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (steadier on a shared machine; counts every BLAS thread)")
    ap.add_argument("--plan", action="store_true", help="time one event's plan_layers for every method instead")
    args = ap.parse_args(argv)
    if args.simd:
        kernels.simd_level(args.simd)
    layers = make_layers(args.layers, args.n, args.heads[0], args.heads[1], args.head_dim, args.hidden, args.window,
                         known=args.known_norms)
    print(f"{args.layers} layers, n={args.n}, budget={args.budget}, Hq/Hkv={args.heads[0]}/{args.heads[1]}, "
          f"d={args.head_dim}, D={args.hidden}, w={args.window}, known norms {args.known_norms:g}, "
          f"{args.value_norm.upper()} value norms; "
          f"kernels: {kernels.simd_level()}; {args.clock} clock")
    if not native_scoring():
        print("(at this level the scorers use numpy: only the two kernel rows compare C with numpy)")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    if args.plan:
        plan_times(layers, args.budget, args.repeat, clock)
        return
    print(f"{'step':56s} {'C ms/layer':>11s} {'numpy ms/layer':>15s} {'C all':>9s} {'numpy all':>10s} {'speed-up':>9s}")
    for name, fn in steps(args.budget, args.value_norm):
        t = timed(fn, layers, args.repeat, clock)
        (c_layer, c_all), (n_layer, n_all) = t["C"], t["numpy"]
        print(f"{name:56s} {c_layer:11.2f} {n_layer:15.2f} {c_all:9.1f} {n_all:10.1f} {n_layer / c_layer:8.1f}x")


if __name__ == "__main__":
    main()
