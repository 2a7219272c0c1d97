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
    """Flags named as in llama.cpp's own tools: the settings of the ``llama`` section (:mod:`kvlocal.settings`)."""
    from kvlocal.settings import add_setting_args

    add_setting_args(p, "llama")


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """The cache's flags: the settings of the ``budget`` section (:mod:`kvlocal.settings`)."""
    from kvlocal.settings import add_setting_args

    add_setting_args(p, "budget")


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
        from kvlocal.settings import add_setting_args

        add_setting_args(g, names=("loop_guard",))


def check_loop_guard(args) -> None:
    """SettingError, naming the fix, for a ``--loop-guard`` the guard cannot take."""
    from kvlocal.settings import ChatSettings

    ChatSettings(loop_guard=args.loop_guard)


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
    """SettingError, naming the field (the command line words it as the flag), for settings no model can run with,
    before anything loads: the settings the flags give, made (:mod:`kvlocal.settings` checks them), and the
    refusals of ``--recall*``, ``--method`` and ``--backend`` that need no model."""
    from kvlocal.settings import chat_settings_from_args, runtime_settings_from_args

    runtime_settings_from_args(args)
    if hasattr(args, "method"):
        check_recall_args(args, chat_settings_from_args(args))


def check_recall_args(args, s) -> None:
    """The refusals of ``--recall*``, ``--method`` and ``--backend`` (settings ``s``) that need no model."""
    from kvlocal.engine import resolve_recall
    from kvlocal.recall import check_spill_dir
    from kvlocal.backends import resolve_backend

    if s.recall_dir is not None and _names_a_model(s.recall_dir):
        raise UsageError(f"--recall-dir took {s.recall_dir} as its folder: give the model before --recall-dir, "
                         f"or a folder after it")
    on = resolve_recall(s.recall, s.method)
    kw = s.engine_keywords()
    resolve_backend(s.backend, kw["type_k"], kw["type_v"], recall=on)
    if on and s.recall_dir is not None:
        check_spill_dir(s.recall_dir)


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


def settings_from_args(args, **extra):
    """(the runtime settings, the chat settings) the flags give, checked (:func:`check_llama_args`); ``extra``: the
    chat settings a command sets its own way (``max_reply`` from its ``-n``)."""
    from kvlocal.settings import chat_settings_from_args, runtime_settings_from_args

    runtime = runtime_settings_from_args(args)
    settings = chat_settings_from_args(args, **extra)
    check_recall_args(args, settings)
    return runtime, settings


def engine_from_args(args, model, max_tokens: int):
    """``kvlocal run``'s engine: the flags' settings, given to the engine as a chat gives them
    (:meth:`kvlocal.engine.Engine.from_settings`: the value norm among them, the same way)."""
    from kvlocal.engine import Engine

    runtime, settings = settings_from_args(args)
    if max_tokens > model.n_ctx_train:
        print(f"kvlocal: warning: {max_tokens} tokens exceed the {model.n_ctx_train} the model was trained on; positions extrapolate",
              file=sys.stderr)
    return Engine.from_settings(model, settings, max_tokens=max_tokens, n_threads=runtime.n_threads)
