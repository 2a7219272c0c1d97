#!/usr/bin/env python3
"""The checks of ggml_patches/gpu_check.sh that need Python, each a subcommand whose exit code is its verdict.

    gpu_steps.py backend-ops LOG     # test-backend-ops' attention-bias cases: any not supported but ALiBi's fails
    gpu_steps.py sched MODEL         # a compaction, a score, a merge and a biased decode: ops off the cache's device
    gpu_steps.py bias DIR            # the bias end to end in llama at head sizes 64 and 128: -ngl 99 against -ngl 0
    gpu_steps.py bench JSON          # `kvlocal bench --json`'s figures, backend transfers per event where it has them

On a machine without a GPU every check runs on the CPU (tests/patches/test_gpu_check.py): the verdicts then hold trivially
(one device), and what is checked is that each step runs and reads what it parses.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# a test-backend-ops case line: "  FLASH_ATTN_EXT(hsk=128,...,max_bias=8.000000,...,bias=1): not supported [CUDA0]"
CASE = re.compile(r"^\s+FLASH_ATTN_EXT\((?P<params>[^)]*bias=1[^)]*)\): (?P<status>.*)$")
# ggml_backend_sched's assignments with GGML_SCHED_DEBUG=2, a node and its sources:
# "node #  0 (  GET_ROWS):   embd (  11K) [  CPU    ] use=2,c=1:   token_embd.weight ( 144K) [  CPU    ] ..."
NODE = re.compile(r"node #\s*\d+ \(\s*(?P<op>[^)]*)\):\s+(?P<name>.+?) \(\s*[^)]*\) \[\s*(?P<backend>\S+)\s(?P<srcs>.*)$",
                  re.M)
SPLIT = re.compile(r"## SPLIT #\d+: (?P<backend>\S+)")
# llama.cpp keeps the token embeddings in host memory with every layer offloaded: their lookup runs on the CPU
HOST_SOURCE = "token_embd.weight"


def backend_ops(log: str) -> int:
    """Count test-backend-ops' attention-bias cases by status; fail on a failed case, on a case not supported that is
    not ALiBi's (the one combination patch 0005 leaves to the CPU), or on none at all."""
    counts: dict[str, int] = {}
    unsupported = []
    for line in log.splitlines():
        m = CASE.match(line)
        if not m:
            continue
        status = re.sub(r"\x1b\[[0-9;]*m", "", m["status"]).strip()  # without its colours
        alibi = not re.search(r"max_bias=0\.0+(,|$)", m["params"])
        key = ("failed" if "FAIL" in status else "ok" if status.endswith("OK") else
               ("not supported, ALiBi" if alibi else "not supported") if status.startswith("not supported") else "other")
        counts[key] = counts.get(key, 0) + 1
        if key == "not supported":
            unsupported.append(m["params"])
    print("attention-bias cases: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) if counts else
          "attention-bias cases: none found in the log")
    for params in unsupported:
        print(f"  not supported (not ALiBi): {params}")
    bad = not counts or counts.get("failed") or unsupported or counts.get("other")
    return 1 if bad else 0


def assignments(text: str) -> tuple[dict[str, list[str]], list[str]]:
    """The scheduler's debug output: nodes by backend (``op name`` each, without the token embeddings' lookup, which
    llama.cpp keeps on the CPU) and the backends of its splits, in order."""
    nodes: dict[str, list[str]] = {}
    for m in NODE.finditer(text):
        backend = m["backend"] + (" (token lookup)" if HOST_SOURCE in m["srcs"] else "")
        nodes.setdefault(backend, []).append(f"{m['op'].strip()} {m['name'].strip()}")
    return nodes, [m["backend"] for m in SPLIT.finditer(text)]


class SchedLog:
    """llama.cpp's log, kept (GGML_SCHED_DEBUG's assignments are DEBUG lines): ``take()`` returns what came since
    the last take."""

    def __init__(self):
        from kvlocal.runtime.library import llama_lib

        lib = llama_lib()  # kvlocal's own log callback first, then this one in its place
        self.parts: list[bytes] = []
        self._cb = lib.llama_log_callback(lambda level, text, user: self.parts.append(text))
        lib.llama_log_set(self._cb, ctypes.c_void_p(0))

    def take(self) -> str:
        text = b"".join(self.parts).decode(errors="replace")
        self.parts.clear()
        return text


def sched(model_path: str, n_gpu_layers: int) -> int:
    """Run a compaction, a score, a merge and a biased decode on a filled cache with every layer offloaded and
    report where the scheduler put each graph's nodes. Fails where a node runs off the cache's device (the GPU when
    the runtime has one) other than llama.cpp's own token lookup, or where no assignment was read."""
    if os.environ.get("GGML_SCHED_DEBUG") != "2":
        print("sched: set GGML_SCHED_DEBUG=2 (the scheduler reads it when a context is made)", file=sys.stderr)
        return 2
    from kvlocal.eval.tasks import sample_text
    from kvlocal.runtime import Context, Model
    from kvlocal.runtime.library import local_gpu

    log = SchedLog()
    model = Model(model_path, n_gpu_layers=n_gpu_layers)
    device = "GPU" if local_gpu() and n_gpu_layers else "CPU"  # (an RPC build "supports offload" with no GPU)
    ctx = Context(model, n_ctx=1024, n_batch=512, flash_attn=True)
    tokens = (model.tokenize(sample_text()) * 4)[:600]
    ctx.decode(tokens, range(len(tokens)), "none")
    a, rng = model.arch, np.random.default_rng(0)
    n_layer, hkv, n = len(a.full_layers), model.n_head_kv, len(ctx.cells()[0])
    q = rng.standard_normal((n_layer, model.n_head, 8, a.head_dim_k)).astype(np.float32)
    merges = [rng.permutation(n)[:12].reshape(4, 3) for _ in range(n_layer)]
    kept = n // 2
    src = np.stack([np.stack([np.sort(rng.choice(n, kept, replace=False)) for _ in range(hkv)]) for _ in range(n_layer)])

    def biased_decode():
        for il in a.full_layers:
            ctx.set_bias(il, rng.uniform(-2, 2, (hkv, kept)).astype(np.float32))
        log.take()  # the decode's graph only
        ctx.decode(tokens[:1], [kept], "last")

    ops = {
        "score": lambda: ctx.score(q, 1 / math.sqrt(a.head_dim_k), None, np.arange(min(n, 64))),
        "merge": lambda: ctx.merge(np.full(n_layer, 4), np.concatenate(merges), np.arange(4 * n_layer) % hkv,
                                   np.ones((4 * n_layer, 3)), np.full((4 * n_layer, 3), 1 / 3)),
        "compaction": lambda: ctx.compact(src, np.arange(kept)),
        "biased decode": biased_decode,
    }
    failed = 0
    log.take()
    print(f"where the scheduler put each graph's nodes ({device} cache, {n} cells, {model.path.name})")
    for name, run in ops.items():
        run()
        nodes, splits = assignments(log.take())
        total = sum(len(v) for v in nodes.values())
        off = [node for backend, v in nodes.items() if (backend == "CPU") != (device == "CPU")  # the token lookup apart
               and not backend.endswith("(token lookup)") for node in v]
        print(f"  {name:14} {total:5} nodes, {len(splits)} splits ({' '.join(splits)}): "
              + ", ".join(f"{len(v)} on {b}" for b, v in sorted(nodes.items())))
        for node in off[:20]:
            print(f"    off the {device}: {node}")
        if not total or off:
            failed = 1
            print(f"  !! {name}: " + ("no scheduler assignment read" if not total else f"{len(off)} nodes off the {device}"))
    return failed


def last_logits(model, tokens: list[int], fa: bool, bias_seed: int | None) -> np.ndarray:
    """The logits after ``tokens`` in a fresh context, with every layer's attention bias set (uniform in [-2, 2],
    one cell in eight -inf, as test-backend-ops' cases) on the cells before the last token when ``bias_seed``."""
    from kvlocal.runtime import Context

    ctx = Context(model, n_ctx=256, flash_attn=fa)
    ctx.decode(tokens[:-1], range(len(tokens) - 1), "none")
    if bias_seed is not None:
        rng = np.random.default_rng(bias_seed)
        for il in model.arch.full_layers:
            b = rng.uniform(-2, 2, (model.n_head_kv, len(tokens) - 1))
            b[:, 1:][rng.random((model.n_head_kv, len(tokens) - 2)) < 1 / 8] = -np.inf
            ctx.set_bias(il, b.astype(np.float32))
    out = ctx.decode(tokens[-1:], [len(tokens) - 1], "last").astype(np.float64)
    ctx.close()
    return out


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p ‖ q) of two next-token distributions given as logits."""
    lp, lq = (x - x.max() - np.log(np.exp(x - x.max()).sum()) for x in (p_logits, q_logits))
    return float(np.sum(np.exp(lp) * (lp - lq)))


def bias_end_to_end(folder: str, n_gpu_layers: int) -> int:
    """A tiny Llama at head sizes 64 and 128, flash attention on and off: the next-token distribution with a bias in
    every layer, the model offloaded against on the CPU. Fails where they differ by more than 1e-2 (KL) or by more
    than a tenth of what the bias itself changes."""
    sys.path.insert(0, str(REPO / "tests" / "reference"))
    import tiny_gguf
    from kvlocal.eval.tasks import sample_text
    from kvlocal.runtime import Model

    failed = 0
    print(f"the attention bias in llama: -ngl {n_gpu_layers} against -ngl 0 (KL of the next-token distributions)")
    for head_dim in (64, 128):
        path = tiny_gguf.write_tiny(Path(folder) / f"llama-hd{head_dim}.gguf", arch="llama", head_dim=head_dim)
        cpu, dev = Model(path), Model(path, n_gpu_layers=n_gpu_layers)
        tokens = cpu.tokenize(sample_text())[:200]
        for fa in (False, True):
            ref, got = (last_logits(m, tokens, fa, bias_seed=1) for m in (cpu, dev))
            effect = kl(ref, last_logits(cpu, tokens, fa, bias_seed=None))
            diff = kl(got, ref)
            ok = diff <= 1e-2 and diff <= effect / 10
            failed |= not ok
            print(f"  head {head_dim:3} flash attention {'on ' if fa else 'off'}: KL {diff:.2e}, max |Δlogit| "
                  f"{np.abs(got - ref).max():.2e}; the bias itself: KL {effect:.2e}{'' if ok else '  !! differs'}")
    return int(failed)


def bench_summary(path: str) -> int:
    """Print `kvlocal bench --json`'s figures per backend, and the backend transfers per compression event where the
    bench reports transfers (a field named ``*transfers*``)."""
    result = json.loads(Path(path).read_text())
    full = result["full"]
    mib = 2**20
    print(f"{full['prompt_tokens']:,}-token prompt: full cache {full['kv_bytes_allocated'] / mib:.1f} MiB, "
          f"TTFT {full['ttft_seconds']:.2f} s, decode {full['decode_tok_s']:.1f} tok/s")
    for backend, r in result["backends"].items():
        run = r["run"]
        events = run["compression_events"]
        print(f"  {run['method']} at budget {run['budget']} on {backend}: {run['kv_bytes_allocated'] / mib:.1f} MiB "
              f"({r['kv_bytes_ratio']:.2f} of full), TTFT {run['ttft_seconds']:.2f} s, decode {run['decode_tok_s']:.1f} "
              f"tok/s ({r['decode_speedup']:.2f}x), {events} events, "
              f"{1000 * run['compression_seconds'] / max(events, 1):.1f} ms per event, "
              f"K/V to the host {r['host_kv_bytes'] / mib:.1f} MiB")
        for key in sorted(k for k in run if "transfers" in k):
            per = run[key] if "per_event" in key else run[key] / max(events, 1)
            print(f"    backend transfers per event ({key}): {per:.1f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="check", required=True)
    sub.add_parser("backend-ops").add_argument("log")
    p = sub.add_parser("sched")
    p.add_argument("model")
    p.add_argument("-ngl", type=int, default=99)
    p = sub.add_parser("bias")
    p.add_argument("folder")
    p.add_argument("-ngl", type=int, default=99)
    sub.add_parser("bench").add_argument("json")
    args = ap.parse_args(argv)
    if args.check == "backend-ops":
        return backend_ops(Path(args.log).read_text(errors="replace"))
    if args.check == "sched":
        return sched(args.model, args.ngl)
    if args.check == "bias":
        return bias_end_to_end(args.folder, args.ngl)
    return bench_summary(args.json)


if __name__ == "__main__":
    sys.exit(main())
