"""Request parsing and validation for ``kvlocal serve``: a chat completion request becomes a worker
:class:`~kvlocal.server.worker.Job`, or a :class:`BadRequest` naming what is wrong; and the OpenAI-style
error bodies."""

from __future__ import annotations

import json

from kvlocal.chat.messages import BadMessage, normalize_messages
from kvlocal.errors import KvlocalError, UsageError
from kvlocal.server.worker import Job, Worker, _ShuttingDown

MAX_STOPS = 16


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def parse_request(body, worker: Worker) -> tuple[Job, bool, bool]:
    """A chat completion request -> (job, stream, include_usage); BadRequest names what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None, "invalid_type")
    try:
        messages = normalize_messages(body.get("messages"))
    except BadMessage as e:
        raise BadRequest(str(e), e.param, e.code) from None
    for name, instead in (("functions", "; use tools"), ("logit_bias", "")):
        if body.get(name):
            raise BadRequest(f"{name} are not supported by this server{instead}", name, "unsupported_parameter")
    tools, tool_choice = _tools(body.get("tools"), body.get("tool_choice"), worker)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise BadRequest("response_format: only {\"type\": \"text\"} is supported", "response_format", "unsupported_value")
    job, stream, include_usage = _job(body, worker, worker.max_tokens)
    job.messages, job.tools, job.tool_choice = messages, tools, tool_choice
    return job, stream, include_usage


def parse_completion(body, worker: Worker) -> tuple[Job, bool, bool, bool]:
    """A plain completion request (``/v1/completions``) -> (job, stream, include_usage, echo)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None, "invalid_type")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise BadRequest("prompt: one string per request (lists of prompts or of token ids are not supported)", "prompt",
                         "unsupported_value")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt is required: a non-empty string", "prompt",
                         "missing_required_parameter" if prompt is None else "invalid_value")
    for name, why in (("suffix", "fill-in-the-middle"), ("logit_bias", "logit_bias")):
        if body.get(name):
            raise BadRequest(f"{name}: {why} is not supported by this server", name, "unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("best_of must be 1: this server generates one choice per request", "best_of", "unsupported_value")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("echo must be a boolean", "echo", "invalid_type")
    job, stream, include_usage = _job(body, worker, 16)  # OpenAI's default for plain completions
    job.prompt = prompt
    return job, stream, include_usage, echo


def _job(body: dict, worker: Worker, default_max: int) -> tuple[Job, bool, bool]:
    """What chat and plain completion requests share: sampling, length, stops, streaming, cache reuse and the
    ``kv`` object, as a Job without its messages or prompt."""
    import dataclasses

    from kvlocal.runtime import SAMPLING_PARAMS, Sampler, SamplerParamError

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
    if body.get("logprobs") not in (None, False, 0):
        raise BadRequest("logprobs are not supported", "logprobs", "unsupported_parameter")
    for name in ("frequency_penalty", "presence_penalty"):
        if get(name, float, 0.0) != 0:
            raise BadRequest(f"{name} is not supported (give 0 or leave it out); repeat_penalty is", name, "unsupported_value")

    max_tokens = get("max_completion_tokens", int) or get("max_tokens", int) or default_max
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
    names = {"temp": "temperature"}  # Sampler's names -> the request's (llama-server's)
    own = {f.name: f.default for f in dataclasses.fields(Sampler)}  # each parameter's type is its default's
    params = {p: get(names.get(p, p), type(own[p]), d.get(p, own[p])) for p in SAMPLING_PARAMS}
    seed = body.get("seed", None)
    params["seed"] = d.get("seed") if seed is None else None if get("seed", int) == -1 else get("seed", int)
    try:
        sampler = Sampler(**params)
    except SamplerParamError as e:
        name = names.get(e.param, e.param)
        rule = e.rule.replace("or None (random)", "or -1 (random)")
        raise BadRequest(f"{name} must be {rule} (got {e.value})", name, "invalid_value") from None
    return Job([], sampler, max_tokens, stops, reuse, _kv_options(body.get("kv"), worker.settings)), stream, include_usage


def _tools(raw, choice, worker: Worker) -> tuple[list[dict] | None, str | dict]:
    """(tools, tool_choice) of a request: the definitions checked, the model's template able to take them;
    ``tool_choice: "none"`` leaves them out of the prompt (as llama-server does)."""
    from kvlocal.chat.toolcalls import check_tool_choice, check_tools

    try:
        tools = check_tools(raw) if raw else None
    except UsageError as e:
        raise BadRequest(str(e), "tools", "invalid_value") from None
    try:
        choice = check_tool_choice(choice, tools)
    except UsageError as e:
        raise BadRequest(str(e), "tool_choice", "invalid_value") from None
    if tools and worker.tool_format is None:
        raise BadRequest(f"the chat template of {worker.model_id} does not take tools: serve a model whose template does "
                         f"(e.g. Qwen2.5), or leave tools out", "tools", "unsupported_parameter")
    return (tools, choice) if tools and choice != "none" else (None, "auto")


def json_name(field: str) -> str:
    """How a request names the setting ``field``: ``kv.budget`` where its ``kv`` object may set it, else the
    server's flag (``-c/--ctx-size``: the server's own setting). Errors are worded with it
    (:func:`kvlocal.errors.worded`)."""
    from kvlocal.settings import flag_name, request_fields

    return f"kv.{field}" if field in request_fields() else flag_name(field)


def _kv_options(raw, settings) -> dict:
    """The request's ``kv`` extension object: the settings this conversation takes instead of the server's
    ``settings`` (those :func:`kvlocal.settings.request_fields` names: the budget, a ratio or a cell count; the
    method; recall, true, false or "auto"), checked as the settings check them: BadRequest names the field."""
    import dataclasses

    from kvlocal.errors import SettingError
    from kvlocal.settings import request_fields

    if raw is None:
        return {}
    fields = request_fields()
    takes = ", ".join(f'"{f}"' for f in fields)
    if not isinstance(raw, dict):
        raise BadRequest(f"kv must be an object: {{{takes}}}", "kv", "invalid_type")
    out = {}
    for name, value in raw.items():
        if name not in fields:
            listed = f"{', '.join(list(fields)[:-1])} and {list(fields)[-1]}"
            raise BadRequest(f"kv.{name} is not a cache setting (kv takes {listed})", f"kv.{name}",
                             "unsupported_parameter")
        pairs = fields[name]
        if pairs is not None:
            match = [v for j, v in pairs if j is value or (j == value and type(j) is type(value))]
            if not match:
                rule = ", ".join(json.dumps(j) for j, _ in pairs[:-1]) + f" or {json.dumps(pairs[-1][0])}"
                raise BadRequest(f"kv.{name} must be {rule}", f"kv.{name}", "invalid_value")
            value = match[0]
        out[name] = value
    try:
        checked = dataclasses.replace(settings, **out)
    except SettingError as e:
        raise BadRequest(e.worded(json_name), json_name(e.field or "kv"), "invalid_value") from None
    except (TypeError, ValueError) as e:
        raise BadRequest(f"kv: {e}", "kv", "invalid_value") from None
    return {name: getattr(checked, name) for name in out}


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


def _error_detail(e: BaseException) -> dict:
    """The ``param`` and ``code`` of an error raised by the worker: a setting's name as the request gives it
    (:func:`json_name`) and its kind's code; none for other errors."""
    if isinstance(e, KvlocalError):
        return dict(param=None if e.field is None else json_name(e.field), code=e.code)
    return {}


def _error_body(status: int, e: BaseException) -> tuple[int, str, str]:
    """(status, message, type) of an error raised by the worker."""
    if isinstance(e, _ShuttingDown):
        return 503, "the server is shutting down", "server_error"
    if isinstance(e, KvlocalError):  # a setting named as the request names it, the status its kind's
        return e.status, e.worded(json_name), "invalid_request_error" if e.status < 500 else "server_error"
    if isinstance(e, UsageError):
        return 400, str(e), "invalid_request_error"
    return status, f"generation failed: {type(e).__name__}: {e}", "server_error"
