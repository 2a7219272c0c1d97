"""The settings a chat depends on, declared once.

Two frozen dataclasses, each field carrying its default, its check, its help text and its flag
(``dataclasses.field(metadata=...)``, :func:`setting`):

* :class:`ChatSettings` — what a chat's cache depends on (the budget, the method, the recall tier, the cache
  types, ...): saved in a session's header, compared with ``==`` when a saved conversation is restored, and
  what a server request may override is ``dataclasses.replace`` of the server's;
* :class:`RuntimeSettings` — how the model is loaded and run (GPU layers, threads, RPC servers): no part of a
  saved cache.

The command line's flags are generated from the fields (:func:`add_setting_args`) and read back into them
(:func:`chat_settings_from_args`, :func:`runtime_settings_from_args`); ``kvlocal.Chat``'s keywords are the
fields' names; the engine's keywords come from :meth:`ChatSettings.engine_keywords`. A value no chat can run with
is refused when the settings are made, by a :class:`~kvlocal.errors.SettingError` naming its field, which each
front door words as its user knows it (:func:`flag_name`: ``--budget``; the server: ``kv.budget``).

Sampling is declared by :class:`kvlocal.runtime.Sampler`'s own fields (:func:`kvlocal.options.add_sampling_args`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from kvlocal.engine.config import (LOW_WATER, OBSERVE_EVERY, PREFILL_OBSERVATIONS, PREFILL_OBSERVE, RECALL_STEPS,
                                   Budget, check_low_water, check_prefill_observe, check_read_cells)
from kvlocal.errors import SettingError, UsageError


def setting(default: Any = None, *, factory: Callable | None = None, flags: tuple[str, ...] = (),
            help: str | Callable[[], str] = "", section: str | None = None, request: bool = False,
            from_flag: Callable | None = None, json: tuple | None = None, **argparse_kw):
    """A settings field: its ``default``; the ``flags`` that set it on the command line, in ``section`` (``llama``:
    llama.cpp's flags, ``budget``: the cache's, None: a command adds it by name), with ``help`` (a function: the
    text is computed when the parser is built) and ``argparse_kw`` (type, choices, metavar, the flag's own
    default ...); ``from_flag``: the flag's value → the field's; ``request``: a server request may set it in its
    ``kv`` object, as JSON values that ``json`` pairs with the field's (None: the field's own); ``factory``: the
    default's maker, for a default whose module imports this one."""
    metadata = dict(flags=flags, help=help, section=section, request=request, from_flag=from_flag, json=json,
                    argparse=argparse_kw)
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _method_help() -> str:
    from kvlocal.compress import METHODS

    return f"{', '.join(METHODS)} (default criticalkv; docs/algorithms.md)"


def _recall_mem_help() -> str:
    from kvlocal.recall import default_recall_mem

    return (f"host RAM the recall tier may use (e.g. 2G; none: no cap; `serve`: one cap for all its conversations); "
            f"past it the oldest evicted rows are dropped, or with --recall-dir go to a file "
            f"(default: 1/8 of the memory, at most 4G: {default_recall_mem() / 2**30:.1f}G here)")


def _spill_dir() -> str:
    from kvlocal.recall import default_spill_dir

    return default_spill_dir()


def _value_norms() -> list[str]:
    from kvlocal.compress import VALUE_NORMS

    return list(VALUE_NORMS)


def read_cells_flag(value: str) -> int | str | None:
    """``--read-cells``: a number of cells, ``whole`` (None: no cap) or ``auto``."""
    word = value.strip().lower()
    if word in ("whole", "auto"):
        return None if word == "whole" else word
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give a number of cells, whole or auto") from None


def _loop_guard() -> int:
    from kvlocal.engine.loops import LOOP_GUARD

    return LOOP_GUARD


_TYPES = "f16, q8_0, q4_0, q4_1, q5_0, q5_1, bf16, f32"


@dataclass(frozen=True)
class ChatSettings:
    """What a chat's cache depends on; saved with a session and reused when it is loaded. Made, it is valid:
    the budget in its canonical text, cache types in lower case, ``recall_mem`` as
    :func:`kvlocal.recall.recall_mem_setting` gives it, ``recall_dir`` a str — so that two settings that mean the
    same compare equal (``kvlocal serve --session-dir``)."""

    budget: str = setting("0.1", flags=("--budget",), section="budget", request=True,
                          help="KV budget: a ratio in (0, 1] of the context (-c; `run`: of the prompt and -n) "
                               "(default 0.1), or a cell count like 2048")
    method: str = setting("criticalkv", flags=("--method",), section="budget", request=True, help=_method_help)
    ctx_size: int = setting(0, flags=("-c", "--ctx-size"), section="llama", type=int,
                            help="the tokens a ratio budget is sized from (default 0: the model's trained context); "
                                 "`run` refuses a longer prompt, a chat goes on past it in the same cells")
    chunk: int = setting(128, flags=("--chunk",), section="budget", type=int,
                         help="least prefill chunk in tokens: n_ctx = budget + chunk + recent, padded by llama.cpp "
                              "(default 128)")
    recent: int = setting(32, flags=("--recent", "--window"), section="budget", type=int,
                          help="the protected recent span: the newest tokens always kept, and the probe's length "
                               "(default 32; --window is its old name)")
    flash_attn: bool = setting(False, flags=("-fa", "--flash-attn"), section="llama", action="store_true",
                               help="use flash attention (off by default: slower for CPU decode)")
    system: str | None = setting(None, flags=("--system",), help="system message")
    max_reply: int = 512  # most tokens of one reply (each command's -n says it its own way)
    cache_type_k: str = setting("f16", flags=("-ctk", "--cache-type-k"), section="llama", metavar="TYPE",
                                help=f"KV cache type for K ({_TYPES}; default f16): compression runs on it, "
                                     f"evicting quantized rows as they are")
    cache_type_v: str = setting("f16", flags=("-ctv", "--cache-type-v"), section="llama", metavar="TYPE",
                                help="KV cache type for V (default f16; a quantized V turns flash attention on, as "
                                     "llama.cpp needs)")
    backend: str = setting("auto", flags=("--backend",), section="budget", choices=("auto", "native", "state"),
                           help="where compression runs: native = on the device that holds the cache (patched "
                                "llama.cpp; only the rows a method reads itself cross), state = K/V read to the host "
                                "and back; default auto: native when the model is offloaded to a GPU (-ngl), else "
                                "state")
    recall: bool | None = setting(None, flags=("--recall",), section="budget", request=True, default_flag="auto",
                                  choices=("on", "off", "auto"), from_flag={"on": True, "off": False}.get,
                                  json=((True, True), (False, False), ("auto", None)),
                                  help="the recall tier: rows evicted from the KV cache wait in host memory, and each "
                                       "new question brings back the ones it needs (default auto: on for the "
                                       "eviction methods, off for merging)")
    recall_mem: int | str | None = setting(None, flags=("--recall-mem",), section="budget", metavar="SIZE",
                                           help=_recall_mem_help)
    recall_dir: str | None = setting(None, flags=("--recall-dir",), section="budget", metavar="DIR", nargs="?",
                                     const=_spill_dir,
                                     help="past --recall-mem, the recall tier's rows go to a memory-mapped file in "
                                          "DIR instead of the oldest being dropped (DIR left out: %(const)s)")
    pin_system: bool = setting(True, flags=("--pin-system",), default_flag="on", choices=("on", "off"),
                               from_flag=lambda v: v == "on",
                               help="never evict the system message (default on; it counts in the budget)")
    observe_every: int = setting(OBSERVE_EVERY, flags=("--observe-every",), section="budget", type=int, metavar="N",
                                 help="prefill compression events one decode of the probe scores; between decodes its "
                                      "queries are moved to the new positions by RoPE (default %(default)s; "
                                      "docs/engine.md)")
    recall_steps: int = setting(RECALL_STEPS, flags=("--recall-steps",), section="budget", type=int, metavar="N",
                                help="the first N tokens of each answer re-select the cache too, each with its own "
                                     "query (default %(default)s; 0: only the question does; docs/recall.md)")
    value_norm: str | None = setting(None, flags=("--value-norm",), section="budget", choices=_value_norms,
                                     help="the norm of CriticalKV's projected values, |v·W_O|: l2 (the default: "
                                          "computed exactly at d/D of the work) or l1 (the paper's; equal quality "
                                          "measured: docs/engine.md)")
    low_water: float | None = setting(None, flags=("--low-water",), section="budget", type=float, metavar="F",
                                      help=f"the share of the budget a prompt's compression events leave before its "
                                           f"last one: fewer, larger events in the same memory (default {LOW_WATER} "
                                           f"with the recall tier, which keeps what they drop, 1 without; 1: every "
                                           f"event leaves the whole budget; docs/engine.md)")
    prefill_observe: str = setting(PREFILL_OBSERVE, flags=("--prefill-observe",), section="budget",
                                   choices=PREFILL_OBSERVATIONS,
                                   help="how a prompt's compression events before its last are scored: probe = the "
                                        "probe's queries (the question's, or a generic probe's; decoded once in "
                                        "--observe-every events), window = the queries of the chunk's own last "
                                        "tokens, no decode: cheaper, and it finds fewer facts (default %(default)s; "
                                        "docs/engine.md)")
    read_cells: int | str | None = setting("auto", flags=("--read-cells",), section="budget", type=read_cells_flag,
                                           metavar="N|whole|auto",
                                           help="read a turn longer than the free cells (a document) in a context of "
                                                "up to N cells in host memory, then compress it once: every row is "
                                                "computed over all the text before it, not over what earlier "
                                                "compressions left (whole: no cap; 0: in the budget's context, chunk "
                                                "by chunk; default auto: with the recall tier, as many cells as "
                                                "--recall-mem holds, else 0; docs/recall.md)")
    loop_guard: int = setting(factory=lambda: _loop_guard(), flags=("--loop-guard",), type=int, metavar="N",
                              help=lambda: f"end a reply once its last N tokens are one span repeated over and over "
                                           f"(default {_loop_guard()}; 0: off)")

    def __post_init__(self) -> None:
        for name, value in _normalized(self).items():
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, **keywords) -> "ChatSettings":
        """The settings with these fields (the rest at their defaults); the same as ``ChatSettings(**keywords)``,
        for the callers that read it as a conversion."""
        return cls(**keywords)

    def engine_keywords(self) -> dict:
        """The :class:`~kvlocal.engine.Engine` keywords these settings give (all but ``max_tokens``, ``n_threads``,
        ``endless`` and the tier's shared cap, which the caller knows): the one place the fields become the engine's
        — the cache types as ggml types, the value norm as the scorer's parameter where the method has one (a
        switch to another method keeps it for a switch back)."""
        from kvlocal.compress import value_norm_refusal
        from kvlocal.runtime import cache_type

        norm = self.value_norm and not value_norm_refusal(self.method)
        return dict(budget=self.budget, method=self.method, chunk=self.chunk, recent=self.recent,
                    flash_attn=self.flash_attn, type_k=cache_type(self.cache_type_k),
                    type_v=cache_type(self.cache_type_v), backend=self.backend, recall=self.recall,
                    recall_mem=self.recall_mem, recall_dir=self.recall_dir, recall_steps=self.recall_steps,
                    observe_every=self.observe_every, low_water=self.low_water, prefill_observe=self.prefill_observe,
                    read_cells=self.read_cells,
                    method_params={"value_norm": self.value_norm} if norm else None)


def _normalized(s: ChatSettings) -> dict:
    """The fields of ``s`` in their canonical forms; SettingError, naming the field and the fix, for a value no chat
    can run with (before any model loads)."""
    from kvlocal.compress import VALUE_NORMS
    from kvlocal.engine.loops import LoopGuard
    from kvlocal.recall import recall_mem_setting
    from kvlocal.runtime import cache_type

    if s.ctx_size < 0:
        raise SettingError(f"{{ctx_size}} {s.ctx_size}: give a number of tokens, or 0 for the model's trained context",
                           "ctx_size")
    if s.observe_every < 1:
        raise SettingError(f"{{observe_every}} {s.observe_every}: give at least 1 (1: the probe is decoded for every "
                           f"event)", "observe_every")
    if s.low_water is not None:
        check_low_water(s.low_water)
    if s.value_norm is not None:
        if s.value_norm not in VALUE_NORMS:
            raise SettingError(f"{{value_norm}} {s.value_norm!r}: give one of {', '.join(VALUE_NORMS)}", "value_norm")
    from kvlocal.engine.config import resolve_recall

    try:
        resolve_recall(s.recall, s.method)  # an unknown method; recall with a merging one
    except SettingError:
        raise
    except UsageError as e:
        raise SettingError(str(e), "method") from None
    recall_mem = recall_mem_setting(s.recall_mem)
    if s.recall_dir is not None and s.recall is False:
        raise SettingError("{recall_dir} has no effect with {recall} off: leave it out, or turn recall on", "recall_dir")
    if s.recall_steps < 0:
        raise SettingError(f"{{recall_steps}} {s.recall_steps} must be >= 0 (0: only the question re-selects the "
                           f"cache)", "recall_steps")
    if s.chunk < 1 or s.recent < 1:
        raise SettingError("{chunk} and {recent} must be at least 1", "chunk" if s.chunk < 1 else "recent")
    for name in ("cache_type_k", "cache_type_v"):
        try:
            cache_type(getattr(s, name))
        except UsageError as e:
            raise SettingError(str(e), name) from None
    check_prefill_observe(s.prefill_observe)
    check_read_cells(s.read_cells)
    try:
        LoopGuard(s.loop_guard)
    except ValueError as e:
        raise SettingError(f"{{loop_guard}} {e}", "loop_guard") from None
    return dict(budget=str(Budget.parse(s.budget)), cache_type_k=s.cache_type_k.lower(),
                cache_type_v=s.cache_type_v.lower(), recall_mem=recall_mem,
                recall_dir=None if s.recall_dir is None else os.fspath(s.recall_dir))


def check_value_norm(s: ChatSettings) -> ChatSettings:
    """``s``, or SettingError where it asks for a value norm its method has none of: a refusal of what a user asks
    for (the scorer refuses it too, but only once a model is loaded), not of settings a chat holds — a chat switched
    to such a method keeps its norm for a switch back (:meth:`kvlocal.Chat.reconfigure`)."""
    from kvlocal.compress import value_norm_refusal

    why = s.value_norm is not None and value_norm_refusal(s.method)
    if why:
        raise SettingError(f"{{value_norm}}: {{method}} {s.method} {why}, or leave {{value_norm}} out", "value_norm")
    return s


def _host_ports(text) -> tuple[str, ...]:
    """``--rpc``'s ``HOST:PORT[,HOST:PORT...]`` (llama.cpp's syntax; a tuple or list of them too) → a tuple, as
    :func:`kvlocal.runtime.rpc.parse_endpoints` reads it; SettingError naming the field."""
    from kvlocal.runtime import parse_endpoints

    try:
        return parse_endpoints(text)
    except UsageError as e:  # its text names the flag: the field instead, each front door words it
        raise SettingError(str(e).replace("--rpc", "{rpc}", 1), "rpc") from None


def _split(text) -> tuple[float, ...]:
    """``--tensor-split``'s proportions, llama.cpp's syntax (``3,1`` or ``3/1``; a tuple or list too) → a tuple."""
    items = text.replace("/", ",").split(",") if isinstance(text, str) else list(text)
    try:
        out = tuple(float(x) for x in items)
    except (TypeError, ValueError):
        out = ()
    if not out or any(not x >= 0 for x in out) or not sum(out) > 0:
        raise SettingError(f"{{tensor_split}} {text!r}: give each device's share, e.g. 3,1", "tensor_split")
    return out


@dataclass(frozen=True)
class RuntimeSettings:
    """How the model is loaded and run: no part of a saved cache (a session loads with other ones)."""

    n_gpu_layers: int = setting(0, flags=("-ngl", "--n-gpu-layers"), section="llama", type=int,
                                help="layers to offload to the GPU (default 0; -1: all, as in llama-cpp-python)")
    n_threads: int | None = setting(None, flags=("-t", "--threads"), section="llama", type=int, dest="threads",
                                    help="CPU threads (default: cores, at most 8)")
    rpc: tuple[str, ...] = setting((), flags=("--rpc",), section="llama", metavar="HOST:PORT[,HOST:PORT...]",
                                   default_flag=None, from_flag=lambda v: () if v is None else v,
                                   help="offload to llama.cpp RPC servers (`rpc-server`), as llama.cpp's --rpc "
                                        "(with -ngl)")
    tensor_split: tuple[float, ...] = setting((), flags=("-ts", "--tensor-split"), section="llama", metavar="SPLIT",
                                              default_flag=None, from_flag=lambda v: () if v is None else v,
                                              help="how the offloaded layers divide between devices, as llama.cpp's "
                                                   "--tensor-split: proportions like 3,1 (default: by free memory)")

    def __post_init__(self) -> None:
        if self.n_gpu_layers < -1:
            raise SettingError(f"{{n_gpu_layers}} {self.n_gpu_layers}: give a number of layers, 0 for none or -1 for "
                               f"all", "n_gpu_layers")
        if self.n_threads is not None and self.n_threads < 1:
            raise SettingError(f"{{n_threads}} {self.n_threads}: give at least 1 (default: the cores, at most 8)",
                               "n_threads")
        object.__setattr__(self, "rpc", _host_ports(self.rpc) if self.rpc else ())
        object.__setattr__(self, "tensor_split", _split(self.tensor_split) if self.tensor_split else ())

    def model_keywords(self) -> dict:
        """:class:`~kvlocal.runtime.Model`'s keywords: ``rpc`` and ``tensor_split`` only where set (a runtime
        without them loads every other model as before)."""
        kw: dict = dict(n_gpu_layers=self.n_gpu_layers)
        if self.rpc:
            kw["rpc"] = self.rpc
        if self.tensor_split:
            kw["tensor_split"] = self.tensor_split
        return kw

    def load(self, path):
        """The model at ``path``, loaded as these settings say."""
        from kvlocal.runtime import Model

        return Model(path, **self.model_keywords())


# -- the command line ---------------------------------------------------------------------------------------
SETTINGS = (ChatSettings, RuntimeSettings)


def _fields():
    """Every settings field, with the class it belongs to."""
    return [(cls, f) for cls in SETTINGS for f in dataclasses.fields(cls)]


def _field(name: str) -> dataclasses.Field:
    for _, f in _fields():
        if f.name == name:
            return f
    raise KeyError(name)


def _dest(f: dataclasses.Field) -> str:
    return f.metadata.get("argparse", {}).get("dest", f.name)


def flag_name(name: str) -> str:
    """How the command line calls the setting ``name``: ``-c/--ctx-size``, ``--budget``; a name with no flag as
    it is. :func:`kvlocal.errors.worded` takes it to word an error for the command line."""
    try:
        flags = _field(name).metadata.get("flags", ())
    except KeyError:
        return name
    if not flags:
        return name
    return f"{flags[0]}/{flags[1]}" if not flags[0].startswith("--") and len(flags) > 1 else flags[0]


def add_setting_args(p, section: str | None = None, names: tuple[str, ...] = ()) -> None:
    """The flags of the settings in ``section`` (``llama``, ``budget``), or of the fields ``names``, to the parser
    (or argument group) ``p``: as the fields declare them."""
    for _, f in _fields():
        m = f.metadata
        if not m.get("flags") or not (f.name in names or (section is not None and m.get("section") == section)):
            continue
        kw = dict(m["argparse"])
        default = kw.pop("default_flag", f.default if f.default is not dataclasses.MISSING else f.default_factory())
        kw.setdefault("dest", f.name)
        for key in ("choices", "const"):
            if callable(kw.get(key)):
                kw[key] = kw[key]()
        help_text = m["help"]() if callable(m["help"]) else m["help"]
        p.add_argument(*m["flags"], default=default, help=help_text, **kw)


def _from_args(cls, args: argparse.Namespace, **extra):
    values = {}
    for f in dataclasses.fields(cls):
        dest = _dest(f)
        if f.metadata.get("flags") and hasattr(args, dest):
            value = getattr(args, dest)
            convert = f.metadata.get("from_flag")
            values[f.name] = convert(value) if convert else value
    return cls(**{**values, **extra})


def chat_settings_from_args(args: argparse.Namespace, **extra) -> ChatSettings:
    """The chat settings a command's flags give (those it has; ``extra``: fields it sets its own way, e.g.
    ``max_reply`` from its ``-n``); SettingError, naming the field, for a value no chat can run with."""
    return check_value_norm(_from_args(ChatSettings, args, **extra))


def runtime_settings_from_args(args: argparse.Namespace) -> RuntimeSettings:
    """The runtime settings a command's flags give (-ngl, -t, --rpc, --tensor-split)."""
    return _from_args(RuntimeSettings, args)


def request_fields() -> dict[str, tuple | None]:
    """The settings a server request may give in its ``kv`` object: name → the (JSON value, field value) pairs it
    takes (None: the field's own values)."""
    return {f.name: f.metadata["json"] for f in dataclasses.fields(ChatSettings) if f.metadata.get("request")}
