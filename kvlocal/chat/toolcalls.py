"""Tool calls: OpenAI-style tool definitions in, the model's calls out.

The tools are rendered by the GGUF's own Jinja template (the ``tools`` variable, as Hugging Face's
``apply_chat_template`` passes it), so the model sees them in the words it was trained on; a template that
does not use ``tools`` cannot take them (:func:`kvlocal.runtime.chat_template.tool_format` is None). The model writes its calls as text,
in its family's format, and :class:`CallFilter` takes them out of the streamed reply:

- ``hermes`` — Qwen 2.5/3, Hermes, SmolLM3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text around them is content;
- ``llama3`` — Llama 3.1–3.3: the whole reply is ``{"name": ..., "parameters": {...}}`` (several joined by
  ``;``), optionally after ``<|python_tag|>``;
- either family: a reply that is only such objects, bare or in a ```json fence, naming the tools given
  (small models leave out the markup).

A reply's calls are returned in OpenAI's shape (``{"id", "type": "function", "function": {"name",
"arguments": JSON text}}``). Text that looks like a call but is not valid JSON stays content: a model's
mistake is shown, not dropped. ``tool_choice="required"`` or a named function is honoured by beginning
the reply with the format's opening (:func:`forced_prefix`), so the model can only go on with a call.
"""

from __future__ import annotations

import json
import re
import uuid

from kvlocal.errors import UsageError
from kvlocal.runtime import HERMES_OPEN as _HERMES_OPEN

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


# -- definitions -------------------------------------------------------------------------------------------
def check_tools(tools, where: str = "tools") -> list[dict]:
    """OpenAI tool definitions, checked: ``[{"type": "function", "function": {"name", "description"?,
    "parameters"?: a JSON schema object}}]``. UsageError names the first thing wrong (``where`` prefixes it)."""
    if not isinstance(tools, list) or not tools:
        raise UsageError(f"{where} must be a non-empty list of {{\"type\": \"function\", \"function\": {{...}}}}")
    names = set()
    out = []
    for i, t in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise UsageError(f"{at} must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise UsageError(f"{at}.function.name must be 1-64 letters, digits, _ . or - (got {json.dumps(name)[:40]})")
        if name in names:
            raise UsageError(f"{at}.function.name: {name!r} is defined twice")
        names.add(name)
        if "description" in f and not isinstance(f["description"], str):
            raise UsageError(f"{at}.function.description must be a string")
        params = f.get("parameters")
        if params is not None:
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise UsageError(f"{at}.function.parameters must be a JSON schema object ({{\"type\": \"object\", ...}})")
            props = params.get("properties", {})
            if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
                raise UsageError(f"{at}.function.parameters.properties must map names to schemas")
            required = params.get("required", [])
            if not isinstance(required, list) or not all(isinstance(r, str) and r in props for r in required):
                raise UsageError(f"{at}.function.parameters.required must list names of its properties")
        out.append({"type": "function", "function": {k: f[k] for k in ("name", "description", "parameters") if k in f}})
    return out


def check_tool_choice(choice, tools: list[dict] | None) -> str | dict:
    """A ``tool_choice``, checked against the tools: ``"auto"`` (also for None), ``"none"``, ``"required"``, or
    ``{"type": "function", "function": {"name": ...}}`` naming one of them. UsageError names what is wrong."""
    if choice in (None, "auto", "none"):
        return choice or "auto"
    f = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = f.get("name") if isinstance(f, dict) else None
    if choice != "required" and not isinstance(name, str):
        raise UsageError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')
    if not tools:
        raise UsageError("tool_choice needs tools")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise UsageError(f"tool_choice names {name!r}, which is not one of the tools")
    return choice


def forced_prefix(fmt: str, name: str | None = None) -> str:
    """The start of a reply that can only go on with a call (of ``name``, if given)."""
    head = '{"name": "' + (name + ('", "arguments": ' if fmt == "hermes" else '", "parameters": ') if name else "")
    return _HERMES_OPEN + "\n" + head if fmt == "hermes" else head


# -- calls -------------------------------------------------------------------------------------------------
def new_call(name: str, arguments) -> dict:
    """A call in OpenAI's shape; ``arguments`` as JSON text."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _call_from_json(text: str, args_key: str) -> dict | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return new_call(obj["name"], args) if isinstance(args, dict) else None


def parse(text: str, fmt: str, names: set[str] | None = None) -> tuple[str, list[dict]]:
    """(content, calls) of a whole reply (:class:`CallFilter`)."""
    f = CallFilter(fmt, names)
    content = f.feed(text) + f.finish()
    return content, f.calls


class CallFilter:
    """Takes a streamed reply's calls out of its text: :meth:`feed` returns the content that is sure not to be
    part of a call (held back while it might be), completed calls are appended to :attr:`calls` as soon as
    their text ends; :meth:`finish` returns what was held back at the reply's end.

    Besides its family's own markup, a reply that is nothing but call objects — bare, or in a ```json
    fence, as small models often write them (Qwen2.5-Coder-0.5B leaves out ``<tool_call>``) — is taken as
    calls when every object names one of ``names``."""

    def __init__(self, fmt: str, names: set[str] | None = None):
        if fmt not in ("hermes", "llama3"):
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt, self.names = fmt, names
        self.calls: list[dict] = []
        self._args = "arguments" if fmt == "hermes" else "parameters"
        self._buf = ""  # text not decided yet
        self._in_call = False  # hermes: inside <tool_call>
        self._bare: bool | None = None  # the reply may be only call objects (None: not known yet)

    def feed(self, piece: str) -> str:
        self._buf += piece
        if self._bare is None:
            head = self._buf.lstrip()
            openers = ("{", "```") + ((_PYTHON_TAG,) if self.fmt == "llama3" else ())
            if not head:
                return ""
            if head.startswith(openers):
                self._bare = True
            elif any(o.startswith(head) for o in openers):
                return ""  # "`" or "<|py": not known yet
            else:
                self._bare = False
        if self._bare:
            return ""  # held to the end: calls, or content after all
        if self.fmt == "hermes":
            return self._hermes()
        out, self._buf = self._buf, ""
        return out

    def finish(self) -> str:
        """The end of the reply: the rest, with a last call that its end-of-turn closed."""
        rest, self._buf = self._buf, ""
        if self._bare:
            calls = [_call_from_json(part, self._args) for part in _objects(rest)]
            if calls and all(c is not None and (self.names is None or c["function"]["name"] in self.names) for c in calls):
                self.calls.extend(calls)
                return ""
            return rest
        if self.fmt == "hermes" and self._in_call:
            call = _call_from_json(rest.strip(), self._args)
            if call is not None:
                self.calls.append(call)
                return ""
            return _HERMES_OPEN + rest
        return "" if self.calls and not rest.strip() else rest

    def _hermes(self) -> str:
        out = []
        while True:
            if self._in_call:
                end = self._buf.find(_HERMES_CLOSE)
                if end < 0:
                    return "".join(out)
                body, self._buf = self._buf[:end], self._buf[end + len(_HERMES_CLOSE):]
                self._in_call = False
                call = _call_from_json(body.strip(), "arguments")
                if call is not None:
                    self.calls.append(call)
                else:
                    out.append(_HERMES_OPEN + body + _HERMES_CLOSE)  # not a call after all: shown as written
                continue
            start = self._buf.find(_HERMES_OPEN)
            if start >= 0:
                before = self._buf[:start]
                if before.strip() or not self.calls:  # the line breaks between two calls are not content
                    out.append(before)
                self._buf = self._buf[start + len(_HERMES_OPEN):]
                self._in_call = True
                continue
            keep = _partial(self._buf, _HERMES_OPEN)
            if self.calls and not self._buf[:len(self._buf) - keep].strip():
                keep = len(self._buf)  # after a call, line breaks wait: another call may follow
            out.append(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return "".join(out)


def _objects(text: str) -> list[str]:
    """The top-level JSON objects a reply consists of (after ``<|python_tag|>``, inside a ```json fence; joined
    by ``;`` or line breaks); [] when there is anything else."""
    text = text.strip()
    if text.startswith(_PYTHON_TAG):
        text = text[len(_PYTHON_TAG):].strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)
    if fence:
        text = fence.group(1)
    if not text.startswith("{"):
        return []
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):  # top-level objects, however they are separated (";", newlines)
        if in_str:
            esc, in_str = (not esc and ch == "\\"), in_str and (esc or ch != '"')
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
            if depth == 1:
                start = i
        elif ch == "}":
            depth -= 1
            if depth == 0:
                parts.append(text[start:i + 1])
        elif depth == 0 and ch not in "; \n\t\r":
            return []
    return parts if depth == 0 else []


def _partial(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that begin ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


# -- messages ----------------------------------------------------------------------------------------------

def message_key(m: dict) -> tuple:
    """What of a message the model reads, for matching a conversation with the one a cache holds: role and
    content, and a call's name and arguments (not its id, which the template does not write)."""
    key = (m["role"], m.get("content") or "")
    calls = m.get("tool_calls")
    if calls:
        key += (tuple((c["function"]["name"], _canonical(c["function"].get("arguments"))) for c in calls),)
    return key


def _canonical(arguments) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def turn_start(messages: list[dict]) -> int:
    """Where the messages a reply answers begin: after the last assistant (or system) message — a user
    message, or the tool messages with the results of the assistant's calls."""
    return 1 + max((i for i, m in enumerate(messages) if m["role"] in ("assistant", "system")), default=-1)
