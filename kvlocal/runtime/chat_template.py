"""A model's chat template: messages → the prompt text the model was trained on.

First choice is the GGUF's own Jinja template (``tokenizer.chat_template``), rendered the way
Hugging Face renders it, by llama-cpp-python's ``Jinja2ChatFormatter`` with the model's BOS/EOS
token texts. llama.cpp's C++ templates (``llama_chat_apply_template``) are the fallback: when the
Jinja render fails (llama.cpp then recognises the template from its text), or when the file has none
(then the built-in for ``general.architecture``, said once on stderr).

The two paths agree on the turns themselves; where they differ is in what the Jinja template adds
on its own, e.g. SmolLM2's and Qwen2.5's default system message when the conversation has none
(tests/runtime/test_chat_template.py measures both).
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
import weakref

from kvlocal.errors import UsageError
from kvlocal.runtime.library import llama_lib

# general.architecture → llama.cpp built-ins (names from llama_chat_builtin_templates) to try for a
# file without a template, first the one whose turn marker the vocabulary holds as a single token:
# a llama-architecture file may be a Llama 3 or a ChatML model (SmolLM2).
BUILTIN_BY_ARCH = {
    "gemma": ("gemma",), "gemma2": ("gemma",), "gemma3": ("gemma",), "gemma3n": ("gemma",),
    "llama": ("llama3", "chatml"),
    "qwen2": ("chatml",), "qwen2moe": ("chatml",), "qwen3": ("chatml",), "qwen3moe": ("chatml",),
    "phi3": ("phi3",),
}
TURN_MARKER = {"gemma": "<start_of_turn>", "llama3": "<|start_header_id|>", "chatml": "<|im_start|>", "phi3": "<|user|>"}

_noted: set[str] = set()


def _note(text: str) -> None:
    """Print a note on stderr once per process."""
    if text not in _noted:
        _noted.add(text)
        print(f"kvlocal: {text}", file=sys.stderr, flush=True)


class ChatTemplate:
    """Renders messages ({"role", "content"} dicts) for one model.

    Parameters
    ----------
    name: the model file's name, for messages.
    jinja: the GGUF's Jinja template, or None.
    builtin: what llama.cpp renders with when Jinja does not: a built-in template's name, or the
        Jinja text for llama.cpp to recognise; None when there is nothing to fall back on.
    bos_token, eos_token: the texts of the model's BOS/EOS tokens, as the Jinja template sees them.
    strip_bos: the tokenizer adds BOS itself, so a BOS the template writes is dropped (else the
        prompt would start with two).
    """

    def __init__(self, name: str, jinja: str | None, builtin: str | None, bos_token: str = "", eos_token: str = "",
                 strip_bos: bool = False):
        self.name, self.jinja, self.builtin = name, jinja, builtin
        self.bos_token, self.eos_token, self.strip_bos = bos_token, eos_token, strip_bos
        self._formatters = {}  # add_assistant → Jinja2ChatFormatter

    @property
    def tool_format(self) -> str | None:
        """How this model writes tool calls (``hermes``, ``llama3``: :func:`tool_format`; the calls are read back by kvlocal/chat/toolcalls.py), or None when its
        template does not take tools."""
        return tool_format(self.jinja)

    def render(self, messages: list[dict], add_assistant: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt for ``messages`` (with ``tools`` for a template that takes them: :attr:`tool_format`)."""
        messages = for_template(messages)
        if tools and self.tool_format is None:
            raise UsageError(f"the chat template of {self.name} does not take tools")
        text = None
        if self.jinja is not None:
            try:
                text = self.render_jinja(messages, add_assistant, tools)
            except Exception as e:  # template errors, raise_exception(), undefined names
                if self.builtin is None or tools:
                    raise UsageError(f"the chat template of {self.name} failed ({type(e).__name__}: {e})") from None
                _note(f"the chat template of {self.name} failed ({type(e).__name__}: {e}); using llama.cpp's")
        if text is None:
            text = self.render_llama(messages, add_assistant)
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text

    def render_jinja(self, messages: list[dict], add_assistant: bool = True, tools: list[dict] | None = None) -> str:
        """The GGUF's template rendered by llama-cpp-python (as Hugging Face's transformers does)."""
        if self.jinja is None:
            raise UsageError(f"{self.name} has no Jinja chat template")
        fmt = self._formatters.get(add_assistant)
        if fmt is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            llama_lib()  # the version check before any use of llama_cpp
            fmt = Jinja2ChatFormatter(self.jinja, eos_token=self.eos_token, bos_token=self.bos_token,
                                      add_generation_prompt=add_assistant)
            self._formatters[add_assistant] = fmt
        return fmt(messages=messages, tools=tools or None).prompt

    def render_llama(self, messages: list[dict], add_assistant: bool = True) -> str:
        """llama.cpp's C++ rendering (llama_chat_apply_template) of ``builtin``."""
        if self.builtin is None:
            raise UsageError(f"{self.name} has no chat template: run without --chat / use `kvlocal run`")
        lib = llama_lib()
        keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
        arr = (lib.llama_chat_message * max(1, len(keep)))()
        for i, (role, content) in enumerate(keep):
            arr[i].role, arr[i].content = role, content
        size = 2 * sum(len(r) + len(c) for r, c in keep) + 1024
        buf = ctypes.create_string_buffer(size)
        n = lib.llama_chat_apply_template(self.builtin.encode(), arr, len(keep), add_assistant, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n + 1)
            n = lib.llama_chat_apply_template(self.builtin.encode(), arr, len(keep), add_assistant, buf, n + 1)
        if n < 0:
            raise UsageError(f"llama.cpp does not know the chat template of {self.name}")
        return buf.raw[:n].decode(errors="replace")


def builtin_names() -> list[str]:
    """The names of llama.cpp's built-in templates (llama_chat_builtin_templates)."""
    lib = llama_lib()
    n = lib.llama_chat_builtin_templates(None, 0)
    out = (ctypes.c_char_p * n)()
    lib.llama_chat_builtin_templates(out, n)
    return [name.decode() for name in out]


def builtin_template(model) -> str | None:
    """llama.cpp's built-in template for a model file without one: by architecture, the first
    candidate whose turn marker is one token of the vocabulary; None if none fits."""
    for name in BUILTIN_BY_ARCH.get(model.meta("general.architecture") or "", ()):
        if len(model.tokenize(TURN_MARKER[name], add_special=False, parse_special=True)) == 1:
            return name
    return None


_templates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chat_template(model) -> ChatTemplate:
    """The :class:`ChatTemplate` of a loaded :class:`~kvlocal.runtime.llama.Model` (made once per model)."""
    tmpl = _templates.get(model)
    if tmpl is not None:
        return tmpl
    lib = llama_lib()
    vocab = model._vocab

    def token_text(tok: int) -> str:
        return model.token_bytes(tok, special=True).decode(errors="replace") if tok >= 0 else ""

    raw = lib.llama_model_chat_template(model._ptr, None)  # the whole text (Model.meta caps its buffer)
    jinja = raw.decode(errors="replace") if raw else None
    builtin = jinja  # llama.cpp recognises the template from its text
    if jinja in builtin_names():  # llama.cpp names one for a few popular files without a template
        jinja = None
    elif jinja is None:
        builtin = builtin_template(model)
        if builtin is not None:
            _note(f"{model.path.name} has no chat template; using llama.cpp's built-in '{builtin}' template")
    tmpl = ChatTemplate(model.path.name, jinja, builtin,
                        bos_token=token_text(lib.llama_vocab_bos(vocab)), eos_token=token_text(lib.llama_vocab_eos(vocab)),
                        strip_bos=bool(lib.llama_vocab_get_add_bos(vocab)))
    _templates[model] = tmpl
    return tmpl


# -- what a template takes -------------------------------------------------------------------------------
HERMES_OPEN = "<tool_call>"  # a hermes-format call's opening (kvlocal/chat/toolcalls.py reads the calls)


def tool_format(template: str | None) -> str | None:
    """How a model writes its calls, from its Jinja chat template: ``hermes``, ``llama3``, or None when the
    template does not take tools."""
    if not template or not _uses_tools(template):
        return None
    if HERMES_OPEN in template:
        return "hermes"
    if "<|start_header_id|>" in template:
        return "llama3"
    return None


def _uses_tools(template: str) -> bool:
    try:
        import jinja2
        from jinja2 import meta

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in meta.find_undeclared_variables(env.parse(template))
    except Exception:  # a template jinja2 cannot parse alone: its text decides
        return re.search(r"\btools\b", template) is not None


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: a call's arguments as an object (Hugging Face's convention;
    the templates write them with ``tojson``), no None content."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = dict(c.get("function", c))
                if isinstance(f.get("arguments"), str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append({**c, "function": f})
            m["tool_calls"] = calls
        out.append(m)
    return out
