"""The messages a conversation takes: OpenAI-style messages (what the server's routes and :class:`kvlocal.Llama`
receive) checked and put in the one shape :class:`kvlocal.Chat` and the conversation core
(:mod:`kvlocal.chat.conversation`) read. :class:`BadMessage` names the message and field at fault, so that the
server answers a 400 with its ``param`` and ``kvlocal.Llama`` raises it as it is."""

from __future__ import annotations

import json

from kvlocal.errors import UsageError

_TEXT_ONLY = ("image_url", "input_image", "image", "input_audio", "audio", "file", "input_file", "video", "video_url")


class BadMessage(UsageError):
    """A message that cannot be read: ``param`` is its JSON path (``messages[2].content``), ``code`` the kind of
    fault (OpenAI's error codes: ``invalid_value``, ``invalid_type``, ...)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def normalize_messages(raw) -> list[dict]:
    """OpenAI-style messages as kvlocal's chats take them: an optional system message first (``developer``
    is ``system``, an empty one is none), then user and assistant turns, an assistant's tool calls followed
    by the ``tool`` messages with their results; the last is a user or tool message. Text parts are joined.
    BadRequest names what is wrong."""
    if not isinstance(raw, list) or not raw:
        if raw is None:
            raise BadMessage("messages is required: a list of {role, content}", "messages", "missing_required_parameter")
        raise BadMessage("messages must be a non-empty list of {role, content}", "messages", "invalid_type")
    out = []
    calls: dict | None = None  # the call ids of the assistant message the tool messages answer
    prev = None
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadMessage(f"{where} must be an object with role and content", where, "invalid_type")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant", "tool"):
            raise BadMessage(f"{where}.role must be system, user, assistant or tool (got {json.dumps(role)[:40]})",
                             f"{where}.role", "invalid_value")
        if role == "system":
            if i > 0:
                raise BadMessage(f"{where}: a system message may only come first", f"{where}.role", "invalid_value")
            content = _content(m.get("content"), f"{where}.content")
            if content:  # an empty system message is no system message (as kvlocal.Chat has it)
                out.append({"role": "system", "content": content})
            continue
        allowed = {None: ("user",), "user": ("assistant",), "assistant": ("user",), "calls": ("tool",),
                   "tool": ("tool", "assistant", "user")}[prev]
        if role not in allowed:
            why = {"tool": "a tool message must answer the tool_calls of the assistant message before it"}.get(
                role, f"after {'the system message' if prev is None else 'a ' + prev + ' message'} comes "
                      f"{' or '.join(allowed)} (got {role})")
            if prev == "calls":
                why = f"the assistant's tool_calls must be answered by tool messages (got {role})"
            raise BadMessage(f"{where}: {why}", f"{where}.role", "invalid_value")
        msg = {"role": role}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
            msg["content"] = "" if m.get("content") is None else _content(m["content"], f"{where}.content")
            calls = {c["id"] for c in msg["tool_calls"] if c.get("id")}
            prev = "calls"
        elif role == "tool":
            msg["content"] = _content(m.get("content"), f"{where}.content")
            cid = m.get("tool_call_id")
            if cid is not None:
                if not isinstance(cid, str):
                    raise BadMessage(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id", "invalid_type")
                if calls and cid not in calls:
                    raise BadMessage(f"{where}.tool_call_id {cid!r} is not a call of the assistant message before it",
                                     f"{where}.tool_call_id", "invalid_value")
                msg["tool_call_id"] = cid
            prev = "tool"
        else:
            msg["content"] = _content(m.get("content"), f"{where}.content")
            prev = role
        out.append(msg)
    if prev not in ("user", "tool"):
        raise BadMessage("the last message must be a user message (or the tool messages answering the assistant's calls)",
                         "messages", "invalid_value")
    if prev == "user" and not out[-1]["content"].strip():
        raise BadMessage("the last user message is empty", f"messages[{len(raw) - 1}].content", "invalid_value")
    return out


def _tool_calls(raw, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, checked: ``[{"id", "type": "function", "function": {"name",
    "arguments": JSON text of an object}}]``."""
    if not isinstance(raw, list):
        raise BadMessage(f"{where} must be a list of calls", where, "invalid_type")
    out = []
    for k, c in enumerate(raw):
        at = f"{where}[{k}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or c.get("type", "function") != "function":
            raise BadMessage(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                             at, "invalid_value")
        args = f.get("arguments", "{}")
        try:
            ok = isinstance(json.loads(args) if isinstance(args, str) else args, dict)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise BadMessage(f"{at}.function.arguments must be a JSON object (as text)", f"{at}.function.arguments",
                             "invalid_value")
        call = {"type": "function", "function": {"name": f["name"], "arguments": args if isinstance(args, str)
                                                 else json.dumps(args, ensure_ascii=False)}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
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
                raise BadMessage(f"{where}[{k}]: {kind} parts are not supported: this server is text-only",
                                 f"{where}[{k}].type", "unsupported_content")
            else:
                raise BadMessage(f"{where}[{k}] must be {{\"type\": \"text\", \"text\": str}}", f"{where}[{k}]", "invalid_value")
        return "\n".join(texts)
    raise BadMessage(f"{where} must be a string or a list of text parts", where,
                     "missing_required_parameter" if c is None else "invalid_type")
