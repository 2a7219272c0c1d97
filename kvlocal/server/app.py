"""The HTTP side of ``kvlocal serve``: the Starlette app (``/health``, ``/v1/models``,
``/v1/chat/completions``, ``/v1/completions``, Ollama's ``/api/*``; streaming as server-sent events), the
API-key middleware, and binding and serving it with uvicorn. It does no model work: every job goes to the :class:`~kvlocal.server.worker.Worker`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import hmac
import ipaddress
import json
import socket
import sys
import time
import traceback
import uuid
from pathlib import Path

from kvlocal.errors import UsageError
from kvlocal.server import ollama
from kvlocal.server.requests import (BadRequest, _error_body, _error_detail, error_response, parse_completion,
                                     parse_request)
from kvlocal.chat.conversation import Result
from kvlocal.server.worker import Job, Worker, _ShuttingDown

_OPEN_PATHS = ("/health",)  # answered without the API key (liveness checks)


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


def _serve(app, sock: socket.socket, worker: Worker) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            worker.stopping.set()  # the reply in progress ends at its next token
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once it has stopped; we stop cleanly and return instead
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
    Server(config).run(sockets=[sock])


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


def create_app(worker: Worker, api_key: str | None = None):
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
        c, m = worker.cache, worker.recall_memory
        lost = worker.lost
        return JSONResponse({"status": "ok" if lost is None else "rpc_server_lost",
                             **({} if lost is None else {"rpc_servers_lost": list(lost.endpoints), "message": lost.text}),
                             "model": worker.model_id, "method": worker.settings.method,
                             "budget": worker.settings.budget, "busy": worker.busy,
                             "queued": worker.queued, "served": worker.served, "conversations": len(c),
                             "cache_bytes": c.bytes, "cache_bytes_max": c.max_bytes, "evictions": c.evictions,
                             "host_tier_cap_used": m.used, "host_tier_cap": m.limit})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": worker.model_id, "object": "model", "created": started, "owned_by": "kvlocal",
             "kvlocal": {"file": Path(worker.model.path).name, "budget": worker.settings.budget,
                         "method": worker.settings.method, "n_ctx_train": worker.model.n_ctx_train}}]})

    async def start(job: Job, stream: bool, request: Request, fail):
        """Submit ``job`` and wait for its first piece (or its end), watching for the client leaving: returns
        ``(future, queue, first)``, or the Response to send when it ended before a reply began. ``fail(status,
        message, type)``: the API's error response."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def push(item) -> None:  # from the worker thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening
                job.cancelled.set()

        if stream:
            job.emit = lambda piece: push(("piece", piece))
            job.emit_call = lambda index, call: push(("call", (index, call)))
        try:
            fut = worker.submit(job)
        except _ShuttingDown:
            return fail(503, "the server is shutting down", "server_error")

        def done(f: concurrent.futures.Future) -> None:  # on the worker thread
            push(("end", None))
            if _exception(f) is None:
                _log_result(f.result())

        fut.add_done_callback(done)
        first = await _first(queue, request)
        if first is None:
            job.cancelled.set()
            log("client left before the reply began; stopped")
            return Response(status_code=499)
        if first[0] == "end" and _exception(fut) is not None:
            e = _exception(fut)
            status, message, kind = _error_body(500, e)
            if status == 500:
                _print_failure(e)
            return fail(status, message, kind, **_error_detail(e))
        return fut, queue, first

    async def pieces(queue, first):
        """The reply's streamed items: ("piece", text) and ("call", (index, tool call)), until its end."""
        item = first
        while item[0] != "end":
            yield item
            item = await queue.get()

    async def read_json(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw), None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return None, f"the request body is not valid JSON: {e}"

    async def openai_job(request: Request, parse):
        """Read and ``parse`` an OpenAI request and start its job: ``(parsed, future, queue, first)``, or the
        Response to send (a 400, or the reply's end before it began)."""
        body, bad = await read_json(request)
        if bad:
            return error_response(400, bad, code="invalid_json")
        try:
            parsed = parse(body, worker)
        except BadRequest as e:
            return error_response(400, str(e), param=e.param, code=e.code)
        started = await start(parsed[0], parsed[1], request, error_response)
        return started if isinstance(started, Response) else (parsed, *started)

    def stream_error(fut) -> str | None:
        """The server-sent event for a reply that failed after it began streaming; None if it did not."""
        e = _exception(fut)
        if e is None:
            return None
        status, message, kind = _error_body(500, e)
        if status == 500:
            _print_failure(e)
        error = {"message": message, "type": kind, "param": None, "code": None, **_error_detail(e), "status": status}
        return f"data: {json.dumps({'error': error})}\n\n"

    async def completions(request: Request):
        started = await openai_job(request, parse_request)
        if isinstance(started, Response):
            return started
        (job, stream, include_usage), fut, queue, first = started
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(delta: dict, finish=None, **extra) -> str:
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": worker.model_id,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        if not stream:
            r: Result = fut.result()
            message = {"role": "assistant", "content": r.text or (None if r.tool_calls else "")}
            if r.tool_calls:
                message["tool_calls"] = r.tool_calls
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": worker.model_id,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": r.finish_reason}],
                "usage": _usage(r), "kv": r.kv})

        async def events():
            try:
                yield chunk({"role": "assistant", "content": ""})
                async for kind, value in pieces(queue, first):
                    if kind == "piece":
                        yield chunk({"content": value})
                    else:  # a tool call, whole: OpenAI's delta with its index
                        index, call = value
                        yield chunk({"tool_calls": [{"index": index, **call}]})
                error = stream_error(fut)
                if error:
                    yield error
                else:
                    r = fut.result()
                    yield chunk({}, r.finish_reason, kv=r.kv)
                    if include_usage:
                        obj = {"id": cid, "object": "chat.completion.chunk", "created": created,
                               "model": worker.model_id, "choices": [], "usage": _usage(r), "kv": r.kv}
                        yield f"data: {json.dumps(obj)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled.set()  # a client that left: the worker stops at the next token

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def text_completions(request: Request):
        """``/v1/completions``: a plain prompt, no chat template; a prompt that goes on from an earlier one and
        its completion reuses that cache."""
        started = await openai_job(request, parse_completion)
        if isinstance(started, Response):
            return started
        (job, stream, include_usage, echo), fut, queue, first = started
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def obj(text: str, finish=None, **extra) -> dict:
            return {"id": cid, "object": "text_completion", "created": created, "model": worker.model_id,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}], **extra}

        if not stream:
            r: Result = fut.result()
            return JSONResponse(obj((job.prompt if echo else "") + r.text, r.finish_reason, usage=_usage(r), kv=r.kv))

        async def events():
            try:
                if echo:
                    yield f"data: {json.dumps(obj(job.prompt), ensure_ascii=False)}\n\n"
                async for _, piece in pieces(queue, first):
                    yield f"data: {json.dumps(obj(piece), ensure_ascii=False)}\n\n"
                error = stream_error(fut)
                if error:
                    yield error
                else:
                    r = fut.result()
                    yield f"data: {json.dumps(obj('', r.finish_reason, kv=r.kv))}\n\n"
                    if include_usage:
                        yield f"data: {json.dumps({**obj(''), 'choices': [], 'usage': _usage(r)})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled.set()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- Ollama's API (kvlocal.server.ollama) -------------------------------------------------------
    def ollama_error(status: int, message: str, kind: str = "", **detail) -> Response:  # Ollama's: message only
        return JSONResponse({"error": message}, status_code=status)

    async def ollama_reply(request: Request, kind: str):
        body, bad = await read_json(request)
        if bad:
            return ollama_error(400, bad)
        try:
            job, stream, _ = parse_request(ollama.openai_body(body, kind), worker)
        except BadRequest as e:
            return ollama_error(400, str(e))
        started = await start(job, stream, request, ollama_error)
        if isinstance(started, Response):
            return started
        fut, queue, first = started
        if not stream:
            r: Result = fut.result()
            return JSONResponse({**ollama.reply_line(worker.model_id, kind, r.text, calls=r.tool_calls),
                                 **ollama.final_fields(r)})

        async def lines():
            try:
                async for item, value in pieces(queue, first):
                    line = (ollama.reply_line(worker.model_id, kind, value) if item == "piece"
                            else ollama.reply_line(worker.model_id, kind, "", calls=[value[1]]))
                    yield json.dumps(line, ensure_ascii=False) + "\n"
                e = _exception(fut)
                if e is not None:
                    status, message, _ = _error_body(500, e)
                    if status == 500:
                        _print_failure(e)
                    yield json.dumps({"error": message}) + "\n"
                else:
                    r = fut.result()
                    yield json.dumps({**ollama.reply_line(worker.model_id, kind, ""), **ollama.final_fields(r)}) + "\n"
            finally:
                job.cancelled.set()  # a client that left: the worker stops at the next token

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def ollama_chat(request: Request):
        return await ollama_reply(request, "chat")

    async def ollama_generate(request: Request):
        return await ollama_reply(request, "generate")

    async def ollama_tags(request: Request):
        return JSONResponse(ollama.tags(worker))

    async def ollama_show(request: Request):
        body, bad = await read_json(request)
        if bad:
            return ollama_error(400, bad)
        try:
            return JSONResponse(ollama.show(worker, body))
        except LookupError as e:
            return ollama_error(404, str(e.args[0]))

    async def ollama_version(request: Request):
        return JSONResponse({"version": ollama.VERSION})

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
        return error_response(status, message, kind, **_error_detail(e))

    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return error_response(404, f"no such endpoint: {request.method} {request.url.path} "
                                       f"(this server has /health, /v1/models, /v1/chat/completions, /v1/completions and Ollama's /api/chat, "
                                       f"/api/generate, /api/tags, /api/show)", code="not_found")
        if exc.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        return error_response(exc.status_code, str(exc.detail))

    async def unexpected(request: Request, exc: Exception):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    routes = [Route("/health", health, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]), Route("/models", models, methods=["GET"]),
              Route("/v1/chat/completions", completions, methods=["POST"]),
              Route("/chat/completions", completions, methods=["POST"]),
              Route("/v1/completions", text_completions, methods=["POST"]),
              Route("/completions", text_completions, methods=["POST"]),
              Route("/api/chat", ollama_chat, methods=["POST"]), Route("/api/generate", ollama_generate, methods=["POST"]),
              Route("/api/tags", ollama_tags, methods=["GET"]), Route("/api/show", ollama_show, methods=["POST"]),
              Route("/api/version", ollama_version, methods=["GET"])]
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
