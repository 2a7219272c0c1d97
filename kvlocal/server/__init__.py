"""``kvlocal serve``: an OpenAI-compatible chat server on one model, every conversation in a bounded KV
cache (docs/server.md).

    kvlocal serve qwen2.5-coder-0.5b --budget 256 --port 8080
    curl http://127.0.0.1:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Design
------
* One :class:`~kvlocal.runtime.Model` is loaded and shared by every conversation; each conversation is
  a :class:`kvlocal.Chat` (its own llama.cpp context, its own compressed cache).
* All llama.cpp work runs on ONE worker thread (a single-thread executor:
  :class:`~kvlocal.server.worker.Worker`): requests queue for it, two threads never touch an engine at
  once, and the event loop (:mod:`kvlocal.server.app`) stays free (``/health`` answers while a reply is
  generated). A streaming reply's pieces go from the worker to the response through an asyncio queue
  (``loop.call_soon_threadsafe``).
* Conversation cache (:class:`~kvlocal.chat.conversation.ConversationCache`, looked up by the conversation core
  :class:`~kvlocal.chat.conversation.Conversations`, as :class:`kvlocal.Llama` looks up its own): finished chats are
  kept in an LRU keyed by their transcript as the client saw it
  (system, then user/assistant messages, ending with the reply just sent). A request whose messages
  minus the last are such a transcript takes that chat out, reads only the new user message into its
  compressed cache and puts it back under its new transcript; a request that repeats the last user
  message of a cached transcript (a "regenerate") takes its chat back to before that reply
  (:meth:`Chat.regen`). Anything else builds a new chat and reads the history into it. The LRU is
  bounded by the chats' KV bytes (``--cache-mib``) and their number (``--cache-chats``); evicted chats
  are closed.
* A client that goes away stops its reply at the next token; the conversation stays cached with the
  partial reply. An error inside generation answers 500 and drops that chat; the server goes on.

Modules, each importing only those before it: :mod:`~kvlocal.server.store` (``--session-dir``),
:mod:`~kvlocal.server.worker` (the worker thread: jobs on the conversation core, streamed back),
:mod:`~kvlocal.server.requests` (parsing and validating a request; error bodies),
:mod:`~kvlocal.server.app` (the Starlette app, binding and serving), and this one: the command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvlocal.errors import UsageError, worded
from kvlocal.options import (add_budget_args, add_llama_args, add_model_arg, add_sampling_args, sampler_from_args,
                             sampling_params, settings_from_args)
from kvlocal.server.app import _bind, _serve, create_app
from kvlocal.server.store import ChatStore
from kvlocal.server.worker import DEFAULT_CACHE_CHATS, DEFAULT_CACHE_MIB, Worker


# -- command line ----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    add_llama_args(p)
    add_budget_args(p)
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
    g.add_argument("--session-dir", metavar="DIR", default=None,
                   help="write each conversation's compressed cache to DIR after every reply and continue it from there "
                        "after a restart (default: conversations live in memory only)")
    g.add_argument("--session-max", metavar="SIZE", default="2G",
                   help="most bytes --session-dir may hold; the least recently used conversations go first (default 2G)")
    g.add_argument("--pin-system", choices=("on", "off"), default="on",
                   help="never evict a conversation's system message (default on; it counts in the budget)")
    g.add_argument("-n", "--n-predict", type=int, default=512,
                   help="most tokens of a reply when a request gives no max_tokens (default 512)")
    add_sampling_args(p, interactive=True)  # server defaults; a request's temperature, top_p, seed, ... override them


def run(args) -> int:
    from kvlocal.models import DEFAULT_MODEL, KNOWN_MODELS, resolve
    from kvlocal.runtime import Sampler

    _check_args(args)
    runtime, settings = settings_from_args(args, max_reply=args.n_predict)  # every setting checked, worded as its flag
    sampler_from_args(args).close()  # the default sampling flags, checked (UsageError names the flag)
    sock, url, loopback = _bind(args.host, args.port)
    model = worker = None
    try:
        path = resolve(args.model)
        name = args.model or DEFAULT_MODEL
        model_id = name if name in KNOWN_MODELS else Path(path).stem
        model = runtime.load(path)
        sampling = sampling_params(args, model)  # the model's own sampling where its GGUF declares one
        worker = Worker(model, model_id, chat_options=settings, n_threads=runtime.n_threads, defaults=sampling,
            max_tokens=args.n_predict, cache_bytes=int(args.cache_mib * 2**20), cache_chats=args.cache_chats,
            store=None if args.session_dir is None else ChatStore(args.session_dir, args.session_max_bytes),
            load=(lambda: runtime.load(path)) if runtime.rpc else None)
        cells = worker.check()  # builds one chat: a budget or method that cannot work fails here, not per request
        if not loopback and not args.api_key:
            print(f"kvlocal serve: warning: listening on {args.host} without --api-key: anyone who can reach "
                  f"this port can use the model", file=sys.stderr)
        print(f"kvlocal serve · {model_id} · budget {settings.budget} ({cells:,} cells) · {args.method} · "
              f"sampling {Sampler(**sampling).describe()} · {url} (OpenAI API at {url}/v1)", file=sys.stderr, flush=True)
        _serve(create_app(worker, api_key=args.api_key), sock, worker)
    finally:
        if worker is not None:
            worker.close()
            model = worker.model  # loaded again if an rpc-server was lost and came back
        if model is not None:
            model.close()
        sock.close()
    print("kvlocal serve: stopped", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvlocal.server``: the same command outside the ``kvlocal`` CLI."""
    p = argparse.ArgumentParser(prog="kvlocal serve", description="An OpenAI-compatible chat server in a bounded KV cache.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        from kvlocal.settings import flag_name

        print(f"kvlocal: error: {worded(e, flag_name)}", file=sys.stderr)
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
    if args.session_dir is not None:
        d = Path(args.session_dir)
        if not d.is_dir():
            raise UsageError(f"--session-dir {d}: no such folder (create it first)")
        if not os.access(d, os.W_OK | os.X_OK):
            raise UsageError(f"--session-dir {d} is not writable: give a folder you can write to")
    from kvlocal.units import parse_size

    args.session_max_bytes = parse_size(args.session_max, "--session-max")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty: give a key, or leave the flag out")
