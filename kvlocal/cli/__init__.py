"""The ``kvlocal`` command line.

Every command is a function ``cmd_<name>(args) -> int``. Bad input raises UsageError, which main()
prints as one line and turns into exit code 2 — no traceback, nothing half-written.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from kvlocal.version import __version__
from kvlocal.errors import UsageError, worded
from kvlocal.options import (add_budget_args, add_llama_args, add_model_arg, add_sampling_args, engine_from_args,
                              input_file, sampler_from_args, settings_from_args)






def cmd_doctor(args) -> int:
    from kvlocal.models import cache_dir, cached_models

    from kvlocal.runtime import parse_endpoints

    parse_endpoints(args.rpc)  # a bad --rpc is bad input: one line, exit 2
    plan_rows = _plan_rows(args) if args.plan else []  # a bad -ts, -c or model too, before anything is asked
    rows = [("kvlocal", __version__), ("python", f"{platform.python_version()} ({sys.executable})")]
    problems = 0
    try:
        from kvlocal.runtime import has_native_compression, metal_bias, runtime_info

        info = runtime_info()
        rows += [("runtime", info.describe()), ("library", info.library),
                 ("backend", ("GPU offload available; " if info.gpu_offload else "CPU only; ") + info.system_info)]
        if not info.patched:
            rows.append(("", "stock llama.cpp: eviction works; per-cell features need `python ggml_patches/build.py`"))
        rows.append(("native", "compression on the cache's device (--backend native): every method"
                     if has_native_compression() else
                     "not available (patches 0009-0011): compression reads K/V to the host (--backend state)"))
        rows.append(("metal", metal_bias().describe()))
        from kvlocal.cli import rpc

        rows.append(rpc.runtime_row())
        if args.rpc:
            remote, bad = rpc.doctor_rows(args.rpc)
            rows += remote
            problems += bad
    except UsageError as e:
        rows.append(("runtime", f"NOT AVAILABLE: {e}"))
        problems += 1
    try:
        from kvlocal import kernels

        kernels.topk([1.0, 3.0, 2.0], 1)
        rows.append(("kernels", f"ok ({kernels.simd_level()}: pool1d, topk, window_votes, vnorm)"))
    except ImportError as e:
        rows.append(("kernels", f"NOT BUILT: {e}"))
        problems += 1
    try:
        import torch

        rows.append(("torch", f"{torch.__version__} (reference path, `kvlocal verify`)"))
    except ImportError:
        rows.append(("torch", "not installed: `kvlocal verify` needs `pip install 'kvlocal[reference]'`"))
    if os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":  # (docs/engine.md § OpenMP's idle threads)
        rows.append(("openmp", "OMP_WAIT_POLICY=PASSIVE: ggml's threads sleep between ops, decoding 2-3x slower; "
                               "unset it unless other work needs the cores"))
    models = cached_models()
    rows.append(("models", f"{cache_dir() / 'models'} ({len(models)})"))
    for name, path, size in models:
        rows.append(("", f"{name:<20} {size / 2**20:8.1f} MiB  {path.name}"))
    rows += plan_rows
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 1 if problems else 0


def _plan_rows(args) -> list[tuple[str, str]]:
    """``doctor --plan``'s rows (kvlocal/cli/plan.py): the settings as the flags give them, the context at -c or the
    model's trained one."""
    from kvlocal.cli import plan
    from kvlocal.models import resolve
    from kvlocal.models.gguf_file import read_gguf
    from kvlocal.models.arch import arch_info, gguf_meta
    from kvlocal.runtime import parse_endpoints
    from kvlocal.settings import chat_settings_from_args, runtime_settings_from_args

    runtime, s = runtime_settings_from_args(args), chat_settings_from_args(args)
    path = resolve(args.plan)
    header = read_gguf(path)
    n_ctx = s.ctx_size or int(header.get(f"{arch_info(gguf_meta(header), path.name).arch}.context_length") or 4096)
    return plan.rows(path, n_ctx, s.budget, runtime.n_gpu_layers, list(parse_endpoints(args.rpc)) if args.rpc else [],
                     list(runtime.tensor_split) or None, s.cache_type_k, s.cache_type_v)


def cmd_pull(args) -> int:
    from kvlocal.models import DEFAULT_MODEL, KNOWN_MODELS, pull

    if args.list:
        for m in KNOWN_MODELS.values():
            print(f"{m.name:<20} {m.size / 2**20:7.1f} MiB  {m.description}")
        return 0
    path = pull(args.name or DEFAULT_MODEL, force=args.force, quiet=args.quiet)
    print(path)
    return 0


def cmd_chat(args) -> int:
    from kvlocal.cli import repl

    return repl.run(args)


def cmd_run(args) -> int:
    import json
    from pathlib import Path

    from kvlocal.models import resolve

    runtime, _ = settings_from_args(args)  # SettingError, worded as the flag, before anything loads
    sampler = sampler_from_args(args)
    if args.prompt_file == "-":
        prompt_path, text = Path("standard input"), sys.stdin.read()
    else:
        prompt_path = input_file("--prompt-file", args.prompt_file)
        try:
            text = prompt_path.read_text(errors="replace")
        except OSError as e:
            raise UsageError(f"--prompt-file {prompt_path}: cannot read it ({e.strerror})") from None
    if not text.strip():  # the text decides, not the tokens: a model may add a BOS token to nothing
        raise UsageError(f"--prompt-file {prompt_path} is empty: give a text to continue")
    model = runtime.load(resolve(args.model))
    if args.chat:
        text = model.chat_prompt([{"role": "user", "content": text}], add_assistant=True)
    tokens = model.tokenize(text, add_special=True, parse_special=args.chat)
    if args.ctx_size and len(tokens) + args.n_predict > args.ctx_size:
        raise UsageError(f"the prompt has {len(tokens)} tokens (+{args.n_predict} to generate), over the cap -c {args.ctx_size}: raise -c")
    engine = engine_from_args(args, model, max_tokens=len(tokens) + args.n_predict)
    if args.question:
        probe = model.tokenize(args.question, add_special=False)
    elif args.agnostic:
        probe = None
    else:  # the prompt ends with its question: its last tokens are the observation window
        probe = tokens[-args.recent:]
    engine.read_prompt(tokens, probe, tail=min(args.recent, len(tokens) - 1))  # the question re-selects the cache first
    if engine.tier is not None:
        engine.prompt_plan = engine.last_plan
    kept = engine.live_cells()  # the prompt's tokens still in the cache
    out = list(engine.generate(args.n_predict, sampler))
    answer = model.detokenize(out)
    if args.dump_plan:
        plan = engine.prompt_plan
        Path(args.dump_plan).write_text(plan.to_json() if plan else "null")
    result = {"text": answer, "prompt_tokens": len(tokens), "generated_tokens": len(out), "method": args.method,
              "budget": args.budget, "cache_type_k": args.cache_type_k, "cache_type_v": args.cache_type_v, "observation": "question" if args.question else "agnostic" if args.agnostic else "prompt-tail",
              **{k: v for k, v in engine.stats.as_dict().items() if k not in ("prompt_tokens", "generated_tokens")},
              **engine.kv_figures()}  # the names the chat's /stats and the server's kv object use
    if args.json:
        print(json.dumps(result))
    else:
        print(answer)
        s = engine.stats
        print(f"[{args.method} budget {args.budget} ({s.backend}): {kept} of {len(tokens)} prompt tokens kept · "
              f"n_ctx {s.n_ctx} · KV {s.kv_bytes_allocated / 2**20:.1f} MiB (llama.cpp's cache for "
              f"{engine.cfg.max_tokens} tokens: {s.kv_bytes_full / 2**20:.1f} MiB) · kvlocal's own "
              f"{(s.wo_cache_bytes + s.host_bytes_peak) / 2**20:.1f} MiB · "
              + (f"recall tier {s.host_tier_bytes / 2**20:.1f} MiB, {s.recall_rows_in} rows back · " if engine.tier else "")
              + f"{s.compression_events} compression{'' if s.compression_events == 1 else 's'} "
              f"{s.compression_seconds:.2f} s · prefill {s.prefill_seconds:.2f} s · decode {s.decode_seconds:.2f} s]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from kvlocal.cli import bench
    from kvlocal.models import resolve

    args.model_path = resolve(args.model)
    return bench.run(args)


def cmd_verify(args) -> int:
    from kvlocal.cli import verify

    return verify.run(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvlocal",
        description="Long-context chat with GGUF models inside a fixed KV-cache budget, on a patched llama.cpp.",
    )
    ap.add_argument("--version", action="version", version=f"kvlocal {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("chat", help="chat with a model in a bounded KV cache (default model: qwen2.5-coder-0.5b)",
                       description="A terminal chat in a bounded KV cache: streamed replies, a status line of what the "
                                   "cache keeps, /read FILE, /save and /load, /help for the commands.")
    add_model_arg(p)
    add_llama_args(p)
    add_budget_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=512, help="most tokens per reply (default 512)")
    from kvlocal.settings import add_setting_args

    add_setting_args(p, names=("system", "pin_system"))
    p.add_argument("--file", action="append", metavar="DOC", help="read a text file into the chat before the first "
                   "message (repeatable); ask about it after")
    p.add_argument("--load", metavar="PATH", help="continue a chat saved with /save (the same model)")
    add_sampling_args(p, interactive=True)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible server whose conversations keep their compressed caches",
                       description="POST /v1/chat/completions (streaming or not) with usage and a kv object; a request "
                                   "that continues an earlier conversation reuses its cache (docs/server.md).")
    from kvlocal import server

    server.add_arguments(p)
    p.set_defaults(func=server.run)

    p = sub.add_parser("run", help="one-shot generation from a prompt file, for scripts and benchmarks")
    add_model_arg(p)
    add_llama_args(p)
    add_budget_args(p)
    p.add_argument("--prompt-file", required=True, help="text file with the prompt (- : standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the file as one user message with the model's chat template "
                                                           "(the GGUF's Jinja template; llama.cpp's built-in one if it has none)")
    p.add_argument("--question", default=None, help="score the cache with this question's queries")
    p.add_argument("--agnostic", action="store_true", help="score with the generic probe, not the prompt's tail")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and the figures")
    p.add_argument("--dump-plan", metavar="FILE", help="write the kept source positions per layer and KV head (docs/engine.md)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("pull", help="download a known model, or a GGUF from a Hugging Face repo")
    p.add_argument("name", nargs="?", default=None,
                   help="a known model (default qwen2.5-coder-0.5b; --list shows them) or OWNER/REPO[:QUANT], "
                        "OWNER/REPO/FILE.gguf (Hugging Face; HF_ENDPOINT, HF_HOME and HF_TOKEN are honoured)")
    p.add_argument("--list", action="store_true", help="list the known models")
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("doctor", help="show the runtime, kernels and cached models")
    p.add_argument("--rpc", metavar="HOST:PORT[,HOST:PORT…]", default=None,
                   help="also ask these rpc-servers their devices, memory and build (docs/distributed.md)")
    p.add_argument("--plan", metavar="MODEL", default=None,
                   help="also say what each machine needs for MODEL split as -ngl, --rpc and -ts say: weights and KV "
                        "cache at -c, with and without --budget (from the file's header; nothing is loaded)")
    from kvlocal.settings import add_setting_args

    add_setting_args(p, names=("ctx_size", "budget", "n_gpu_layers", "tensor_split", "cache_type_k", "cache_type_v"))
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("rpc-server", help="serve this machine's devices to kvlocal on another machine (llama.cpp's "
                       "RPC server; insecure: never on an open network)")
    from kvlocal.cli import rpc

    rpc.add_arguments(p)
    p.set_defaults(func=rpc.run)

    p = sub.add_parser("bench", help="KV memory and decode speed at a budget vs the full cache, side by side")
    from kvlocal.cli import bench

    bench.add_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", help="quality vs KV budget: methods x budgets x tasks x models, a results file and plots")
    from kvlocal import eval as evaluation

    evaluation.add_arguments(p)
    p.set_defaults(func=evaluation.run)

    p = sub.add_parser("verify", help="compare llama.cpp's logits with the PyTorch reference")
    try:
        from kvlocal.cli import verify

        verify.add_arguments(p)
    except ImportError:  # torch missing: the command explains itself when run
        add_model_arg(p)
    p.set_defaults(func=cmd_verify)
    return ap


def main(argv: list[str] | None = None) -> int:
    # OpenMP's wait policy is left to the user (the OMP_WAIT_POLICY variable): ggml's threads meet at a barrier after
    # every op, and threads that sleep there instead of spinning a moment decode much slower in a bounded cache
    # (docs/engine.md § OpenMP's idle threads has the measurement). Only `verify`, which runs torch's OpenMP beside ggml's, asks for
    # PASSIVE (kvlocal.cli.verify.run).
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UsageError as e:  # a setting named as its flag (kvlocal.errors)
        from kvlocal.settings import flag_name

        print(f"kvlocal: error: {worded(e, flag_name)}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
