"""The conversation core every front door calls — the REPL, the server's routes (OpenAI's and Ollama's) and
:class:`kvlocal.Llama`: messages in, text pieces and a :class:`Result` out (the text, the tool calls, the finish
reason, the tokens read and generated, the ``kv`` figures).

What each door used to state for itself lives here once:

- **continuation lookup** (:class:`Conversations`): a call whose messages are a kept conversation, the reply it got
  and new user (or tool) messages goes on in that chat's compressed cache; the same messages again take the last
  reply back and draw it anew; a plain completion goes on from a kept text its prompt begins with. Finished chats are
  kept by the transcript the caller saw (its stop string trimmed) in a :class:`ConversationCache` — the server's
  holds many, :class:`kvlocal.Llama`'s one.
- **stop strings** (:func:`kvlocal.chat.stops.until_stop`): the text up to the first one, what might begin one held
  back until it is clear;
- **finish reasons** (:attr:`Result.finish_reason`): ``"tool_calls"`` when the reply made calls, else ``"stop"``
  (the model ended it, or a stop string), ``"length"`` (its token limit), ``"loop"`` (the loop guard); a reply its
  reader closed early has the reason the reader gives (:meth:`Turn.close`: the server's ``"cancelled"``);
- **usage**: the tokens this call read (an earlier conversation read afresh included) and generated, from the
  engine's counters.

The HTTP layer (:mod:`kvlocal.server`) only parses requests into a :class:`Call` and writes results out."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kvlocal.chat.stops import until_stop
from kvlocal.chat.toolcalls import message_key, turn_start
from kvlocal.errors import UsageError

Key = tuple  # a transcript after its settings: ((role, content), ...), or a plain completion's (("text", read),)


class Cancelled(Exception):
    """Raised by a call's ``progress`` callback to stop it while its messages are read: a chat found to continue
    is kept as it was (Chat undoes the read)."""


@dataclass
class Call:
    """One chat (or plain) completion, as the core runs it."""

    messages: list[dict]  # normalized (kvlocal.chat.messages): optional system first, ending with user or tool messages
    sampler: object
    max_tokens: int | None  # None: the chat's max_reply
    stops: list[str] = field(default_factory=list)
    reuse: bool = True  # continue a kept conversation where one fits
    options: dict = field(default_factory=dict)  # ChatSettings fields this conversation takes instead of the defaults
    tools: list[dict] | None = None  # checked tool definitions (kvlocal.chat.toolcalls)
    tool_choice: str | dict = "auto"
    prompt: str | None = None  # a plain completion: its text instead of messages

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None

    @property
    def new(self) -> int:
        """How many messages at the end are new to the conversation: those after the last assistant message
        (a user message, or the tool messages answering its calls)."""
        return len(self.messages) - turn_start(self.messages)

    @property
    def settings(self) -> Key:
        """The call's own cache settings and tools: a conversation is continued only with the same."""
        settings = (("kv", tuple(sorted(self.options.items()))),) if self.options else ()
        if self.tools:
            settings += (("tools", json.dumps(self.tools, sort_keys=True)),)
        return settings

    @property
    def key(self) -> Key:
        """The transcript (a plain completion: its prompt), after :attr:`settings`."""
        if self.prompt is not None:
            return self.settings + (("text", self.prompt),)
        return self.settings + tuple(message_key(m) for m in self.messages)


@dataclass
class Result:
    text: str  # a reply that is only tool calls has none
    finish_reason: str | None  # stop | length | loop | tool_calls, or the reason its reader closed it with
    prompt_tokens: int
    completion_tokens: int
    kv: dict
    seconds: float
    mode: str = "new"  # new | continue | regenerate | restored: how the conversation was found
    tool_calls: list[dict] = field(default_factory=list)


class Turn:
    """One reply of a chat: iterate it for the text (up to the first stop string); :attr:`calls` holds the reply's
    tool calls as each ends; :attr:`result` is set once the reply has ended or been closed. ``start()`` begins the
    reply (``chat.send``, ``chat.regen``, ...: whatever reads the call's messages and streams the reply), run at the
    first step, so that the tokens it reads count in :attr:`Result.prompt_tokens`."""

    def __init__(self, chat, start: Callable[[], Iterator[str]], stops: list[str] = (), mode: str = "new",
                 t0: float | None = None, on_end: Callable[["Turn"], None] | None = None,
                 on_fail: Callable[["Turn", BaseException], None] | None = None):
        self.chat, self.mode = chat, mode
        self.result: Result | None = None
        self._t0 = time.perf_counter() if t0 is None else t0
        s = chat.engine.stats
        self._since = (s.prompt_tokens, s.generated_tokens)
        self._reused = 0 if mode == "new" else chat.stats.tokens_seen
        self._on_end, self._on_fail = on_end, on_fail
        self._reason: str | None = None  # why its reader closed it
        self._pieces = self._run(start, list(stops))

    @property
    def calls(self) -> list[dict]:
        return self.chat.tool_calls

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def close(self, reason: str | None = None) -> None:
        """End the reply here (what was generated stays in the chat); its result's finish reason is ``reason``."""
        self._reason = reason
        self._pieces.close()

    def run(self) -> Result:
        """The whole reply's result."""
        for _ in self:
            pass
        return self.result

    def _run(self, start: Callable[[], Iterator[str]], stops: list[str]) -> Iterator[str]:
        text = ""
        pieces = until_stop(iter(()), stops)  # (closed below if start() fails)
        try:
            pieces = until_stop(start(), stops)
            while True:
                try:
                    piece = next(pieces)
                except StopIteration as end:
                    stopped = bool(end.value)
                    break
                text += piece
                yield piece
        except GeneratorExit:  # closed by its reader: the reply so far stays
            pieces.close()
            self._end(text, self._reason)
            raise
        except BaseException as e:
            pieces.close()
            if self._on_fail is not None:
                self._on_fail(self, e)
            raise
        # a stop string ends a reply as "stop", unless it made calls (the chat's own reason says so)
        self._end(text, "stop" if stopped and not self.calls else self.chat.finish_reason or "stop")

    def _end(self, text: str, finish: str | None) -> None:
        chat = self.chat
        calls = list(chat.tool_calls)
        if calls and not text.strip():
            text = ""  # a reply that is only calls has no content (what the caller sends back)
        s, st = chat.engine.stats, chat.stats
        kv = {**chat.engine.kv_figures(), "method": st.method, "budget": st.budget,
              "cache_reused": self._reused > 0, "tokens_reused": self._reused,
              "compression_events": st.compression_events, "backend": s.backend, "host_kv_bytes": s.host_kv_bytes,
              "recall_rows_in": s.recall_rows_in, "pinned_cells": s.kv_cells_pinned,
              # where the conversation's cache came from: read fresh, kept in memory, or the server's --session-dir
              "cache_from": {"new": "read", "restored": "session_dir"}.get(self.mode, "memory")}
        self.result = Result(text, finish, s.prompt_tokens - self._since[0], s.generated_tokens - self._since[1], kv,
                             time.perf_counter() - self._t0, {"regen": "regenerate"}.get(self.mode, self.mode), calls)
        if self._on_end is not None:
            self._on_end(self)


class ConversationCache:
    """Finished chats by transcript, least recently used first; bounded by KV bytes and by count. Used from one
    thread (the server's worker; ``len`` and ``bytes`` are read by its /health)."""

    def __init__(self, max_bytes: float, max_chats: int):
        self.max_bytes, self.max_chats = max_bytes, max_chats
        self._items: OrderedDict[Key, tuple[object, int]] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def take(self, key: Key):
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.bytes -= item[1]
        return item[0]

    def take_parent(self, key: Key):
        """The most recent chat whose transcript is ``key`` plus one assistant reply."""
        for k in reversed(self._items):
            if len(k) == len(key) + 1 and k[-1][0] == "assistant" and k[:-1] == key:
                return self.take(k)
        return None

    def take_prefix(self, settings: Key, text: str):
        """The plain-completion chat (key ``settings + (("text", read),)``) whose text ``text`` goes on from,
        the longest if several."""
        best = None
        for k in self._items:
            if (len(k) == len(settings) + 1 and k[:-1] == settings and k[-1][0] == "text"
                    and len(k[-1][1]) < len(text) and text.startswith(k[-1][1])
                    and (best is None or len(k[-1][1]) > len(best[-1][1]))):
                best = k
        return None if best is None else self.take(best)

    def put(self, key: Key, chat, nbytes: int) -> None:
        old = self.take(key)
        if old is not None and old is not chat:
            old.close()
        self._items[key] = (chat, nbytes)
        self.bytes += nbytes
        self._trim(self.max_chats)

    def make_room(self) -> None:
        """Before a new chat is built: the least recently used go until it fits the count, so that their llama.cpp
        contexts are freed before its own is allocated."""
        self._trim(self.max_chats - 1)

    def _trim(self, most: int) -> None:
        while self._items and (self.bytes > self.max_bytes or len(self._items) > most):
            _, (c, n) = self._items.popitem(last=False)
            self.bytes -= n
            self.evictions += 1
            c.close()

    def close(self) -> None:
        while self._items:
            _, (c, _) = self._items.popitem()
            c.close()
        self.bytes = 0


class Conversations:
    """The continuation lookup: a :class:`Call`'s chat found in ``cache`` (or, with ``restore``, loaded from where the
    caller keeps them), else made by ``new_chat(call)``, and kept there again once its reply ends.
    ``restore(head, call)``: a chat holding the transcript key ``head`` (the server's --session-dir), or None;
    ``kept(key, chat)``: called after a chat reply is kept (the server writes it to --session-dir)."""

    def __init__(self, new_chat: Callable[[Call], object], cache: ConversationCache,
                 restore: Callable[[Key, Call], object] | None = None,
                 kept: Callable[[Key, object], None] | None = None):
        self.new_chat, self.cache, self.restore, self.kept = new_chat, cache, restore, kept

    def turn(self, call: Call, progress: Callable[[int, int], None] | None = None) -> Turn:
        """The reply to ``call``, in the chat it continues (or a new one that reads its earlier messages first).
        ``progress(done, total)`` is called while messages are read; raising :class:`Cancelled` from it stops the
        call and keeps the chat it continued as it was."""
        t0 = time.perf_counter()
        chat, mode = self._checkout(call)
        reply = None
        try:
            chat.sampler = call.sampler
            if mode == "regen":
                try:
                    reply = chat.regen(call.max_tokens)  # back to before the last reply: the state after messages[:-1]
                except UsageError:  # nothing to take back (cannot happen for a chat the core kept)
                    chat.close()
                    chat, mode = self._new(call), "new"
                    chat.sampler = call.sampler
        except BaseException:
            chat.close()
            raise
        held = self._held_key(call, chat)  # what the chat holds before the call's new messages are read

        def start() -> Iterator[str]:
            if reply is not None:
                return reply
            if call.prompt is not None:
                return chat.complete(call.prompt, call.max_tokens, progress=progress)
            if mode == "new":
                history = [m for m in call.messages[:-call.new] if m["role"] != "system"]
                if history:
                    chat.extend(history, progress=progress)
            return chat.send(call.messages[-call.new:], call.max_tokens, progress=progress, tool_choice=call.tool_choice)

        def failed(turn: Turn, e: BaseException) -> None:
            if isinstance(e, Cancelled) and mode in ("continue", "restored"):  # stopped while the new messages were read
                self.cache.put(held, chat, chat.stats.kv_bytes)
            else:
                chat.close()  # a failed chat is not kept

        return Turn(chat, start, call.stops, mode, t0, on_end=lambda turn: self._keep(call, turn), on_fail=failed)

    def close(self) -> None:
        self.cache.close()

    def _checkout(self, call: Call) -> tuple[object, str]:
        """(chat, mode): a kept chat to continue or to regenerate, else a new one."""
        if call.prompt is not None:  # a plain completion goes on from a kept text its prompt begins with
            chat = self.cache.take_prefix(call.settings, call.prompt) if call.reuse else None
            return (chat, "continue") if chat is not None else (self._new(call), "new")
        head = call.key[:-call.new]  # the conversation before the new messages
        if call.reuse:
            chat = self.cache.take(head)
            if chat is not None:
                return chat, "continue"
            chat = self.cache.take_parent(call.key)
            if chat is not None:
                return chat, "regen"
            if self.restore is not None:
                chat = self.restore(head, call)
                if chat is not None:
                    return chat, "restored"
        return self._new(call), "new"

    def _new(self, call: Call):
        self.cache.make_room()
        return self.new_chat(call)

    @staticmethod
    def _held_key(call: Call, chat) -> Key:
        """The key of what ``chat`` holds before the call's new messages are read (a plain completion: the text it
        has read, continuation included)."""
        if call.prompt is not None:
            return call.settings + (("text", chat.text),)
        return call.key[:-call.new]

    def _keep(self, call: Call, turn: Turn) -> None:
        """Keep the chat under the transcript the caller saw (its stop string trimmed), whatever the reply's end."""
        chat, r = turn.chat, turn.result
        if call.prompt is not None:
            self.cache.put(self._held_key(call, chat), chat, chat.stats.kv_bytes)
            return
        key = call.key + (message_key({"role": "assistant", "content": r.text, "tool_calls": r.tool_calls}),)
        self.cache.put(key, chat, chat.stats.kv_bytes)
        if self.kept is not None:
            self.kept(key, chat)
