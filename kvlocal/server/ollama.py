"""Ollama's API on ``kvlocal serve``, for the desktop apps that speak it: ``POST /api/chat`` and
``/api/generate`` (NDJSON streaming by default, as Ollama), ``GET /api/tags``, ``POST /api/show``,
``GET /api/version``. A request becomes the same worker job as an OpenAI one (its body is translated to
:func:`~kvlocal.server.requests.parse_request`'s), so conversations reuse their compressed caches alike;
the replies have Ollama's shapes plus kvlocal's ``kv`` object; tools as Ollama passes them (a call's
arguments as an object). What kvlocal cannot do (images, ``format``, ``raw`` prompts) is a 400 that says
so, not ignored."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

from kvlocal.server.requests import BadRequest

VERSION = "0.6.0"  # the Ollama API version whose shapes these follow

# Ollama's options -> the OpenAI-style request's fields parse_request reads
_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
            "num_predict": "max_tokens", "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
            "stop": "stop"}


def openai_body(body, kind: str) -> dict:
    """An Ollama ``/api/chat`` or ``/api/generate`` body as the OpenAI-style body :func:`parse_request` reads
    (``stream`` defaults to true, as Ollama's). BadRequest for what kvlocal does not do."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None, "invalid_type")
    for name, why in (("format", "structured output"), ("images", "images"), ("raw", "raw prompts"),
                      ("suffix", "fill-in-the-middle")):
        if body.get(name):
            raise BadRequest(f"{name}: {why} are not supported by this server", name, "unsupported_parameter")
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("options must be an object", "options", "invalid_type")
    out = {"stream": body.get("stream", True), "kv": body.get("kv")}  # kv: kvlocal's cache settings, as for OpenAI
    if body.get("tools"):
        if kind != "chat":
            raise BadRequest("tools: /api/generate takes none; use /api/chat", "tools", "unsupported_parameter")
        out["tools"] = body["tools"]
    for name, value in options.items():
        if name in _OPTIONS and not (name == "num_predict" and value in (-1, -2)):  # -1: until done
            out[_OPTIONS[name]] = value
    if kind == "chat":
        messages = body.get("messages")
        if isinstance(messages, list):
            for i, m in enumerate(messages):
                if isinstance(m, dict) and m.get("images"):
                    raise BadRequest(f"messages[{i}].images: this server is text-only", f"messages[{i}].images",
                                     "unsupported_content")
        out["messages"] = [{k: m[k] for k in ("role", "content", "tool_calls") if k in m} if isinstance(m, dict) else m
                           for m in messages] if isinstance(messages, list) else messages
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadRequest("prompt is required: a non-empty string", "prompt", "missing_required_parameter")
        system = body.get("system")
        out["messages"] = ([{"role": "system", "content": system}] if isinstance(system, str) and system else []) + \
            [{"role": "user", "content": prompt}]
    return out


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def reply_line(model_id: str, kind: str, text: str, done: bool = False, calls: list[dict] | None = None) -> dict:
    """One object of a reply: the text so far (a streamed piece, or the whole reply) and tool calls, in
    Ollama's shape (``{"function": {"name", "arguments": {...}}}``)."""
    part = {"message": {"role": "assistant", "content": text}} if kind == "chat" else {"response": text}
    if calls:
        part["message"]["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                                       "arguments": json.loads(c["function"]["arguments"])}}
                                         for c in calls]
    return {"model": model_id, "created_at": now(), **part, "done": done}


def final_fields(r) -> dict:
    """The end of a reply: why it stopped, Ollama's counts and durations (ns), and kvlocal's ``kv``."""
    ns = int(r.seconds * 1e9)
    return {"done": True, "done_reason": r.finish_reason if r.finish_reason in ("length", "loop") else "stop", "total_duration": ns,
            "load_duration": 0, "prompt_eval_count": r.prompt_tokens, "prompt_eval_duration": 0,
            "eval_count": r.completion_tokens, "eval_duration": ns, "kv": r.kv}


def _details(model) -> dict:
    name = Path(model.path).name
    quant = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    return {"parent_model": "", "format": "gguf", "family": model.meta("general.architecture") or "",
            "families": [model.meta("general.architecture") or ""], "parameter_size": model.meta("general.size_label") or "",
            "quantization_level": quant.split("-")[-1].upper()}


def _digest(path: Path) -> str:
    st = path.stat()  # not the file's hash (seconds for a large file): its name, size and time
    return hashlib.sha256(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


def tags(worker) -> dict:
    path = Path(worker.model.path)
    modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"models": [{"name": worker.model_id, "model": worker.model_id, "modified_at": modified,
                        "size": path.stat().st_size, "digest": _digest(path), "details": _details(worker.model)}]}


def show(worker, body) -> dict:
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    if name not in (None, worker.model_id):
        raise LookupError(f"model {name!r} not found: this server serves {worker.model_id!r}")
    m = worker.model
    return {"modelfile": f"FROM {Path(m.path).name}\n", "parameters": "",
            "template": m.meta("tokenizer.chat_template") or "", "details": _details(m),
            "model_info": {"general.architecture": m.meta("general.architecture") or "",
                           "general.parameter_count": 0, "context_length": m.n_ctx_train},
            "capabilities": ["completion"] + (["tools"] if worker.tool_format else []), "modified_at": tags(worker)["models"][0]["modified_at"],
            "kvlocal": {"budget": worker.settings.budget, "method": worker.settings.method}}
