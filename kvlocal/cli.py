"""The ``kvlocal`` command line.

Every command is a function ``cmd_<name>(args) -> int``. Bad input raises UsageError, which main()
prints as one line and turns into exit code 2 — no traceback, nothing half-written.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from . import __version__
from .errors import UsageError


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, a known model name (default: smollm2-135m, pulled on first use) or a Hugging Face "
                        "repo: OWNER/REPO[:QUANT] or OWNER/REPO/FILE.gguf")


def _llama_args(p: argparse.ArgumentParser) -> None:
    """Flags named as in llama.cpp's own tools."""
    p.add_argument("-c", "--ctx-size", type=int, default=0,
                   help="the tokens a ratio budget is sized from (default: the model's trained context); `run` "
                        "refuses a longer prompt, a chat goes on past it in the same cells")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers to offload to the GPU (default 0)")
    p.add_argument("-fa", "--flash-attn", action="store_true", help="use flash attention (off by default: slower for CPU decode)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: cores, at most 8)")
    types = "f16, q8_0, q4_0, q4_1, q5_0, q5_1, bf16, f32"
    p.add_argument("-ctk", "--cache-type-k", default="f16", metavar="TYPE",
                   help=f"KV cache type for K ({types}; default f16): compression runs on it, evicting quantized rows as they are")
    p.add_argument("-ctv", "--cache-type-v", default="f16", metavar="TYPE",
                   help="KV cache type for V (default f16; a quantized V turns flash attention on, as llama.cpp needs)")


def cmd_doctor(args) -> int:
    from .models import cache_dir, cached_models

    rows = [("kvlocal", __version__), ("python", f"{platform.python_version()} ({sys.executable})")]
    problems = 0
    try:
        from .runtime import runtime_info

        info = runtime_info()
        rows += [("runtime", info.describe()), ("library", info.library),
                 ("backend", ("GPU offload available; " if info.gpu_offload else "CPU only; ") + info.system_info)]
        if not info.patched:
            rows.append(("", "stock llama.cpp: eviction works; per-cell features need `python ggml_patches/build.py`"))
        from .compress import NATIVE_METHODS
        from .runtime.library import has_native_compression

        rows.append(("native", f"compression on the cache's device (--backend native): {', '.join(sorted(NATIVE_METHODS - {'full'}))}"
                     if has_native_compression() else
                     "not available (patches 0010-0012): compression reads K/V to the host (--backend state)"))
    except UsageError as e:
        rows.append(("runtime", f"NOT AVAILABLE: {e}"))
        problems += 1
    try:
        from . import kernels

        kernels.topk([1.0, 3.0, 2.0], 1)
        rows.append(("kernels", f"ok ({kernels.simd_level()}: pool1d, topk, window_votes, vnorm_l1)"))
    except ImportError as e:
        rows.append(("kernels", f"NOT BUILT: {e}"))
        problems += 1
    try:
        import torch

        rows.append(("torch", f"{torch.__version__} (reference path, `kvlocal verify`)"))
    except ImportError:
        rows.append(("torch", "not installed: `kvlocal verify` needs `pip install 'kvlocal[reference]'`"))
    models = cached_models()
    rows.append(("models", f"{cache_dir() / 'models'} ({len(models)})"))
    for name, path, size in models:
        rows.append(("", f"{name:<20} {size / 2**20:8.1f} MiB  {path.name}"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 1 if problems else 0


def cmd_pull(args) -> int:
    from .models import KNOWN_MODELS, pull

    if args.list:
        for m in KNOWN_MODELS.values():
            print(f"{m.name:<20} {m.size / 2**20:7.1f} MiB  {m.description}")
        return 0
    path = pull(args.name, force=args.force, quiet=args.quiet)
    print(path)
    return 0


def _budget_args(p: argparse.ArgumentParser) -> None:
    from .compress import METHODS

    p.add_argument("--budget", default="0.1",
                   help="KV budget: a ratio in (0, 1] of the tokens seen (default 0.1) or a cell count like 2048")
    p.add_argument("--method", default="criticalkv", help=f"{', '.join(METHODS)} (default criticalkv; docs/algorithms.md)")
    p.add_argument("--chunk", type=int, default=128,
                   help="least prefill chunk in tokens: n_ctx = budget + chunk + window, padded by llama.cpp (default 128)")
    p.add_argument("--window", type=int, default=32, help="recent tokens always kept; probe length (default 32)")
    p.add_argument("--backend", default="auto", choices=("auto", "native", "state"),
                   help="where compression runs: native = on the device that holds the cache (patched llama.cpp; "
                        "eviction methods, unquantized caches), state = K/V read to the host (every method); "
                        "default auto: native when the model is offloaded to a GPU (-ngl), else state")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's sampling flags; the chain is llama.cpp's own (kvlocal/runtime/sampler.py)."""
    g = p.add_argument_group("sampling (llama.cpp's sampler chain)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature (default 0: greedy)")
    g.add_argument("--top-k", type=int, default=40, help="top-k sampling (default 40, 0 = off)")
    g.add_argument("--top-p", type=float, default=0.95, help="top-p sampling (default 0.95, 1.0 = off)")
    g.add_argument("--min-p", type=float, default=0.05, help="min-p sampling (default 0.05, 0.0 = off)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="penalize repeated tokens (default 1.0 = off)")
    g.add_argument("--repeat-last-n", type=int, default=64, help="tokens the repeat penalty looks back on (default 64, 0 = off)")
    g.add_argument("--seed", type=int, default=-1, help="sampling seed (default -1: random)")


def _sampler(args):
    from .sampling import Sampler, SamplerParamError

    try:
        return Sampler(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                       repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                       seed=None if args.seed == -1 else args.seed)
    except SamplerParamError as e:  # the parameters are named as the flags, with _ for -
        flag = "--" + e.param.replace("_", "-")
        rule = e.rule.replace("None (random)", "-1 (random)")
        raise UsageError(f"{flag} must be {rule} (got {e.value})") from None


def _engine(args, model, max_tokens: int):
    from .engine import Budget, Engine

    if args.chunk < 1 or args.window < 1:
        raise UsageError("--chunk and --window must be at least 1")
    budget = Budget.parse(args.budget)
    if max_tokens > model.n_ctx_train:
        print(f"kvlocal: warning: {max_tokens} tokens exceed the {model.n_ctx_train} the model was trained on; positions extrapolate",
              file=sys.stderr)
    return Engine(model, budget, args.method, max_tokens=max_tokens, chunk=args.chunk, window=args.window,
                  flash_attn=args.flash_attn, n_threads=args.threads, backend=args.backend, **cache_types(args))


def cache_types(args) -> dict:
    """``-ctk``/``-ctv`` → the Engine's ``type_k``/``type_v`` (ggml types; UsageError for an unknown name)."""
    from .runtime.kvquant import cache_type

    return dict(type_k=cache_type(args.cache_type_k), type_v=cache_type(args.cache_type_v))


def cmd_chat(args) -> int:
    from . import repl

    return repl.run(args)


def cmd_run(args) -> int:
    import json
    from pathlib import Path

    from .models import resolve
    from .runtime import Model

    sampler = _sampler(args)
    prompt_path = Path(args.prompt_file)
    if not prompt_path.is_file():
        raise UsageError(f"--prompt-file {prompt_path}: no such file")
    text = prompt_path.read_text(errors="replace")
    model = Model(resolve(args.model), n_gpu_layers=args.n_gpu_layers)
    if args.chat:
        text = model.chat_prompt([{"role": "user", "content": text}], add_assistant=True)
    tokens = model.tokenize(text, add_special=True, parse_special=args.chat)
    if args.ctx_size and len(tokens) + args.n_predict > args.ctx_size:
        raise UsageError(f"the prompt has {len(tokens)} tokens (+{args.n_predict} to generate), over the cap -c {args.ctx_size}: raise -c")
    engine = _engine(args, model, max_tokens=len(tokens) + args.n_predict)
    if args.question:
        probe = model.tokenize(args.question, add_special=False)
    elif args.agnostic:
        probe = None
    else:  # the prompt ends with its question: its last tokens are the observation window
        probe = tokens[-args.window:]
    engine.prefill(tokens, probe=probe)
    out = list(engine.generate(args.n_predict, sampler))
    answer = model.detokenize(out)
    if args.dump_plan:
        plan = engine.prompt_plan
        Path(args.dump_plan).write_text(plan.to_json() if plan else "null")
    result = {"text": answer, "prompt_tokens": len(tokens), "generated_tokens": len(out), "method": args.method,
              "budget": args.budget, "cache_type_k": args.cache_type_k, "cache_type_v": args.cache_type_v, "observation": "question" if args.question else "agnostic" if args.agnostic else "prompt-tail",
              **{k: v for k, v in engine.stats.as_dict().items() if k not in ("prompt_tokens", "generated_tokens")}}
    if args.json:
        print(json.dumps(result))
    else:
        print(answer)
        s = engine.stats
        print(f"[{args.method} budget {args.budget} ({s.backend}): {s.budget_cells} of {len(tokens)} prompt tokens kept · "
              f"n_ctx {s.n_ctx} · KV {s.kv_bytes_allocated / 2**20:.1f} MiB · kvlocal's own "
              f"{(s.wo_cache_bytes + s.host_bytes_peak) / 2**20:.1f} MiB · {s.compression_events} compressions "
              f"{s.compression_seconds:.2f} s · prefill {s.prefill_seconds:.2f} s · decode {s.decode_seconds:.2f} s]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from . import bench
    from .models import resolve

    args.model_path = resolve(args.model)
    return bench.run(args)


def cmd_verify(args) -> int:
    from . import verify

    return verify.run(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvlocal",
        description="Long-context chat with GGUF models inside a fixed KV-cache budget, on a patched llama.cpp.",
    )
    ap.add_argument("--version", action="version", version=f"kvlocal {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("chat", help="chat with a model in a bounded KV cache (default model: smollm2-135m)",
                       description="A terminal chat in a bounded KV cache: streamed replies, a status line of what the "
                                   "cache keeps, /read FILE, /save and /load, /help for the commands.")
    _model_arg(p)
    _llama_args(p)
    _budget_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=512, help="most tokens per reply (default 512)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--file", action="append", metavar="DOC", help="read a text file into the chat before the first "
                   "message (repeatable); ask about it after")
    p.add_argument("--load", metavar="PATH", help="continue a chat saved with /save (the same model)")
    _sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible server whose conversations keep their compressed caches",
                       description="POST /v1/chat/completions (streaming or not) with usage and a kv object; a request "
                                   "that continues an earlier conversation reuses its cache (docs/server.md).")
    from . import server

    server.add_arguments(p)
    p.set_defaults(func=server.run)

    p = sub.add_parser("run", help="one-shot generation from a prompt file, for scripts and benchmarks")
    _model_arg(p)
    _llama_args(p)
    _budget_args(p)
    p.add_argument("--prompt-file", required=True, help="text file with the prompt")
    p.add_argument("--chat", action="store_true", help="wrap the file as one user message with the model's chat template "
                                                           "(the GGUF's Jinja template; llama.cpp's built-in one if it has none)")
    p.add_argument("--question", default=None, help="score the cache with this question's queries")
    p.add_argument("--agnostic", action="store_true", help="score with the generic probe, not the prompt's tail")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    _sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and the figures")
    p.add_argument("--dump-plan", metavar="FILE", help="write the kept source positions per layer and KV head (docs/engine.md)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("pull", help="download a known model, or a GGUF from a Hugging Face repo")
    p.add_argument("name", nargs="?", default="smollm2-135m",
                   help="a known model (default smollm2-135m; --list shows them) or OWNER/REPO[:QUANT], "
                        "OWNER/REPO/FILE.gguf (Hugging Face; HF_ENDPOINT, HF_HOME and HF_TOKEN are honoured)")
    p.add_argument("--list", action="store_true", help="list the known models")
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("doctor", help="show the runtime, kernels and cached models")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("bench", help="KV memory and decode speed at a budget vs the full cache, side by side")
    from . import bench

    bench.add_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", help="quality vs KV budget: methods x budgets x tasks x models, a results file and plots")
    from . import eval as evaluation

    evaluation.add_arguments(p)
    p.set_defaults(func=evaluation.run)

    p = sub.add_parser("verify", help="compare llama.cpp's logits with the PyTorch reference")
    try:
        from . import verify

        verify.add_arguments(p)
    except ImportError:  # torch missing: the command explains itself when run
        _model_arg(p)
    p.set_defaults(func=cmd_verify)
    return ap


def main(argv: list[str] | None = None) -> int:
    # llama.cpp and torch each bring an OpenMP runtime; spinning idle threads of one starve the other
    # (measured: 2x slower decode, 10x slower reference on a busy 2-core machine)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UsageError as e:
        print(f"kvlocal: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
