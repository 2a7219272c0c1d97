"""Request parsing and validation for ``kvlocal serve``: a chat completion request becomes a worker
:class:`~kvlocal.server.worker.Job`, or a :class:`BadRequest` naming what is wrong; and the OpenAI-style
error bodies."""

from __future__ import annotations

import json

from kvlocal.errors import UsageError
from kvlocal.server.worker import Job, Worker, _ShuttingDown

MAX_STOPS = 16
_TEXT_ONLY = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video", "video_url")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def parse_request(body, worker: Worker) -> tuple[Job, bool, bool]:
    """A chat completion request -> (job, stream, include_usage); BadRequest names what is wrong."""
    from kvlocal.runtime import Sampler, SamplerParamError

    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None, "invalid_type")
    messages = normalize_messages(body.get("messages"))

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

    max_tokens = get("max_completion_tokens", int) or get("max_tokens", int) or worker.max_tokens
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

    d = worker.defaults
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
    return Job(messages, sampler, max_tokens, stops, reuse, _kv_options(body.get("kv"))), stream, include_usage


def _kv_options(raw) -> dict:
    """The request's ``kv`` extension object: this conversation's cache settings instead of the server's
    (``budget``: a ratio or a cell count; ``method``; ``recall``: true, false or "auto")."""
    from kvlocal.compress import METHODS
    from kvlocal.engine import Budget

    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadRequest("kv must be an object: {\"budget\", \"method\", \"recall\"}", "kv", "invalid_type")
    unknown = sorted(set(raw) - {"budget", "method", "recall"})
    if unknown:
        raise BadRequest(f"kv.{unknown[0]} is not a cache setting (kv takes budget, method and recall)", f"kv.{unknown[0]}",
                         "unsupported_parameter")
    out = {}
    if "budget" in raw:
        try:
            out["budget"] = str(Budget.parse(raw["budget"]))
        except (UsageError, TypeError, ValueError) as e:
            raise BadRequest(f"kv.budget: {e}", "kv.budget", "invalid_value") from None
    if "method" in raw:
        if raw["method"] not in METHODS:
            raise BadRequest(f"kv.method must be one of {', '.join(sorted(METHODS))} (got {json.dumps(raw['method'])[:40]})",
                             "kv.method", "invalid_value")
        out["method"] = raw["method"]
    if "recall" in raw:
        if raw["recall"] not in (True, False, "auto"):
            raise BadRequest("kv.recall must be true, false or \"auto\"", "kv.recall", "invalid_value")
        out["recall"] = None if raw["recall"] == "auto" else raw["recall"]
    return out


def normalize_messages(raw) -> list[dict]:
    """OpenAI-style messages as kvlocal's chats take them: an optional system message first (``developer``
    is ``system``, an empty one is none), then user and assistant alternating, ending with user; text
    parts joined. BadRequest names what is wrong."""
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


# -- error bodies -----------------------------------------------------------------------------------------
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
