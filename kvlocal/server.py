"""``kvlocal serve``: an OpenAI-compatible chat server on one model, every conversation in a bounded KV
cache (docs/server.md).

    kvlocal serve smollm2-135m --budget 256 --port 8080
    curl http://127.0.0.1:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Design
------
* One :class:`~kvlocal.runtime.Model` is loaded and shared by every conversation; each conversation is
  a :class:`kvlocal.Chat` (its own llama.cpp context, its own compressed cache).
* All llama.cpp work runs on ONE worker thread (a single-thread executor): requests queue for it, two
  threads never touch an engine at once, and the event loop stays free (``/health`` answers while a
  reply is generated). A streaming reply's pieces go from the worker to the response through an
  asyncio queue (``loop.call_soon_threadsafe``).
* Conversation cache: finished chats are kept in an LRU keyed by their transcript as the client saw it
  (system, then user/assistant messages, ending with the reply just sent). A request whose messages
  minus the last are such a transcript takes that chat out, reads only the new user message into its
  compressed cache and puts it back under its new transcript; a request that repeats the last user
  message of a cached transcript (a "regenerate") takes its chat back to before that reply
  (:meth:`Chat.regen`). Anything else builds a new chat and reads the history into it. The LRU is
  bounded by the chats' KV bytes (``--cache-mib``) and their number (``--cache-chats``); evicted chats
  are closed.
* A client that goes away stops its reply at the next token; the conversation stays cached with the
  partial reply. An error inside generation answers 500 and drops that chat; the server goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import errno
import hmac
import ipaddress
import json
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import UsageError

Key = tuple  # a transcript: ((role, content), ...)

DEFAULT_CACHE_MIB = 1024
DEFAULT_CACHE_CHATS = 32
MAX_STOPS = 16
_TEXT_ONLY = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video", "video_url")
_OPEN_PATHS = ("/health",)  # answered without the API key (liveness checks)


# -- command line ----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import _budget_args, _llama_args, _model_arg, _sampling_args

    _model_arg(p)
    _llama_args(p)
    _budget_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 exposes it, use --api-key)")
    g.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0: any free port, printed at start)")
    g.add_argument("--api-key", default=os.environ.get("KVLOCAL_API_KEY") or None,
                   help="require `Authorization: Bearer KEY` on every request but /health (default: $KVLOCAL_API_KEY, "
                        "else none)")
    g.add_argument("--cache-mib", type=float, default=DEFAULT_CACHE_MIB,
                   help=f"KV memory of the conversations kept for reuse, in MiB (default {DEFAULT_CACHE_MIB}; 0: no reuse)")
    g.add_argument("--cache-chats", type=int, default=DEFAULT_CACHE_CHATS,
                   help=f"most conversations kept for reuse (default {DEFAULT_CACHE_CHATS}; each also holds "
                        f"llama.cpp's compute buffers)")
    g.add_argument("-n", "--n-predict", type=int, default=512,
                   help="most tokens of a reply when a request gives no max_tokens (default 512)")
    _sampling_args(p)  # server defaults; a request's temperature, top_p, seed, ... override them


def run(args) -> int:
    from .cli import _sampler
    from .models import DEFAULT_MODEL, KNOWN_MODELS, resolve
    from .runtime import Model

    _check_args(args)
    _sampler(args).close()  # the default sampling flags, checked (UsageError names the flag)
    sock, url, loopback = _bind(args.host, args.port)
    model = backend = None
    try:
        path = resolve(args.model)
        name = args.model or DEFAULT_MODEL
        model_id = name if name in KNOWN_MODELS else Path(path).stem
        model = Model(path, n_gpu_layers=args.n_gpu_layers)
        backend = Backend(model, model_id, chat_options=dict(
            budget=args.budget, method=args.method, ctx_size=args.ctx_size, chunk=args.chunk, window=args.window,
            max_reply=args.n_predict, flash_attn=args.flash_attn, n_threads=args.threads,
            cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v, backend=args.backend),
            defaults=dict(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                          seed=None if args.seed == -1 else args.seed),
            max_tokens=args.n_predict, cache_bytes=int(args.cache_mib * 2**20), cache_chats=args.cache_chats)
        cells = backend.check()  # builds one chat: a budget or method that cannot work fails here, not per request
        if not loopback and not args.api_key:
            print(f"kvlocal serve: warning: listening on {args.host} without --api-key: anyone who can reach "
                  f"this port can use the model", file=sys.stderr)
        print(f"kvlocal serve · {model_id} · budget {args.budget} ({cells:,} cells) · {args.method} · {url} "
              f"(OpenAI API at {url}/v1)", file=sys.stderr, flush=True)
        _serve(create_app(backend, api_key=args.api_key), sock, backend)
    finally:
        if backend is not None:
            backend.close()
        if model is not None:
            model.close()
        sock.close()
    print("kvlocal serve: stopped", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvlocal.server``: the same command outside the ``kvlocal`` CLI."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as kvlocal.cli.main
    p = argparse.ArgumentParser(prog="kvlocal serve", description="An OpenAI-compatible chat server in a bounded KV cache.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"kvlocal: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is not a TCP port: give 1-65535 (0: any free port)")
    if args.cache_mib < 0:
        raise UsageError("--cache-mib must be >= 0 (0 keeps no conversation for reuse)")
    if args.cache_chats < 0:
        raise UsageError("--cache-chats must be >= 0 (0 keeps no conversation for reuse)")
    if args.n_predict < 1:
        raise UsageError("-n/--n-predict must be at least 1")
    if args.chunk < 1 or args.window < 1:
        raise UsageError("--chunk and --window must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise UsageError("-t/--threads must be at least 1")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty: give a key, or leave the flag out")


def _bind(host: str, port: int) -> tuple[socket.socket, str, bool]:
    """A bound socket (before the model loads: a busy port fails at once), its URL, whether it is loopback."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--host {host}: cannot resolve it ({getattr(e, 'strerror', None) or e})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)  # from here connections wait in the backlog until the server accepts them
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is in use: stop what holds it or pick another --port") from None
        if e.errno == errno.EACCES:
            raise UsageError(f"port {port} on {host} needs privileges: pick a --port above 1023") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"--host {host} is not an address of this machine") from None
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    ip, real_port = sock.getsockname()[:2]
    try:
        loopback = ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    shown = f"[{ip}]" if ":" in ip else ip
    if ip in ("127.0.0.1", "::1") and host == "localhost":
        shown = "localhost"
    return sock, f"http://{shown}:{real_port}", loopback


def _serve(app, sock: socket.socket, backend: "Backend") -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            backend.stopping.set()  # the reply in progress ends at its next token
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once it has stopped; we stop cleanly and return instead
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
    Server(config).run(sockets=[sock])


# -- the engine side: one worker thread, the conversation cache -----------------------------------------
class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class _ShuttingDown(Exception):
    pass


class _Gone(Exception):
    """The client left before its request reached the worker."""


class ConversationCache:
    """Finished chats by transcript, least recently used first; bounded by KV bytes and by count. Used
    only from the worker thread (``len`` and ``bytes`` are read by /health)."""

    def __init__(self, max_bytes: int, max_chats: int):
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

    def put(self, key: Key, chat, nbytes: int) -> None:
        old = self.take(key)
        if old is not None and old is not chat:
            old.close()
        self._items[key] = (chat, nbytes)
        self.bytes += nbytes
        while self._items and (self.bytes > self.max_bytes or len(self._items) > self.max_chats):
            _, (c, n) = self._items.popitem(last=False)
            self.bytes -= n
            self.evictions += 1
            c.close()

    def close(self) -> None:
        while self._items:
            _, (c, _) = self._items.popitem()
            c.close()
        self.bytes = 0


@dataclass
class Job:
    """One chat completion, as the worker runs it."""

    messages: list[dict]  # normalized: optional system first, then user/assistant alternating, ending with user
    sampler: object
    max_tokens: int
    stops: list[str] = field(default_factory=list)
    reuse: bool = True
    emit: Callable[[str], None] | None = None  # streaming: called on the worker with each piece of text
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages[0]["role"] == "system" else None

    @property
    def key(self) -> Key:
        return tuple((m["role"], m["content"]) for m in self.messages)


@dataclass
class Result:
    text: str
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    completion_tokens: int
    kv: dict
    seconds: float
    mode: str = "new"  # new | continue | regenerate: how the conversation was found


class Backend:
    """The shared model, the worker thread and the conversation cache."""

    def __init__(self, model, model_id: str, chat_options: dict, defaults: dict, max_tokens: int = 512,
                 cache_bytes: int = DEFAULT_CACHE_MIB << 20, cache_chats: int = DEFAULT_CACHE_CHATS):
        self.model, self.model_id = model, model_id
        self.chat_options, self.defaults, self.max_tokens = dict(chat_options), dict(defaults), max_tokens
        self.cache = ConversationCache(cache_bytes, cache_chats)
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

    def new_chat(self, system: str | None):
        from .chat import Chat

        o = self.chat_options
        return Chat(self.model, o["budget"], o["method"], system=system, ctx_size=o.get("ctx_size", 0),
                    chunk=o.get("chunk", 128), window=o.get("window", 32), max_reply=o.get("max_reply", 512),
                    flash_attn=o.get("flash_attn", False), n_threads=o.get("n_threads"),
                    cache_type_k=o.get("cache_type_k", "f16"), cache_type_v=o.get("cache_type_v", "f16"),
                    backend=o.get("backend", "auto"))

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
        if job.reuse:
            chat = self.cache.take(job.key[:-1])
            if chat is not None:
                return chat, "continue"
            chat = self.cache.take_parent(job.key)
            if chat is not None:
                return chat, "regen"
        return self.new_chat(job.system), "new"

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
                    chat, mode = self.new_chat(job.system), "new"
                    chat.sampler = job.sampler
            s = chat.engine.stats
            p0, g0 = s.prompt_tokens, s.generated_tokens
            reused = 0 if mode == "new" else chat.stats.tokens_seen
            if mode == "new":
                history = [m for m in job.messages[:-1] if m["role"] != "system"]
                if history:
                    chat.extend(history, progress=check)
            if reply is None:
                reply = chat.send(job.messages[-1]["content"], job.max_tokens, progress=check)
            text, finish = self._drain(reply, job)
            s = chat.engine.stats
            prompt, completion = s.prompt_tokens - p0, s.generated_tokens - g0
            if finish is None:
                finish = "length" if completion >= job.max_tokens else "stop"
            st = chat.stats
            kv = {"tokens_kept": st.kv_tokens_kept, "tokens_seen": st.tokens_seen, "bytes_allocated": st.kv_bytes,
                  "bytes_full": st.kv_bytes_full, "method": st.method, "budget": st.budget,
                  "budget_cells": st.budget_cells, "cache_reused": reused > 0, "tokens_reused": reused,
                  "compression_events": st.compression_events, "backend": s.backend,
                  "host_kv_bytes": s.host_kv_bytes}
        except (_Gone, _ShuttingDown):
            if mode == "continue":  # stopped while the new message was read: Chat put itself back as it was
                self.cache.put(job.key[:-1], chat, chat.stats.kv_bytes)
            else:
                chat.close()
            raise
        except BaseException:
            chat.close()  # a failed chat is not kept
            raise
        # kept under the transcript the client saw (its stop string trimmed), whatever the reply's end
        self.cache.put(job.key + (("assistant", text),), chat, st.kv_bytes)
        if finish == "stopped":
            raise _ShuttingDown()
        return Result(text, finish, prompt, completion, kv, time.perf_counter() - t0,
                      {"regen": "regenerate"}.get(mode, mode))

    def _drain(self, reply, job: Job) -> tuple[str, str | None]:
        """Run the reply to its end, a stop string, a cancelled request or shutdown; stream what is sure not
        to be part of a stop string. Returns (text, finish_reason or None when the reply ended itself)."""
        stops, longest = job.stops, max((len(s) for s in job.stops), default=0)
        text, sent, finish = "", 0, None
        try:
            for piece in reply:
                start = max(0, len(text) - longest + 1)
                text += piece
                safe = len(text)
                if stops:
                    cut = _find_stop(text, stops, start)
                    if cut >= 0:
                        text, finish = text[:cut], "stop"
                        break
                    safe -= _partial_stop(text, stops)
                if job.emit is not None and safe > sent:
                    job.emit(text[sent:safe])
                    sent = safe
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
                if self.stopping.is_set():
                    finish = "stopped"
                    break
        finally:
            reply.close()  # an early stop keeps the partial reply in the chat
        if job.emit is not None and len(text) > sent and finish in (None, "stop"):
            job.emit(text[sent:])
        return text, finish


def _find_stop(text: str, stops: list[str], start: int) -> int:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def _partial_stop(text: str, stops: list[str]) -> int:
    """Characters at the end of text that begin a stop string (held back until it is clear)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


# -- requests ---------------------------------------------------------------------------------------------
def parse_request(body, backend: Backend) -> tuple[Job, bool, bool]:
    """A chat completion request -> (job, stream, include_usage); BadRequest names what is wrong."""
    from .sampling import Sampler, SamplerParamError

    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None, "invalid_type")
    messages = _messages(body.get("messages"))

    def get(name, kind, default=None):
        v = body.get(name)
        if v is None:
            return default
        if kind is bool:
            ok = isinstance(v, bool)
        elif kind is int:
            ok = (isinstance(v, int) or (isinstance(v, float) and v.is_integer())) and not isinstance(v, bool)
            v = int(v) if ok else v
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            v = float(v) if ok else v
        if not ok:
            raise BadRequest(f"{name} must be {'a boolean' if kind is bool else 'an integer' if kind is int else 'a number'}"
                             f" (got {json.dumps(v)[:40]})", name, "invalid_type")
        return v

    # what this server cannot do is refused, not silently ignored
    if get("n", int, 1) != 1:
        raise BadRequest("n must be 1: this server generates one choice per request", "n", "unsupported_value")
    if get("logprobs", bool, False):
        raise BadRequest("logprobs are not supported", "logprobs", "unsupported_parameter")
    for name in ("tools", "functions", "logit_bias"):
        if body.get(name):
            raise BadRequest(f"{name} are not supported by this server", name, "unsupported_parameter")
    if body.get("tool_choice") not in (None, "none"):
        raise BadRequest("tool_choice is not supported: this server has no tools", "tool_choice", "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise BadRequest("response_format: only {\"type\": \"text\"} is supported", "response_format", "unsupported_value")
    for name in ("frequency_penalty", "presence_penalty"):
        if get(name, float, 0.0) != 0:
            raise BadRequest(f"{name} is not supported (give 0 or leave it out); repeat_penalty is", name, "unsupported_value")

    max_tokens = get("max_completion_tokens", int) or get("max_tokens", int) or backend.max_tokens
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None and get(name, int) < 1:
            raise BadRequest(f"{name} must be at least 1", name, "invalid_value")
    stream = get("stream", bool, False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object", "stream_options", "invalid_type")
    include_usage = bool(stream and opts and opts.get("include_usage"))
    stops = _stops(body.get("stop"))
    reuse = get("cache_prompt", bool, True)

    d = backend.defaults
    names = {"temp": "temperature"}  # Sampler's names -> the request's
    params = dict(temp=get("temperature", float, d.get("temp", 0.0)), top_k=get("top_k", int, d.get("top_k", 40)),
                  top_p=get("top_p", float, d.get("top_p", 0.95)), min_p=get("min_p", float, d.get("min_p", 0.05)),
                  repeat_penalty=get("repeat_penalty", float, d.get("repeat_penalty", 1.0)),
                  repeat_last_n=get("repeat_last_n", int, d.get("repeat_last_n", 64)))
    seed = body.get("seed", None)
    params["seed"] = d.get("seed") if seed is None else None if get("seed", int) == -1 else get("seed", int)
    try:
        sampler = Sampler(**params)
    except SamplerParamError as e:
        name = names.get(e.param, e.param)
        rule = e.rule.replace("or None (random)", "or -1 (random)")
        raise BadRequest(f"{name} must be {rule} (got {e.value})", name, "invalid_value") from None
    return Job(messages, sampler, max_tokens, stops, reuse), stream, include_usage


def _messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        if raw is None:
            raise BadRequest("messages is required: a list of {role, content}", "messages", "missing_required_parameter")
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages", "invalid_type")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with role and content", where, "invalid_type")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise BadRequest(f"{where}.role must be system, user or assistant (got {json.dumps(role)[:40]}); "
                             f"tool messages are not supported", f"{where}.role", "invalid_value")
        if m.get("tool_calls"):
            raise BadRequest(f"{where}: tool calls are not supported", f"{where}.tool_calls", "unsupported_parameter")
        if role == "system" and i > 0:
            raise BadRequest(f"{where}: a system message may only come first", f"{where}.role", "invalid_value")
        out.append({"role": role, "content": _content(m.get("content"), f"{where}.content")})
    if out[0]["role"] == "system" and not out[0]["content"]:
        out = out[1:]  # an empty system message is no system message (as kvlocal.Chat has it)
    rest = out[1:] if out and out[0]["role"] == "system" else out
    for j, m in enumerate(rest):
        want = "user" if j % 2 == 0 else "assistant"
        if m["role"] != want:
            i = j + len(out) - len(rest) + (len(raw) - len(out))
            raise BadRequest(f"messages[{i}]: after the system message, user and assistant messages must alternate, "
                             f"starting with user (got {m['role']})", f"messages[{i}].role", "invalid_value")
    if not rest or rest[-1]["role"] != "user":
        raise BadRequest("the last message must be a user message", "messages", "invalid_value")
    if not rest[-1]["content"].strip():
        raise BadRequest("the last user message is empty", f"messages[{len(raw) - 1}].content", "invalid_value")
    return out


def _content(c, where: str) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for k, part in enumerate(c):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind in _TEXT_ONLY:
                raise BadRequest(f"{where}[{k}]: {kind} parts are not supported: this server is text-only",
                                 f"{where}[{k}].type", "unsupported_content")
            else:
                raise BadRequest(f"{where}[{k}] must be {{\"type\": \"text\", \"text\": str}}", f"{where}[{k}]", "invalid_value")
        return "\n".join(texts)
    raise BadRequest(f"{where} must be a string or a list of text parts", where,
                     "missing_required_parameter" if c is None else "invalid_type")


def _stops(raw) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of them", "stop", "invalid_value")
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"stop: at most {MAX_STOPS} strings", "stop", "invalid_value")
    return list(dict.fromkeys(stops))


# -- the HTTP side ----------------------------------------------------------------------------------------
def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def _error_body(status: int, e: BaseException) -> tuple[int, str, str]:
    """(status, message, type) of an error raised by the worker."""
    if isinstance(e, _ShuttingDown):
        return 503, "the server is shutting down", "server_error"
    if isinstance(e, UsageError):
        return 400, str(e), "invalid_request_error"
    return status, f"generation failed: {type(e).__name__}: {e}", "server_error"


class _ApiKey:
    """Pure ASGI middleware: ``Authorization: Bearer KEY`` on every path but /health."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            auth = b""
            for k, v in scope.get("headers", []):
                if k == b"authorization":
                    auth = v
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else None
            if given is None or not hmac.compare_digest(given, self.key):
                msg = "invalid API key" if given is not None else "missing API key: send `Authorization: Bearer KEY`"
                await error_response(401, msg, "invalid_request_error", None, "invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(backend: Backend, api_key: str | None = None):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    started = int(time.time())

    def log(line: str) -> None:
        print(f"kvlocal serve: {line}", file=sys.stderr, flush=True)

    async def health(request: Request):
        c = backend.cache
        return JSONResponse({"status": "ok", "model": backend.model_id, "method": backend.chat_options["method"],
                             "budget": str(backend.chat_options["budget"]), "busy": backend.busy,
                             "queued": backend.queued, "served": backend.served, "conversations": len(c),
                             "cache_bytes": c.bytes, "cache_bytes_max": c.max_bytes, "evictions": c.evictions})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": backend.model_id, "object": "model", "created": started, "owned_by": "kvlocal",
             "kvlocal": {"file": Path(backend.model.path).name, "budget": str(backend.chat_options["budget"]),
                         "method": backend.chat_options["method"], "n_ctx_train": backend.model.n_ctx_train}}]})

    async def completions(request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, f"the request body is not valid JSON: {e}", code="invalid_json")
        try:
            job, stream, include_usage = parse_request(body, backend)
        except BadRequest as e:
            return error_response(400, str(e), param=e.param, code=e.code)
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def push(item) -> None:  # from the worker thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening
                job.cancelled.set()

        if stream:
            job.emit = lambda piece: push(("piece", piece))
        try:
            fut = backend.submit(job)
        except _ShuttingDown:
            return error_response(503, "the server is shutting down", "server_error")

        def done(f: concurrent.futures.Future) -> None:  # on the worker thread
            push(("end", None))
            if _exception(f) is None:
                _log_result(f.result())

        fut.add_done_callback(done)

        # wait for the first piece (or the end), watching for the client leaving meanwhile
        first = await _first(queue, request)
        if first is None:
            job.cancelled.set()
            log("client left before the reply began; stopped")
            return Response(status_code=499)
        if first[0] == "end" and _exception(fut) is not None:
            return _failed(_exception(fut))

        def chunk(delta: dict, finish=None, **extra) -> str:
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": backend.model_id,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        if not stream:
            r: Result = fut.result()
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": backend.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                             "finish_reason": r.finish_reason}],
                "usage": _usage(r), "kv": r.kv})

        async def events():
            try:
                yield chunk({"role": "assistant", "content": ""})
                item = first
                while item[0] == "piece":
                    yield chunk({"content": item[1]})
                    item = await queue.get()
                e = _exception(fut)
                if e is not None:
                    status, message, kind = _error_body(500, e)
                    if status == 500:
                        _print_failure(e)
                    error = {"message": message, "type": kind, "param": None, "code": None, "status": status}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                else:
                    r = fut.result()
                    yield chunk({}, r.finish_reason, kv=r.kv)
                    if include_usage:
                        obj = {"id": cid, "object": "chat.completion.chunk", "created": created,
                               "model": backend.model_id, "choices": [], "usage": _usage(r), "kv": r.kv}
                        yield f"data: {json.dumps(obj)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled.set()  # a client that left: the worker stops at the next token

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _usage(r: Result) -> dict:
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                "total_tokens": r.prompt_tokens + r.completion_tokens}

    def _log_result(r: Result) -> None:
        log(f"{r.mode} · {r.prompt_tokens:,} prompt + {r.completion_tokens:,} completion tokens · {r.finish_reason} · "
            f"{r.seconds:.2f} s · KV {r.kv['tokens_kept']:,} of {r.kv['tokens_seen']:,} tokens kept")

    def _print_failure(e: BaseException) -> None:
        log(f"a reply failed ({type(e).__name__}: {e}); its conversation was dropped, serving on")
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)

    def _failed(e: BaseException):
        status, message, kind = _error_body(500, e)
        if status == 500:
            _print_failure(e)
        return error_response(status, message, kind)

    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return error_response(404, f"no such endpoint: {request.method} {request.url.path} "
                                       f"(this server has /health, /v1/models, /v1/chat/completions)", code="not_found")
        if exc.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        return error_response(exc.status_code, str(exc.detail))

    async def unexpected(request: Request, exc: Exception):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    routes = [Route("/health", health, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]), Route("/models", models, methods=["GET"]),
              Route("/v1/chat/completions", completions, methods=["POST"]),
              Route("/chat/completions", completions, methods=["POST"])]
    middleware = [Middleware(_ApiKey, key=api_key)] if api_key else []
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: http_error, Exception: unexpected})


def _exception(fut: concurrent.futures.Future) -> BaseException | None:
    """The worker's error for a finished job (a job cancelled at shutdown: _ShuttingDown)."""
    if fut.cancelled():
        return _ShuttingDown()
    return fut.exception()


async def _first(queue: asyncio.Queue, request):
    """The first item from the worker, or None if the client disconnects first."""
    get = asyncio.ensure_future(queue.get())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (get, gone):
            if not t.done():
                t.cancel()
    if get.done() and not get.cancelled():
        return get.result()
    return None


async def _disconnected(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


if __name__ == "__main__":
    sys.exit(main())
