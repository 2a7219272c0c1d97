"""The ``kvlocal`` command line.

Every command is a function ``cmd_<name>(args) -> int``. Bad input raises UsageError, which main()
prints as one line and turns into exit code 2 — no traceback, nothing half-written.
"""

from __future__ import annotations

import argparse
import platform
import sys

from . import __version__
from .errors import UsageError


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or a known model name (default: smollm2-135m, pulled on first use)")


def _llama_args(p: argparse.ArgumentParser, ctx_default: int) -> None:
    """Flags named as in llama.cpp's own tools."""
    p.add_argument("-c", "--ctx-size", type=int, default=ctx_default, help=f"KV cells to allocate (default {ctx_default})")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers to offload to the GPU (default 0)")
    p.add_argument("-fa", "--flash-attn", action="store_true", help="use flash attention (off by default: slower for CPU decode)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: cores, at most 8)")


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
    except UsageError as e:
        rows.append(("runtime", f"NOT AVAILABLE: {e}"))
        problems += 1
    try:
        from . import kernels

        kernels.topk([1.0, 3.0, 2.0], 1)
        rows.append(("kernels", f"ok ({kernels.__name__}: pool1d, topk)"))
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


def cmd_chat(args) -> int:
    from .models import resolve
    from .runtime import Context, Model, runtime_info
    from .sampling import Sampler
    from .session import ChatSession

    path = resolve(args.model)
    info = runtime_info()
    model = Model(path, n_gpu_layers=args.n_gpu_layers)
    ctx = Context(model, n_ctx=args.ctx_size, flash_attn=args.flash_attn, n_threads=args.threads)
    session = ChatSession(model, ctx, Sampler(args.temp, seed=args.seed), system=args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"kvlocal chat · {path.name} · {ctx.n_ctx} cells · {info.describe()}", file=sys.stderr)
        print("Type a message; an empty line or Ctrl-D ends the chat.", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line or (interactive and not line.strip()):
            return 0
        if not line.strip():
            continue
        for piece in session.ask(line.strip(), max_tokens=args.n_predict):
            print(piece, end="", flush=True)
        print(flush=True)


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

    p = sub.add_parser("chat", help="chat with a model (default model: smollm2-135m)")
    _model_arg(p)
    _llama_args(p, ctx_default=4096)
    p.add_argument("-n", "--n-predict", type=int, default=512, help="most tokens per reply (default 512)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("pull", help="download a known model into the cache")
    p.add_argument("name", nargs="?", default="smollm2-135m", help="model name (default smollm2-135m; --list shows all)")
    p.add_argument("--list", action="store_true", help="list the known models")
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("doctor", help="show the runtime, kernels and cached models")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("verify", help="compare llama.cpp's logits with the PyTorch reference")
    try:
        from . import verify

        verify.add_arguments(p)
    except ImportError:  # torch missing: the command explains itself when run
        _model_arg(p)
    p.set_defaults(func=cmd_verify)
    return ap


def main(argv: list[str] | None = None) -> int:
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
