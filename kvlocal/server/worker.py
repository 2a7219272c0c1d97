"""The engine side of ``kvlocal serve``: ONE worker thread owns all llama.cpp work — the shared model,
every conversation's chat and the conversation cache. The HTTP side (:mod:`kvlocal.server.app`) submits
a :class:`Job` and gets a :class:`Result` back through a future."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Callable

from kvlocal.errors import ServerLost, UsageError
from kvlocal.settings import ChatSettings
from kvlocal.chat.conversation import Call, Cancelled, ConversationCache, Conversations, Key, Result
from kvlocal.recall import TierMemory
from kvlocal.server.store import ChatStore

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


class _ShuttingDown(Cancelled):
    pass


class _Gone(Cancelled):
    """The client left before its request reached the worker."""


@dataclass
class Job(Call):
    """One chat completion (:class:`~kvlocal.chat.conversation.Call`), with what streams it back to its client."""

    emit: Callable[[str], None] | None = None  # streaming: called on the worker with each piece of text
    emit_call: Callable[[int, dict], None] | None = None  # streaming: called with each tool call (index, call)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker:
    """The shared model, the worker thread and the conversation cache."""

    def __init__(self, model, model_id: str, chat_options: ChatSettings | dict, defaults: dict, max_tokens: int = 512,
                 cache_bytes: int = DEFAULT_CACHE_MIB << 20, cache_chats: int = DEFAULT_CACHE_CHATS,
                 store: ChatStore | None = None, n_threads: int | None = None, load: Callable | None = None):
        """``chat_options``: the server's chat settings (or their fields as Chat's keywords, ``n_threads`` among
        them); ``defaults``: the sampling a request that gives none gets; ``load``: loads the model again, after one
        of its rpc-servers was lost and is back (None: a lost server stays lost)."""
        self.model, self.model_id, self.load = model, model_id, load
        self.lost: ServerLost | None = None  # an rpc-server of the model stopped: every request is refused (503)
        if not isinstance(chat_options, ChatSettings):
            chat_options = dict(chat_options)
            n_threads = chat_options.pop("n_threads", n_threads)
            chat_options = ChatSettings(**chat_options)
        self.settings, self.n_threads = chat_options, n_threads
        self.defaults, self.max_tokens = dict(defaults), max_tokens
        # one RAM cap for every conversation's recall tier (--recall-mem): the oldest rows of them all go first
        self.recall_memory = TierMemory.of(self.settings.recall_mem)
        self.cache = ConversationCache(cache_bytes, cache_chats)
        self.store = store  # --session-dir: conversations written after each reply, loaded after a restart
        self.conversations = Conversations(lambda call: self.new_chat(call.system, call.options, call.tools), self.cache,
                                           restore=None if store is None else self._restore,
                                           kept=None if store is None else store.save)
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
            self._reconnect()
            return self._generate(job)
        except ServerLost as e:
            self._lose(e)
            raise self.lost from None
        finally:
            self.busy = False
            self.served += 1

    def _lose(self, e: ServerLost) -> None:
        """An rpc-server of the model stopped: the layers it held, and every conversation's cache there, are gone.
        The conversations are closed (those in --session-dir stay as last saved) and requests are refused, naming
        the server, until it answers again."""
        if self.lost is None:
            from kvlocal.runtime import lost_text

            then = "restart it and `kvlocal serve`"
            if self.load is not None:
                then = ("restart it (`kvlocal rpc-server`): the first request after that loads the model again"
                        + (", and conversations go on from their last save in --session-dir" if self.store else ""))
            self.lost = ServerLost(e.endpoints, lost_text(e.endpoints, e.stopped, then=then), e.stopped)
            self.cache.close()

    def _reconnect(self) -> None:
        """Once the lost servers accept connections again, load the model again (ggml-rpc connects afresh)."""
        if self.lost is None:
            return
        from kvlocal.runtime import dead_servers

        if self.load is None or dead_servers(self.lost.endpoints):
            raise self.lost
        self.model.close()
        try:
            self.model = self.load()
        except UsageError as e:  # back, but refused (another build, no device): still lost, and why
            raise ServerLost(self.lost.endpoints, f"{self.lost.text} — loading the model again failed: {e}",
                             self.lost.stopped) from None
        self.lost = None

    def _restore(self, head: Key, call: Call):
        """The chat the session folder holds under ``head``, if its settings are the server's with the call's."""
        return self.store.load(head, self.model, lambda saved: self._other_settings(saved, call.options),
                               n_threads=self.n_threads, recall_mem=self.recall_memory)

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
        """Run the job's turn (:class:`~kvlocal.chat.conversation.Conversations`) to its end, a stop string, a
        cancelled request or shutdown; stream its text and its tool calls as they end."""
        def check(done: int, total: int) -> None:  # between the chunks of a long read
            if job.cancelled.is_set():
                raise _Gone()
            if self.stopping.is_set():
                raise _ShuttingDown()

        turn = self.conversations.turn(job, progress=check)
        sent = 0

        def emit_calls() -> None:
            nonlocal sent
            while job.emit_call is not None and sent < len(turn.calls):
                job.emit_call(sent, turn.calls[sent])
                sent += 1

        for piece in turn:
            emit_calls()
            if job.emit is not None:
                job.emit(piece)
            if job.cancelled.is_set() or self.stopping.is_set():
                turn.close("cancelled" if job.cancelled.is_set() else "stopped")  # the partial reply is kept
                break
        emit_calls()
        if turn.result.finish_reason == "stopped":
            raise _ShuttingDown()
        return turn.result
