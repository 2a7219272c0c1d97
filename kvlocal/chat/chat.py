"""The Python API: a chat with a GGUF model inside a fixed KV-cache budget.

    import kvlocal

    with kvlocal.Chat("qwen2.5-coder-0.5b", budget=0.1) as chat:
        chat.read("report.txt")                 # a long document: read whole, then compressed
        for piece in chat.send("Who signed it?"):
            print(piece, end="", flush=True)
        print(chat.status_line())
        chat.save("report.kvl")                 # the compressed cache and the transcript

    chat = kvlocal.Chat.load("report.kvl")      # a new process: the identical next (greedy) reply

A chat never ends for length: a ratio budget is sized from ``ctx_size`` (default: the model's trained
context), and past it the engine goes on in the same cells; whenever positions would pass the trained
context they are moved back under it (``kvlocal.engine.positions.reposition``: old cells renumbered in order, the recent
span shifted as a block, keys re-rotated by llama.cpp's K-shift).

Thread-safety: a Chat serializes its calls with a lock — a call from a second thread waits until the
first one (a reply: until its iterator is exhausted or closed) is done. One Chat holds one llama.cpp
context; use one per conversation, or a pool (``kvlocal serve`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from kvlocal.version import __version__
from kvlocal.chat import saved
from kvlocal.engine import Engine, EngineState
from kvlocal.engine.undo import TurnMark
from kvlocal.errors import UsageError
from kvlocal.recall import TierMemory
from kvlocal.backends import RowRecord
from kvlocal.runtime import Model, Sampler, chat_sampling, runtime_info
from kvlocal.settings import ChatSettings, RuntimeSettings, check_value_norm
from kvlocal.chat.turns import Turns, Transcript
from kvlocal.chat.texts import full_cache_text, mib_text, rate_text
from kvlocal.chat.toolcalls import CallFilter, check_tool_choice, check_tools, forced_prefix

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ChatStats:
    tokens_seen: int  # every token of the conversation, documents included
    kv_tokens_kept: int  # cells of the full-attention cache holding tokens now
    kv_cells_allocated: int  # llama.cpp's n_ctx
    budget_cells: int
    kv_bytes: int  # K/V bytes llama.cpp allocated for this chat (both caches of a sliding-window model)
    kv_bytes_full: int  # what llama.cpp's own cache allocates for ctx_size (for tokens_seen, once they are more)
    ctx_size: int  # the context the chat is sized for (-c; default the model's trained context)
    host_tier_bytes: int  # the recall tier's host memory (0 with recall off)
    kv_cells_pinned: int  # cells of the system message, never evicted
    compression_events: int
    repositions: int  # times positions were moved back under the trained context
    rollback_bytes: int  # host bytes copied so that the latest turn could be undone (0 while it runs no event)
    rollback_bytes_total: int  # the same for every turn so far
    prompt_tokens_per_s: float  # the last turn (or read) alone
    gen_tokens_per_s: float
    method: str
    budget: str


class Chat:
    """A conversation with a model in a bounded KV cache; see the module docstring."""

    def __init__(self, model: str | os.PathLike | Model | None = None, budget: str | float | int | None = None,
                 method: str | None = None, *, sampler: Sampler | None = None, n_gpu_layers: int = 0,
                 n_threads: int | None = None, rpc: str | tuple[str, ...] = (), tensor_split=None,
                 tools: list[dict] | None = None, settings: ChatSettings | None = None,
                 runtime: RuntimeSettings | None = None, **options):
        """``model``: a path, a known name or a loaded :class:`~kvlocal.runtime.Model`; the chat's settings are
        ``settings`` (:class:`~kvlocal.settings.ChatSettings`) or its fields as keywords (``budget``, ``method``,
        ``system``, ``ctx_size``, ``recall``, ``max_reply``, ...; the rest at their defaults), checked before a
        model loads; ``recall_mem`` may be a :class:`~kvlocal.recall.TierMemory`, a cap shared with other chats
        (a server's conversations; the settings keep its limit). ``runtime`` (or ``n_gpu_layers``, ``n_threads``,
        ``rpc`` — ``"host:port,..."`` of ``kvlocal rpc-server``s, docs/distributed.md — and ``tensor_split``): how a
        model given by name loads and runs."""
        if budget is not None:
            options["budget"] = budget
        if method is not None:
            options["method"] = method
        memory = options.get("recall_mem")
        self._recall_memory = memory if isinstance(memory, TierMemory) else None
        if settings is None:
            unknown = sorted(set(options) - {f.name for f in dataclasses.fields(ChatSettings)})
            if unknown:
                raise TypeError(f"Chat() got an unexpected keyword argument {unknown[0]!r}")
            settings = check_value_norm(ChatSettings(**options))  # SettingError, naming the field, before a model loads
        elif set(options) - {"recall_mem"}:
            raise TypeError(f"Chat() takes settings= or its fields as keywords, not both: {sorted(options)}")
        elif "recall_mem" in options:  # the tier's cap instead of the one in the settings
            settings = dataclasses.replace(settings, recall_mem=memory)
        runtime = runtime or RuntimeSettings(n_gpu_layers=n_gpu_layers, n_threads=n_threads, rpc=rpc,
                                             tensor_split=tensor_split)
        system, loop_guard = settings.system, settings.loop_guard
        if isinstance(model, Model):
            self.model, self._own_model = model, False
        else:
            from kvlocal.models import resolve

            self.model, self._own_model = runtime.load(resolve(None if model is None else str(model))), True
        self._lock = threading.RLock()
        self.sampler = sampler or Sampler(**chat_sampling(self.model))
        self._threads = runtime.n_threads
        self._before_turn: tuple | None = None  # for regen: (mark, transcript, messages sent, tool_choice)
        self._rollback_before = 0  # the engine's rollback_bytes when the latest turn began
        self._turn_rates = (0.0, 0.0)
        self.tool_calls: list[dict] = []  # the calls of the last reply (OpenAI's shape), with ``tools``
        try:
            if tools:
                tools = check_tools(tools)
                if self.tool_format is None:
                    raise UsageError(f"the chat template of {self.model.path.name} does not take tools: "
                                     f"use a model whose template does (e.g. Qwen2.5), or leave tools out")
            self.settings = settings
            self.engine = self._new_engine(settings)
            self.turns = Turns(self.engine, self.sampler, system=system, pin_system=settings.pin_system,
                                       tools=tools, loop_guard=loop_guard)
        except BaseException:
            self.close()
            raise

    # -- conversation ---------------------------------------------------------------------------------
    def send(self, message: str | dict | list[dict], max_tokens: int | None = None, progress: Progress | None = None,
             tool_choice: str | dict = "auto") -> Iterator[str]:
        """Add a user message — text, or ``{"role": "user"|"tool", "content": ..., "tool_call_id": ...}`` messages
        (the results of the last reply's :attr:`tool_calls`) — and stream the reply's text (lazily: nothing
        happens until iterated). With ``tools``, the calls the reply makes are not in the text: they are in
        :attr:`tool_calls` once the reply is read (``tool_choice``: ``"auto"``, ``"required"``, ``{"type":
        "function", "function": {"name": ...}}`` to make the reply a call, ``"none"`` to take none out).
        Ctrl-C — or any exception, e.g. one raised by ``progress(done, total)`` to cancel — while the
        message is read leaves the chat as it was; during the reply, the reply so far stays."""
        new = _new_messages(message)
        prefix, fmt = self._tool_choice(tool_choice)
        with self._lock:
            with self._turn(keep=True) as before:  # reading the message: undone if interrupted
                reply = self.turns.ask(new, max_tokens or self.settings.max_reply, progress, prefix=prefix)
            self._hold_turn((*before, new, tool_choice))  # its mark stays open through the reply, for regen
            self.tool_calls = []
            s0 = dataclasses.replace(self.engine.stats)
            try:
                if fmt is None:
                    yield from reply  # a reply stopped early stays
                    return
                calls = CallFilter(fmt, self._tool_names)
                self.tool_calls = calls.calls  # filled as the calls end
                shown: list[str] = []
                try:
                    for piece in reply:
                        piece = calls.feed(piece)
                        if piece:
                            shown.append(piece)
                            yield piece
                    rest = calls.finish()
                    if rest:
                        shown.append(rest)
                        yield rest
                finally:
                    if calls.calls:  # kept with the reply's text (which the cache holds as the model wrote it)
                        self.turns.t.messages[-1].update(calls=list(calls.calls), shown="".join(shown))
            finally:
                self._note_rates(s0)

    def complete(self, prompt: str, max_tokens: int | None = None, progress: Progress | None = None) -> Iterator[str]:
        """Plain text completion, without the chat template: read ``prompt`` and stream its continuation (lazily).
        A later prompt that begins with everything read so far (the earlier prompt and its continuation)
        reads only the rest. A chat used this way holds text, not messages (a chat with a system message or
        messages refuses it). Interrupted while the prompt is read, the chat stays as it was."""
        if not isinstance(prompt, str) or not prompt:
            raise UsageError("the prompt is empty")
        with self._lock:
            with self._turn():
                reply = self.turns.complete(prompt, max_tokens or self.settings.max_reply, progress)
            self._hold_turn(None)
            s0 = dataclasses.replace(self.engine.stats)
            try:
                yield from reply
            finally:
                self._note_rates(s0)

    @property
    def text(self) -> str:
        """Everything the cache has read, as text: the rendered conversation (or a plain completion's prompt
        and continuation)."""
        return self.turns.t.fed_text

    @property
    def tool_format(self) -> str | None:
        """How this model writes tool calls (:attr:`kvlocal.runtime.Model.tool_format`)."""
        return self.model.tool_format

    def _tool_choice(self, choice) -> tuple[str, str | None]:
        """(the reply's forced beginning, the format its calls are taken out in) for a ``tool_choice``."""
        choice = check_tool_choice(choice, self.tools)
        if choice == "none" or not self.tools:
            return "", None
        if choice == "auto":
            return "", self.tool_format
        return forced_prefix(self.tool_format, choice["function"]["name"] if isinstance(choice, dict) else None), self.tool_format

    def ask(self, message: str | dict | list[dict], max_tokens: int | None = None, tool_choice: str | dict = "auto") -> str:
        """:meth:`send`, returning the whole reply's text."""
        return "".join(self.send(message, max_tokens, tool_choice=tool_choice))

    def read(self, source: str | os.PathLike, name: str | None = None, progress: Progress | None = None) -> int:
        """Read a document (a path to a text file, or the text itself) into the cache now; it opens the next
        user message, and the next :meth:`send` asks about it. Returns its tokens. Ctrl-C cancels it."""
        text, name = _document(source, name)
        with self._turn():
            return self.turns.read(text, name=name, progress=progress)

    def extend(self, messages: list[dict], progress: Progress | None = None) -> int:
        """Add an earlier conversation's finished messages (``{"role": "user"|"assistant"|"tool", "content": ...}``,
        an assistant's calls in ``tool_calls``) to the cache without generating, e.g. to continue a chat kept
        elsewhere. Returns the tokens read."""
        for m in messages:
            ok = isinstance(m, dict) and m.get("role") in ("user", "assistant", "tool")
            if not ok or not (isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls"))):
                raise UsageError(f"a message must be {{'role': 'user', 'assistant' or 'tool', 'content': str}}, got {m!r:.80}")
        with self._turn():
            return self.turns.extend(messages, progress)

    def regen(self, max_tokens: int | None = None) -> Iterator[str]:
        """Take back the last reply and generate it again (another draw when sampling)."""
        with self._lock:
            self._check_open()
            if self._before_turn is None:
                raise UsageError("nothing to regenerate yet: send a message first")
            mark, transcript, new, tool_choice = self._before_turn
            self._rollback(mark, transcript)
            self._before_turn = None
        return self.send(new, max_tokens, tool_choice=tool_choice)

    def clear(self) -> None:
        """Start over: an empty cache and transcript (the system message stays)."""
        with self._lock:
            self._check_open()
            self._replace_engine(self.settings, Transcript(self.turns.t.messages[:1] if self.settings.system else [],
                                                           tools=self.turns.t.tools))

    def reconfigure(self, budget: str | float | int | None = None, method: str | None = None,
                    progress: Progress | None = None) -> None:
        """Change the budget or method: the conversation so far is read again into a new cache (the old
        one stays if that fails or is interrupted)."""
        with self._lock:
            self._check_open()
            settings = dataclasses.replace(self.settings, budget=self.settings.budget if budget is None else budget,
                                           method=method or self.settings.method)
            self._replace_engine(settings, self.turns.t.copy(), progress)

    @property
    def sampler(self) -> Sampler:
        """How the next replies pick tokens (default: greedy); may be replaced between replies."""
        return self._sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        with self._lock:
            self._sampler = sampler
            if getattr(self, "turns", None) is not None:
                self.turns.sampler = sampler

    # -- figures --------------------------------------------------------------------------------------
    @property
    def messages(self) -> list[dict]:
        """The conversation: with tools, an assistant message's calls are in its ``tool_calls`` (as
        :attr:`tool_calls` gave them), not in its text."""
        with self._lock:
            out = []
            for m in self.turns.t.messages:
                m = dict(m)
                calls, shown = m.pop("calls", None), m.pop("shown", "")
                if calls:
                    m["content"], m["tool_calls"] = shown, calls
                out.append(m)
            return out

    @property
    def tools(self) -> list[dict] | None:
        """The tool definitions the model sees with every prompt (None: none)."""
        return self.turns.t.tools

    @property
    def _tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.turns.t.tools or ()}

    @property
    def stats(self) -> ChatStats:
        with self._lock:
            s, f = self.engine.stats, self.engine.kv_figures()
            return ChatStats(
                tokens_seen=f["tokens_seen"], kv_tokens_kept=f["tokens_kept"], kv_cells_allocated=s.n_ctx,
                budget_cells=f["budget_cells"], kv_bytes=f["kv_bytes"], kv_bytes_full=f["kv_bytes_full"],
                ctx_size=f["ctx_size"], host_tier_bytes=f["host_tier_bytes"], kv_cells_pinned=s.kv_cells_pinned,
                compression_events=s.compression_events, repositions=s.repositions,
                rollback_bytes=s.rollback_bytes - self._rollback_before, rollback_bytes_total=s.rollback_bytes,
                prompt_tokens_per_s=self._turn_rates[0], gen_tokens_per_s=self._turn_rates[1],
                method=self.settings.method, budget=self.settings.budget)

    def status_line(self) -> str:
        """llama-cli's kind of summary: ``[ prompt 312 t/s | gen 41 t/s | KV 819 of 6,012 tokens kept in 23 MiB
        (llama.cpp's cache at -c 8192: 180 MiB) ]`` — the tokens the cache holds of those the chat has seen, the memory this cache
        allocated, and what llama.cpp's own cache allocates for the same context (for every token seen, past it).
        A rate not measured yet (nothing generated so far) is a dash."""
        s = self.stats
        return (f"[ prompt {rate_text(s.prompt_tokens_per_s)} t/s | gen {rate_text(s.gen_tokens_per_s)} t/s | "
                f"KV {s.kv_tokens_kept:,} of {s.tokens_seen:,} tokens kept in {mib_text(s.kv_bytes)} "
                f"({full_cache_text(s)})"
                + (f" · recall tier {mib_text(s.host_tier_bytes)}" if s.host_tier_bytes else "")
                + (f" · positions moved ×{s.repositions}" if s.repositions else "") + " ]")

    @property
    def finish_reason(self) -> str | None:
        """How the last reply ended: ``"stop"`` (the model ended it), ``"length"`` (its token limit), ``"loop"``
        (the loop guard ended a reply that kept repeating one span: ``loop_guard``), ``"tool_calls"`` (it made
        tool calls, whatever else ended it); None before any reply, or for one its reader stopped without calls
        (Ctrl-C, a closed iterator, a stop string)."""
        return "tool_calls" if self.tool_calls else self.turns.finish

    # -- saving ---------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> int:
        """Write the compressed cache, the transcript and the settings to one file; returns its bytes."""
        with self._lock:
            self._check_open()
            st = self.engine.snapshot()
            info = runtime_info()
            header = {
                "kind": "kvlocal chat session", "kvlocal": __version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "model": {"file": self.model.path.name, "path": str(self.model.path.resolve()),
                          "fingerprint": saved.model_fingerprint(self.model.path)},
                "runtime": {"llama_cpp_python": info.version, "patch_abi": info.patch_abi},
                "settings": dataclasses.asdict(self.settings),
                "transcript": dataclasses.asdict(self.turns.t),
                "engine": {"n_past": st.n_past, "last_token": st.last_token, "settled": st.settled,
                           "probe": st.probe, "reply": st.reply, "stats": st.stats},
            }
            r = st.record
            arrays = {"state": st.blob, "slot_pos": r.pos, "slot_true": r.true, "slot_vnorm": r.vnorm, "slot_count": r.count}
            if st.logits is not None:
                arrays["logits"] = st.logits
            if self.engine.tier is not None:  # the recall tier: every evicted row, so the next question finds them
                arrays.update(self.engine.tier.to_arrays())
            return saved.write(path, header, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, model: str | os.PathLike | Model | None = None, *,
             sampler: Sampler | None = None, n_gpu_layers: int = 0, n_threads: int | None = None,
             recall_mem: int | str | TierMemory | None = None) -> "Chat":
        """A chat from a :meth:`save` file, in this or another process. ``model``: the model it was saved
        with (default: the path recorded in the file); ``recall_mem``: the tier's cap instead of the saved one.
        Refused with UsageError — and nothing built — for another model, another runtime build, a truncated, edited
        or newer file."""
        f = saved.read(path)
        h = f.header
        if h.get("kind") != "kvlocal chat session":
            raise UsageError(f"{path} is not a kvlocal chat session")
        if model is None:
            model = h["model"]["path"]
            if not Path(model).is_file():
                raise UsageError(f"{path} was saved with {model}, which is gone: pass the model file (--model / model=)")
        model_path = model.path if isinstance(model, Model) else None
        if model_path is None:
            from kvlocal.models import resolve

            model_path = resolve(str(model), pull_missing=False)
        if saved.model_fingerprint(model_path) != h["model"]["fingerprint"]:
            raise UsageError(f"{path} was saved with {h['model']['file']}, and {Path(model_path).name} is another model: "
                             f"load it with the model it was saved with")
        info, rt = runtime_info(), h["runtime"]
        if (info.version, info.patch_abi) != (rt["llama_cpp_python"], rt["patch_abi"]):
            raise UsageError(f"{path} was saved on llama-cpp-python {rt['llama_cpp_python']} (kvlocal ABI {rt['patch_abi']}), "
                             f"this runtime is {info.version} (ABI {info.patch_abi}): its cache format differs; "
                             f"load it where it was saved")
        settings = dict(h["settings"])
        if "window" in settings:  # sessions saved before the recent span had its own name
            settings["recent"] = settings.pop("window")
        s = ChatSettings(**settings)
        chat = cls(model if isinstance(model, Model) else model_path, settings=s, sampler=sampler,
                   runtime=RuntimeSettings(n_gpu_layers=n_gpu_layers, n_threads=n_threads),
                   **({} if recall_mem is None else {"recall_mem": recall_mem}))
        try:
            a, e = f.arrays, h["engine"]
            if chat.engine.tier is not None and "tier_n" in a:
                chat.engine.tier.load_arrays(a)
            chat.engine.restore(EngineState(
                blob=a["state"], n_past=e["n_past"], last_token=e["last_token"], logits=a.get("logits"),
                record=RowRecord(a["slot_pos"], a["slot_true"], a["slot_vnorm"], a["slot_count"]),
                tier_mark=a.get("tier_n"), settled=e["settled"], probe=e["probe"], reply=e["reply"], stats=e["stats"]))
            chat.turns.t = Transcript(**h["transcript"])
            chat._rollback_before = chat.engine.stats.rollback_bytes  # no turn of this chat's yet
        except BaseException:
            chat.close()
            raise
        return chat

    # -- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the llama.cpp context (and the model, if this chat loaded it). Idempotent."""
        with self._lock:
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.close()
                self.engine = None
            if self._own_model and getattr(self, "model", None) is not None:
                self.model.close()
            self.model = None if self._own_model else self.model

    def __enter__(self) -> "Chat":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if getattr(self, "engine", None) is None:
            raise UsageError("this chat is closed")

    def _new_engine(self, s: ChatSettings) -> Engine:
        return Engine.from_settings(self.model, s, max_tokens=s.ctx_size or self.model.n_ctx_train,
                                    n_threads=self._threads, endless=s.method != "full", recall_mem=self._recall_memory)

    def _checkpoint(self) -> tuple[TurnMark, Transcript]:
        """Where a turn begins: the engine's mark (nothing copied unless an event runs before it is closed:
        :mod:`kvlocal.engine.undo`) and the transcript."""
        self._rollback_before = self.engine.stats.rollback_bytes
        return self.engine.mark(), self.turns.t.copy()

    def _rollback(self, mark: TurnMark, transcript: Transcript) -> None:
        self.engine.undo(mark)
        self.turns.t = transcript.copy()

    def _hold_turn(self, before_turn: tuple | None) -> None:
        """Keep ``before_turn`` for regen, closing the mark held before."""
        if self._before_turn is not None:
            self.engine.release(self._before_turn[0])
        self._before_turn = before_turn

    @contextlib.contextmanager
    def _turn(self, keep: bool = False):
        """Feed the cache under the lock: a mark before (yielded), undone if the feeding is interrupted (Ctrl-C),
        refused or cancelled (any exception), else closed unless ``keep`` (the caller holds it); the speeds of what
        was read after."""
        with self._lock:
            self._check_open()
            before = self._checkpoint()
            s0 = dataclasses.replace(self.engine.stats)
            try:
                yield before
            except BaseException:
                with contextlib.suppress(Exception):  # an engine that lost its cache cannot be restored
                    self._rollback(*before)
                raise
            if not keep:
                self.engine.release(before[0])
            self._note_rates(s0)

    def _note_rates(self, s0) -> None:
        s = self.engine.stats
        dp, dg = s.prompt_tokens - s0.prompt_tokens, s.generated_tokens - s0.generated_tokens
        tp, tg = s.prefill_seconds - s0.prefill_seconds, s.decode_seconds - s0.decode_seconds
        prompt, gen = self._turn_rates  # a read generates nothing: the last reply's rate stays
        self._turn_rates = (dp / tp if dp and tp > 0 else prompt, dg / tg if dg and tg > 0 else gen)

    def _replace_engine(self, settings: ChatSettings, transcript: Transcript, progress: Progress | None = None) -> None:
        """A new engine holding ``transcript`` (read again), swapped in only when it is complete."""
        engine = self._new_engine(settings)
        try:
            turns = Turns(engine, self.sampler, pin_system=settings.pin_system, loop_guard=settings.loop_guard)
            turns.t = transcript
            if transcript.fed_text:
                users = [m["content"] for m in transcript.messages if m["role"] == "user"]
                tokens = self.model.tokenize(transcript.fed_text, add_special=True, parse_special=True)
                probe = self.model.tokenize(users[-1], add_special=False) if users else None
                turns.pin(tokens)
                engine.prefill(tokens, probe=probe, progress=progress)
        except BaseException:
            engine.close()
            raise
        self.engine.close()
        self.engine, self.turns, self.settings = engine, turns, settings
        self._before_turn, self._rollback_before = None, 0


def _new_messages(message) -> list[dict]:
    """What :meth:`Chat.send` takes, as messages: one user message, or user and tool messages."""
    if isinstance(message, str):
        if not message.strip():
            raise UsageError("the message is empty")
        return [{"role": "user", "content": message}]
    new = [message] if isinstance(message, dict) else message
    if not isinstance(new, list) or not new:
        raise UsageError("send takes the message's text, or a list of {'role': 'user' or 'tool', 'content': ...}")
    for m in new:
        if not isinstance(m, dict) or m.get("role") not in ("user", "tool") or not isinstance(m.get("content"), str):
            raise UsageError(f"a message sent must be {{'role': 'user' or 'tool', 'content': str}}, got {m!r:.80}")
    if new[-1]["role"] == "user" and not new[-1]["content"].strip():
        raise UsageError("the message is empty")
    return [dict(m) for m in new]


def _names_a_file(text: str) -> bool:
    """Whether ``text`` is the path of something that exists (a line of prose longer than a file name may be is
    not: the system refuses to look it up)."""
    try:
        return len(text) < 4096 and Path(text).expanduser().exists()
    except OSError:  # ENAMETOOLONG
        return False


def _document(source: str | os.PathLike, name: str | None) -> tuple[str, str | None]:
    """(text, name) of a document given as a path or as the text itself."""
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source and _names_a_file(source)):
        path = Path(source).expanduser()
        if path.is_dir():  # a pipe or a device is read as it comes (a process substitution, /dev/stdin)
            raise UsageError(f"{path} is a folder: give a text file")
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror}") from None
        name = name or path.name
    else:
        text = str(source)
    if not text.strip():
        raise UsageError(f"{name or 'the document'} is empty")
    return text, name
