"""The engine side of ``kvlocal serve``: ONE worker thread owns all llama.cpp work — the shared model,
every conversation's chat and the conversation cache. The HTTP side (:mod:`kvlocal.server.app`) submits
a :class:`Job` and gets a :class:`Result` back through a future."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvlocal.settings import ChatSettings
from kvlocal.chat.stops import until_stop
from kvlocal.chat.tools import message_key, turn_start
from kvlocal.errors import UsageError
from kvlocal.recall import TierMemory
from kvlocal.server.conversations import ConversationCache, Key
from kvlocal.server.sessions import SessionDir

DEFAULT_CACHE_MIB = 1024
DEFAULT_CACHE_CHATS = 32

# The fields of ChatSettings a conversation restored from --session-dir need not share with the server, and why.
# Every other field made its saved cache or steers how it goes on (what is evicted, recalled, pinned, how replies
# end): a saved chat that differs in one is read afresh rather than go on under settings the server was not given.
NOT_COMPARED = {
    "system": "part of the transcript the file is named by: the same name, the same system message",
    "max_reply": "every request gives the chat its own max_tokens",
    "recall_mem": "the server's own cap (--recall-mem) replaces the saved one when the file is loaded",
}
_UNCOMPARED = {f.name: f.default for f in dataclasses.fields(ChatSettings) if f.name in NOT_COMPARED}


def cache_part(settings: ChatSettings) -> ChatSettings:
    """``settings`` with the fields of :data:`NOT_COMPARED` at their defaults: two chats whose cache parts are
    ``==`` made their caches alike and go on alike."""
    return dataclasses.replace(settings, **_UNCOMPARED)


class _ShuttingDown(Exception):
    pass


class _Gone(Exception):
    """The client left before its request reached the worker."""


@dataclass
class Job:
    """One chat completion, as the worker runs it."""

    messages: list[dict]  # normalized: optional system first, then user/assistant alternating, ending with user
    sampler: object
    max_tokens: int
    stops: list[str] = field(default_factory=list)
    reuse: bool = True
    options: dict = field(default_factory=dict)  # the request's kv object: ChatSettings fields it overrides
    tools: list[dict] | None = None  # checked tool definitions (kvlocal.chat.tools)
    tool_choice: str | dict = "auto"
    prompt: str | None = None  # a plain completion (/v1/completions): its text instead of messages
    emit: Callable[[str], None] | None = None  # streaming: called on the worker with each piece of text
    emit_call: Callable[[int, dict], None] | None = None  # streaming: called with each tool call (index, call)
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages[0]["role"] == "system" else None

    @property
    def new(self) -> int:
        """How many messages at the end are new to the conversation: those after the last assistant message
        (a user message, or the tool messages answering its calls)."""
        return len(self.messages) - turn_start(self.messages)

    @property
    def settings(self) -> Key:
        """The request's own cache settings and tools: a conversation is continued only with the same."""
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
    text: str
    finish_reason: str  # stop | length | loop | tool_calls | cancelled
    prompt_tokens: int
    completion_tokens: int
    kv: dict
    seconds: float
    mode: str = "new"  # new | continue | regenerate: how the conversation was found
    tool_calls: list[dict] = field(default_factory=list)


class Worker:
    """The shared model, the worker thread and the conversation cache."""

    def __init__(self, model, model_id: str, chat_options: ChatSettings | dict, defaults: dict, max_tokens: int = 512,
                 cache_bytes: int = DEFAULT_CACHE_MIB << 20, cache_chats: int = DEFAULT_CACHE_CHATS,
                 sessions: SessionDir | None = None, n_threads: int | None = None):
        """``chat_options``: the server's chat settings (or their fields as Chat's keywords, ``n_threads`` among
        them); ``defaults``: the sampling a request that gives none gets."""
        self.model, self.model_id = model, model_id
        if not isinstance(chat_options, ChatSettings):
            chat_options = dict(chat_options)
            n_threads = chat_options.pop("n_threads", n_threads)
            chat_options = ChatSettings(**chat_options)
        self.settings, self.n_threads = chat_options, n_threads
        self.defaults, self.max_tokens = dict(defaults), max_tokens
        # one RAM cap for every conversation's recall tier (--recall-mem): the oldest rows of them all go first
        self.recall_memory = TierMemory.of(self.settings.recall_mem)
        self.cache = ConversationCache(cache_bytes, cache_chats)
        self.sessions = sessions  # --session-dir: conversations written after each reply, loaded after a restart
        self.stopping = threading.Event()
        self.busy = False
        self.queued = 0  # jobs waiting for the worker
        self.served = 0
        self._count = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvlocal-llama")

    def check(self) -> int:
        """Build one chat with the settings (on the worker) and return its budget in cells."""
        def probe():
            with self.new_chat(None) as chat:
                return chat.stats.budget_cells
        return self._pool.submit(probe).result()

    def settings_for(self, options: dict, system: str | None = None) -> ChatSettings:
        """The server's settings with a request's ``kv`` overrides (and its system message)."""
        return dataclasses.replace(self.settings, system=system, **options)

    def new_chat(self, system: str | None, options: dict | None = None, tools: list[dict] | None = None):
        from kvlocal.chat import Chat

        return Chat(self.model, settings=self.settings_for(options or {}, system), tools=tools,
                    n_threads=self.n_threads, recall_mem=self.recall_memory)

    @property
    def tool_format(self) -> str | None:
        """How the served model writes tool calls; None when its template does not take tools."""
        return self.model.tool_format

    def submit(self, job: Job) -> concurrent.futures.Future:
        with self._count:
            self.queued += 1
        try:
            return self._pool.submit(self._work, job)
        except RuntimeError:  # the pool is shut down
            with self._count:
                self.queued -= 1
            raise _ShuttingDown() from None

    def close(self) -> None:
        self.stopping.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.cache.close()

    # -- on the worker thread ---------------------------------------------------------------------------
    def _work(self, job: Job) -> Result:
        with self._count:
            self.queued -= 1
        if job.cancelled.is_set():
            raise _Gone()
        if self.stopping.is_set():
            raise _ShuttingDown()
        self.busy = True
        try:
            return self._generate(job)
        finally:
            self.busy = False
            self.served += 1

    def _checkout(self, job: Job):
        """(chat, mode): a cached chat to continue or to regenerate, else a new one."""
        if job.prompt is not None:  # a plain completion goes on from a cached text its prompt begins with
            chat = self.cache.take_prefix(job.settings, job.prompt) if job.reuse else None
            return (chat, "continue") if chat is not None else (self.new_chat(None, job.options), "new")
        head = job.key[:-job.new]  # the conversation before the new messages
        if job.reuse:
            chat = self.cache.take(head)
            if chat is not None:
                return chat, "continue"
            chat = self.cache.take_parent(job.key)
            if chat is not None:
                return chat, "regen"
            if self.sessions is not None:
                chat = self.sessions.load(head, self.model, lambda saved: self._other_settings(saved, job.options),
                                          n_threads=self.n_threads, recall_mem=self.recall_memory)
                if chat is not None:
                    return chat, "restored"
        return self.new_chat(job.system, job.options, job.tools), "new"

    def _other_settings(self, saved: ChatSettings, options: dict) -> list[str]:
        """How a saved chat's settings differ from this server's with a request's ``options``: empty where their
        :func:`cache_part` are ``==`` (it may go on here), else one ``name saved → here`` for each field that
        differs."""
        saved, here = cache_part(saved), cache_part(self.settings_for(options))
        if saved == here:
            return []
        return [f"{f.name} {getattr(saved, f.name)!r} → {getattr(here, f.name)!r}"
                for f in dataclasses.fields(ChatSettings) if getattr(saved, f.name) != getattr(here, f.name)]

    def _generate(self, job: Job) -> Result:
        t0 = time.perf_counter()
        chat, mode = self._checkout(job)

        def check(done: int, total: int) -> None:  # between the chunks of a long read
            if job.cancelled.is_set():
                raise _Gone()
            if self.stopping.is_set():
                raise _ShuttingDown()

        try:
            chat.sampler = job.sampler
            reply = None
            if mode == "regen":
                try:
                    reply = chat.regen(job.max_tokens)  # back to before the last reply: state after messages[:-1]
                except UsageError:  # nothing to take back (cannot happen for a chat the server cached)
                    chat.close()
                    chat, mode = self.new_chat(job.system, job.options, job.tools), "new"
                    chat.sampler = job.sampler
            s = chat.engine.stats
            p0, g0 = s.prompt_tokens, s.generated_tokens
            reused = 0 if mode == "new" else chat.stats.tokens_seen
            held = self._held_key(job, chat)  # what the chat holds now, to keep it under if the request stops
            if job.prompt is not None:
                reply = chat.complete(job.prompt, job.max_tokens, progress=check)
            elif mode == "new":
                history = [m for m in job.messages[:-job.new] if m["role"] != "system"]
                if history:
                    chat.extend(history, progress=check)
            if reply is None:
                reply = chat.send(job.messages[-job.new:], job.max_tokens, progress=check, tool_choice=job.tool_choice)
            text, finish = self._drain(reply, job, chat)
            calls = list(chat.tool_calls)
            if calls and not text.strip():
                text = ""  # a reply that is only calls has no content (what the client sends back)
            s = chat.engine.stats
            prompt, completion = s.prompt_tokens - p0, s.generated_tokens - g0
            if finish is None:  # the reply ended itself: the model's end, its token limit, the loop guard, calls
                finish = chat.finish_reason or "stop"
            st = chat.stats
            kv = {**chat.engine.kv_figures(), "method": st.method, "budget": st.budget,
                  "cache_reused": reused > 0, "tokens_reused": reused,
                  "compression_events": st.compression_events, "backend": s.backend,
                  "host_kv_bytes": s.host_kv_bytes,
                  "recall_rows_in": s.recall_rows_in, "pinned_cells": s.kv_cells_pinned,
                  # where the conversation's cache came from: read fresh, kept in memory, or the session folder
                  "cache_from": {"new": "read", "restored": "session_dir"}.get(mode, "memory")}
        except (_Gone, _ShuttingDown):
            if mode in ("continue", "restored"):  # stopped while the new message was read: Chat put itself back
                self.cache.put(held, chat, chat.stats.kv_bytes)
            else:
                chat.close()
            raise
        except BaseException:
            chat.close()  # a failed chat is not kept
            raise
        # kept under the transcript the client saw (its stop string trimmed), whatever the reply's end
        if job.prompt is not None:
            self.cache.put(self._held_key(job, chat), chat, st.kv_bytes)
        else:
            key = job.key + (message_key({"role": "assistant", "content": text, "tool_calls": calls}),)
            self.cache.put(key, chat, st.kv_bytes)
            if self.sessions is not None:
                self.sessions.save(key, chat)
        if finish == "stopped":
            raise _ShuttingDown()
        return Result(text, finish, prompt, completion, kv, time.perf_counter() - t0,
                      {"regen": "regenerate"}.get(mode, mode), calls)

    @staticmethod
    def _held_key(job: Job, chat) -> Key:
        """The key of what ``chat`` holds before the job's new messages are read (a plain completion: the text
        it has read, continuation included)."""
        if job.prompt is not None:
            return job.settings + (("text", chat.text),)
        return job.key[:-job.new]

    def _drain(self, reply, job: Job, chat) -> tuple[str, str | None]:
        """Run the reply to its end, a stop string, a cancelled request or shutdown; stream what is sure not
        to be part of a stop string, and the tool calls as they end. Returns (text, finish_reason or None
        when the reply ended itself)."""
        text, finish, sent = "", None, 0
        pieces = until_stop(reply, job.stops)

        def emit_calls() -> None:
            nonlocal sent
            while job.emit_call is not None and sent < len(chat.tool_calls):
                job.emit_call(sent, chat.tool_calls[sent])
                sent += 1

        try:
            while True:
                try:
                    piece = next(pieces)
                except StopIteration as end:
                    finish = "stop" if end.value else None
                    break
                emit_calls()
                text += piece
                if job.emit is not None:
                    job.emit(piece)
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                if self.stopping.is_set():
                    finish = "stopped"
                    break
        finally:
            pieces.close()  # and the reply: an early stop keeps the partial reply in the chat
        emit_calls()
        return text, finish
