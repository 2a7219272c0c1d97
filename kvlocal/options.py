"""The options every command shares (``chat``, ``run``, ``serve``, ``bench``): the model argument,
llama.cpp's flags, the budget and method, and sampling — declared once, read back into the objects the
commands build. The front doors (:mod:`kvlocal.cli`, :mod:`kvlocal.server`) import these; nothing here
imports a front door."""

from __future__ import annotations

import argparse
import sys

from kvlocal.errors import UsageError


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, a known model name (default: qwen2.5-coder-0.5b, pulled on first use) or a Hugging Face "
                        "repo: OWNER/REPO[:QUANT] or OWNER/REPO/FILE.gguf")


def add_llama_args(p: argparse.ArgumentParser) -> None:
    """Flags named as in llama.cpp's own tools."""
    p.add_argument("-c", "--ctx-size", type=int, default=0,
                   help="the tokens a ratio budget is sized from (default 0: the model's trained context); `run` "
                        "refuses a longer prompt, a chat goes on past it in the same cells")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                   help="layers to offload to the GPU (default 0; -1: all, as in llama-cpp-python)")
    p.add_argument("-fa", "--flash-attn", action="store_true", help="use flash attention (off by default: slower for CPU decode)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: cores, at most 8)")
    types = "f16, q8_0, q4_0, q4_1, q5_0, q5_1, bf16, f32"
    p.add_argument("-ctk", "--cache-type-k", default="f16", metavar="TYPE",
                   help=f"KV cache type for K ({types}; default f16): compression runs on it, evicting quantized rows as they are")
    p.add_argument("-ctv", "--cache-type-v", default="f16", metavar="TYPE",
                   help="KV cache type for V (default f16; a quantized V turns flash attention on, as llama.cpp needs)")


def add_budget_args(p: argparse.ArgumentParser) -> None:
    from kvlocal.compress import METHODS, VALUE_NORMS
    from kvlocal.engine.config import LOW_WATER, OBSERVE_EVERY, PREFILL_OBSERVATIONS, PREFILL_OBSERVE, RECALL_STEPS
    from kvlocal.recall import default_recall_mem, default_spill_dir

    p.add_argument("--budget", default="0.1",
                   help="KV budget: a ratio in (0, 1] of the context (-c; `run`: of the prompt and -n) (default 0.1), "
                        "or a cell count like 2048")
    p.add_argument("--method", default="criticalkv", help=f"{', '.join(METHODS)} (default criticalkv; docs/algorithms.md)")
    p.add_argument("--chunk", type=int, default=128,
                   help="least prefill chunk in tokens: n_ctx = budget + chunk + recent, padded by llama.cpp (default 128)")
    p.add_argument("--recent", "--window", type=int, default=32, dest="recent",
                   help="the protected recent span: the newest tokens always kept, and the probe's length (default 32; "
                        "--window is its old name)")
    p.add_argument("--observe-every", type=int, default=OBSERVE_EVERY, metavar="N",
                   help="prefill compression events one decode of the probe scores; between decodes its queries are "
                        "moved to the new positions by RoPE (default %(default)s; docs/engine.md)")
    p.add_argument("--prefill-observe", default=PREFILL_OBSERVE, choices=PREFILL_OBSERVATIONS,
                   help="how a prompt's compression events before its last are scored: probe = the probe's queries "
                        "(the question's, or a generic probe's; decoded once in --observe-every events), window = the "
                        "queries of the chunk's own last tokens, no decode: cheaper, and it finds fewer facts "
                        "(default %(default)s; docs/engine.md)")
    p.add_argument("--low-water", type=float, default=None, metavar="F",
                   help=f"the share of the budget a prompt's compression events leave before its last one: fewer, "
                        f"larger events in the same memory (default {LOW_WATER} with the recall tier, which keeps what "
                        f"they drop, 1 without; 1: every event leaves the whole budget; docs/engine.md)")
    p.add_argument("--backend", default="auto", choices=("auto", "native", "state"),
                   help="where compression runs: native = on the device that holds the cache (patched llama.cpp; "
                        "only the rows a method reads itself cross), state = K/V read to the host and back; "
                        "default auto: native when the model is offloaded to a GPU (-ngl), else state")
    p.add_argument("--recall", default="auto", choices=("on", "off", "auto"),
                   help="the recall tier: rows evicted from the KV cache wait in host memory, and each new question "
                        "brings back the ones it needs (default auto: on for the eviction methods, off for merging)")
    p.add_argument("--recall-mem", metavar="SIZE", default=None,
                   help=f"host RAM the recall tier may use (e.g. 2G; none: no cap; `serve`: one cap for all its "
                        f"conversations); past it the oldest evicted rows are dropped, or with --recall-dir go to a file "
                        f"(default: 1/8 of the memory, at most 4G: {default_recall_mem() / 2**30:.1f}G here)")
    p.add_argument("--recall-dir", metavar="DIR", nargs="?", const=default_spill_dir(), default=None,
                   help="past --recall-mem, the recall tier's rows go to a memory-mapped file in DIR instead of the "
                        "oldest being dropped (DIR left out: %(const)s)")
    p.add_argument("--recall-steps", metavar="N", type=int, default=RECALL_STEPS,
                   help="the first N tokens of each answer re-select the cache too, each with its own query "
                        "(default %(default)s; 0: only the question does; docs/recall.md)")
    p.add_argument("--value-norm", choices=list(VALUE_NORMS), default=None,
                   help="the norm of CriticalKV's projected values, |v·W_O|: l2 (the default: computed exactly at "
                        "d/D of the work) or l1 (the paper's; equal quality measured: docs/engine.md)")


# the sampling flags, llama.cpp's: (flag, type, what it does, its "off" value), in Sampler's parameters' order
_SAMPLING_FLAGS = (("--temp", float, "temperature", "0: greedy"), ("--top-k", int, "top-k sampling", "0 = off"),
                   ("--top-p", float, "top-p sampling", "1.0 = off"), ("--min-p", float, "min-p sampling", "0.0 = off"),
                   ("--repeat-penalty", float, "penalize repeated tokens", "1.0 = off"),
                   ("--repeat-last-n", int, "tokens the repeat penalty looks back on", "0 = off"))


def add_sampling_args(p: argparse.ArgumentParser, interactive: bool = False) -> None:
    """llama.cpp's sampling flags; the chain is llama.cpp's own (kvlocal/runtime/sampler.py). ``interactive`` (chat,
    serve): an unset flag takes the model's own sampling (its GGUF's ``general.sampling.*``), else llama.cpp's and
    Ollama's chat defaults, and ``--loop-guard`` ends loops; otherwise (run) decoding is greedy unless asked, so runs
    are reproducible."""
    import dataclasses

    from kvlocal.chat.loops import LOOP_GUARD
    from kvlocal.runtime import CHAT_SAMPLING, SAMPLING_PARAMS, Sampler

    greedy = {f.name: f.default for f in dataclasses.fields(Sampler)}
    g = p.add_argument_group("sampling (llama.cpp's sampler chain)")
    p.set_defaults(sampling="chat" if interactive else "greedy")
    for name, (flag, kind, what, off) in zip(SAMPLING_PARAMS, _SAMPLING_FLAGS):
        default = (f"the model's own if its GGUF declares one, else {CHAT_SAMPLING[name]:g}" if interactive
                   else f"default {greedy[name]:g}")
        g.add_argument(flag, type=kind, default=None if interactive else greedy[name], help=f"{what} ({default}; {off})")
    g.add_argument("--seed", type=int, default=-1, help="sampling seed: the same seed, the same replies "
                                                        "(default -1: random)")
    if interactive:
        g.add_argument("--loop-guard", type=int, default=LOOP_GUARD, metavar="N",
                       help=f"end a reply once its last N tokens are one span repeated over and over "
                            f"(default {LOOP_GUARD}; 0: off)")


def check_loop_guard(args) -> None:
    """UsageError, naming the fix, for a ``--loop-guard`` the guard cannot take."""
    from kvlocal.chat.loops import LoopGuard

    try:
        LoopGuard(args.loop_guard)
    except ValueError as e:
        raise UsageError(f"--loop-guard {e}") from None


def sampling_params(args, model=None) -> dict:
    """The Sampler keywords the sampling flags ask for: an interactive command's unset flags from
    :func:`kvlocal.runtime.chat_sampling` (the model's own, else the chat defaults)."""
    from kvlocal.runtime import SAMPLING_PARAMS, chat_sampling

    params = chat_sampling(model) if getattr(args, "sampling", "greedy") == "chat" else {}
    for name in SAMPLING_PARAMS:
        value = getattr(args, name)
        if value is not None:
            params[name] = value
    params["seed"] = None if args.seed == -1 else args.seed
    return params


def input_file(flag: str, path: str):
    """``path`` as a Path, or UsageError naming the fix: it must exist and not be a folder. A pipe or a device is a file
    here (``--file <(pdftotext report.pdf -)``, ``--prompt-file /dev/stdin``): it is read as it comes."""
    from pathlib import Path

    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such file")
    if p.is_dir():
        raise UsageError(f"{flag} {path} is a folder: give a text file")
    return p


def check_llama_args(args) -> None:
    """UsageError, naming the fix, for llama.cpp flags no model can run with (before anything loads)."""
    if args.ctx_size < 0:
        raise UsageError(f"-c/--ctx-size {args.ctx_size}: give a number of tokens, or 0 for the model's trained context")
    if args.n_gpu_layers < -1:
        raise UsageError(f"-ngl/--n-gpu-layers {args.n_gpu_layers}: give a number of layers, 0 for none or -1 for all")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"-t/--threads {args.threads}: give at least 1 (default: the cores, at most 8)")
    if getattr(args, "observe_every", 1) < 1:
        raise UsageError(f"--observe-every {args.observe_every}: give at least 1 (1: the probe is decoded for every event)")
    if getattr(args, "low_water", None) is not None:
        from kvlocal.engine.config import check_low_water

        check_low_water(args.low_water, "--low-water")
    if getattr(args, "value_norm", None) is not None:
        check_value_norm(args.method)
    if hasattr(args, "recall"):
        check_recall_args(args)


def check_recall_args(args) -> None:
    """The refusals of ``--recall*``, ``--method`` and ``--backend`` that need no model, before one loads."""
    from kvlocal.engine import resolve_recall
    from kvlocal.recall import check_spill_dir
    from kvlocal.runtime import resolve_backend

    kw = recall_args(args)
    if args.recall_dir is not None and _names_a_model(args.recall_dir):
        raise UsageError(f"--recall-dir took {args.recall_dir} as its folder: give the model before --recall-dir, "
                         f"or a folder after it")
    on = resolve_recall(kw["recall"], args.method)
    resolve_backend(args.backend, **cache_types(args), recall=on)
    if on and args.recall_dir is not None:
        check_spill_dir(args.recall_dir)


def _names_a_model(text: str) -> bool:
    """Whether ``text`` reads as a model (a .gguf path or a known name) rather than a folder: ``--recall-dir`` takes an
    optional folder, so one written just before the model swallows it."""
    from kvlocal.models.registry import KNOWN_MODELS

    return str(text).lower().endswith(".gguf") or str(text) in KNOWN_MODELS


def sampler_from_args(args, model=None):
    """The Sampler the flags ask for (``model``: whose own sampling an interactive command's unset flags take)."""
    from kvlocal.runtime import Sampler, SamplerParamError

    try:
        return Sampler(**sampling_params(args, model))
    except SamplerParamError as e:  # the parameters are named as the flags, with _ for -
        flag = "--" + e.param.replace("_", "-")
        rule = e.rule.replace("None (random)", "-1 (random)")
        raise UsageError(f"{flag} must be {rule} (got {e.value})") from None


def recall_args(args) -> dict:
    """``--recall``, ``--recall-mem``, ``--recall-dir``, ``--recall-steps`` → the Engine's and Chat's ``recall*``
    keywords."""
    from kvlocal.recall import recall_mem_setting

    mem = recall_mem_setting(args.recall_mem)
    if args.recall_dir is not None and args.recall == "off":
        raise UsageError("--recall-dir has no effect with --recall off: leave it out, or turn recall on")
    if args.recall_steps < 0:
        raise UsageError(f"--recall-steps {args.recall_steps} must be >= 0 (0: only the question re-selects the cache)")
    return dict(recall={"on": True, "off": False}.get(args.recall), recall_mem=mem, recall_dir=args.recall_dir,
                recall_steps=args.recall_steps)


def engine_from_args(args, model, max_tokens: int):
    from kvlocal.engine import Budget, Engine

    if args.chunk < 1 or args.recent < 1:
        raise UsageError("--chunk and --recent must be at least 1")
    budget = Budget.parse(args.budget)
    if max_tokens > model.n_ctx_train:
        print(f"kvlocal: warning: {max_tokens} tokens exceed the {model.n_ctx_train} the model was trained on; positions extrapolate",
              file=sys.stderr)
    return Engine(model, budget, args.method, max_tokens=max_tokens, chunk=args.chunk, recent=args.recent,
                  flash_attn=args.flash_attn, n_threads=args.threads, backend=args.backend, **cache_types(args),
                  **recall_args(args), **observe_args(args),
                  method_params=None if args.value_norm is None else {"value_norm": args.value_norm})


def observe_args(args) -> dict:
    """``--observe-every``, ``--prefill-observe``, ``--low-water`` → the Engine's and Chat's ``observe_every``,
    ``prefill_observe`` and ``low_water`` keywords: how a prompt's compression events are observed and how many
    they are."""
    return dict(observe_every=args.observe_every, prefill_observe=args.prefill_observe, low_water=args.low_water)


def check_value_norm(method: str) -> None:
    """UsageError unless ``method`` has CriticalKV's value norm to set (``--value-norm``)."""
    from kvlocal.compress import value_norm_refusal

    why = value_norm_refusal(method)
    if why:
        raise UsageError(f"--value-norm: --method {method} {why}, or leave --value-norm out")


def norm_args(args) -> dict:
    """``--value-norm`` → Chat's ``value_norm`` keyword (None: the engine's default, ``VALUE_NORM``)."""
    return dict(value_norm=args.value_norm)


def cache_types(args) -> dict:
    """``-ctk``/``-ctv`` → the Engine's ``type_k``/``type_v`` (ggml types; UsageError for an unknown name)."""
    from kvlocal.runtime import cache_type

    return dict(type_k=cache_type(args.cache_type_k), type_v=cache_type(args.cache_type_v))
