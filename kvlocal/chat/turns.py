"""The turns of a chat on an :class:`~kvlocal.engine.Engine`: documents and questions in, text out.

Each turn appends only the new text to the (compressed) cache — the history is never decoded again.
:class:`Turns` keeps the exact text the cache was fed (``fed_text``) and decodes the difference between
it and the conversation rendered with the model's chat template. The new turn's own tokens are the
probe that scores the cache while it is added (query-aware: the user's question decides what stays).

A document (:meth:`Turns.read`) is fed at once, before its question is known, scored by the
engine's query-agnostic probe. It becomes the beginning of the next user message: the template is
rendered with the document and a marker where the question will go, and the text up to the marker is
decoded now; the question completes that message later. So the transcript stays a plain alternation
of user and assistant messages that every template accepts.

:class:`kvlocal.Chat` (chat.py) is the public API on top: it loads the model, marks the engine where each turn
begins and undoes the turn there (Ctrl-C, ``regen``: :mod:`kvlocal.engine.undo`), saves and loads chats (:mod:`kvlocal.chat.saved`).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kvlocal.engine.loops import LoopGuard
from kvlocal.engine import Engine
from kvlocal.errors import UsageError
from kvlocal.runtime import Sampler

_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")  # what of a message the template reads
_MARK = "\u2063kvlocal-question\u2063"  # where the question goes; never in real text (invisible separators)


@dataclass
class Transcript:
    """What the cache holds, as text: the messages, the document waiting for its question, and the exact
    text decoded so far (a prefix of the next rendered prompt)."""

    messages: list[dict] = field(default_factory=list)
    pending: str = ""  # documents read since the last question: the start of the next user message
    fed_text: str = ""
    tools: list[dict] | None = None  # tool definitions, rendered by the template with every prompt

    def copy(self) -> "Transcript":
        return Transcript([dict(m) for m in self.messages], self.pending, self.fed_text, self.tools)


class Turns:
    def __init__(self, engine: Engine, sampler: Sampler, system: str | None = None, pin_system: bool = True,
                 tools: list[dict] | None = None, loop_guard: int = 0):
        self.engine, self.model, self.sampler = engine, engine.model, sampler
        self.t = Transcript([{"role": "system", "content": system}] if system else [], tools=tools or None)
        self.pin_system = pin_system  # the system message and tool definitions are never evicted (:meth:`pin`)
        self.loop_guard = loop_guard  # a reply ends once its last loop_guard tokens repeat one span (0: off)
        self.interrupted = False  # the last reply was cut short (Ctrl-C, or its reader stopped)
        self.finish = None  # how the last reply ended: "stop" (the model ended it), "length", "loop"; None: interrupted

    @property
    def messages(self) -> list[dict]:
        return self.t.messages

    def read(self, text: str, name: str | None = None, progress: Callable[[int, int], None] | None = None) -> int:
        """Feed a document now, as the beginning of the next user message. Returns its tokens."""
        block = (f"{name}:\n\n" if name else "") + text.strip("\n") + "\n\n"
        pending = self.t.pending + block
        rendered = self._render(self.t.messages + [{"role": "user", "content": pending + _MARK}], add_assistant=True)
        cut = rendered.find(_MARK)
        if cut < 0 or not rendered.startswith(self.t.fed_text):
            self.t.pending = pending  # a template that moves the content: the document goes in with the question
            return len(self.model.tokenize(block, add_special=False))
        tokens = self._tokens(rendered[len(self.t.fed_text):cut])
        self.pin(tokens)
        self.engine.append(tokens, probe=None, progress=progress, reselect_after=True)  # the question re-selects
        self.t.pending, self.t.fed_text = pending, rendered[:cut]
        return len(tokens)

    def extend(self, messages: list[dict], progress: Callable[[int, int], None] | None = None) -> int:
        """Add finished messages (an earlier conversation: user, assistant — with its tool calls — and tool
        turns) without generating. Returns the tokens fed."""
        if not messages:
            return 0
        self.t.messages.extend({k: m[k] for k in _MESSAGE_KEYS if k in m} for m in messages)
        tokens = self._tokens(self._delta(add_assistant=False))
        self.pin(tokens)
        self.engine.append(tokens, probe=tokens, progress=progress)
        self.t.fed_text = self._render(self.t.messages, add_assistant=False)
        return len(tokens)

    def ask(self, new: str | list[dict], max_tokens: int = 512, progress: Callable[[int, int], None] | None = None,
            prefix: str = "") -> Iterator[str]:
        """Add a user turn (after any document read) — or the results of tool calls (``tool`` messages) — and
        stream the reply's text, which begins with ``prefix`` (read as part of the prompt). If the caller
        stops early (Ctrl-C, or closing the iterator), the reply so far stays in the transcript and the cache."""
        t = self.t
        new = [{"role": "user", "content": new}] if isinstance(new, str) else [dict(m) for m in new]
        if t.pending:  # the documents read open the next user message
            first = next((m for m in new if m["role"] == "user"), None)
            if first is None:
                raise UsageError("a document read waits for a question: send a user message")
            first["content"] = t.pending + first["content"]
        t.messages.extend({k: m[k] for k in _MESSAGE_KEYS if k in m} for m in new)
        t.pending = ""
        tokens = self._tokens(self._delta(add_assistant=True) + prefix)
        self.pin(tokens)
        self.engine.append(tokens, probe=tokens, progress=progress, question=True)
        t.fed_text = self._render(t.messages, add_assistant=True) + prefix
        return self._reply(max_tokens, prefix)

    def complete(self, prompt: str, max_tokens: int = 512, progress: Callable[[int, int], None] | None = None) -> Iterator[str]:
        """Plain text, no chat template: read ``prompt`` — only what follows the text read so far, which it
        must begin with — and stream its continuation."""
        t = self.t
        if t.messages or t.pending:
            raise UsageError("this chat holds messages: a plain completion needs a chat of its own")
        if not prompt.startswith(t.fed_text) or len(prompt) == len(t.fed_text):
            raise UsageError("the prompt does not go on from the text this chat has read: start a new chat")
        tokens = self.model.tokenize(prompt[len(t.fed_text):], add_special=self.engine.n_past == 0, parse_special=True)
        self.engine.append(tokens, probe=tokens, progress=progress, question=True)
        t.fed_text = prompt
        return self._reply(max_tokens, message=False)

    def pin(self, tokens: list[int]) -> None:
        """Before the chat's first ``tokens`` go in: pin those of its system message and tool definitions —
        the template's opening and what follows, as far as two conversations with different user turns
        share them — so that no compression evicts them (:meth:`Engine.pin`)."""
        m = self.t.messages
        system = m[:1] if m and m[0]["role"] == "system" else []
        if not self.pin_system or self.engine.n_past or not (system or self.t.tools):
            return
        a, b = (self.model.tokenize(self._render(system + [{"role": "user", "content": u}], add_assistant=False),
                                    add_special=True, parse_special=True) for u in ("A", "B"))
        n = 0
        for x, y, z in zip(a, b, tokens):
            if not x == y == z:
                break
            n += 1
        self.engine.pin(n)

    def _delta(self, add_assistant: bool) -> str:
        """The text to decode for the messages not fed yet: the rendered conversation past ``fed_text``."""
        t = self.t
        prompt = self._render(t.messages, add_assistant=add_assistant)
        before = t.fed_text
        if not prompt.startswith(before) and len(t.messages) > 1:
            # a template that rewrites earlier turns (trims a reply, drops its thoughts): append this turn
            # as the template writes it after them
            before = self._render(t.messages[:-1], add_assistant=False)
        if prompt.startswith(before):
            return prompt[len(before):]
        return self._render(t.messages[-1:], add_assistant=add_assistant)

    def _render(self, messages: list[dict], add_assistant: bool) -> str:
        return self.model.chat_prompt(messages, add_assistant=add_assistant, tools=self.t.tools)

    def _tokens(self, text: str) -> list[int]:
        return self.model.tokenize(text, add_special=self.engine.n_past == 0, parse_special=True)

    def _reply(self, max_tokens: int, prefix: str = "", message: bool = True) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        reply_tokens: list[int] = []
        guard = LoopGuard(self.loop_guard)
        self.interrupted, self.finish = True, None
        try:
            if prefix:
                yield prefix
            finish = "length"
            for tok in self.engine.generate(max_tokens, self.sampler):
                reply_tokens.append(tok)
                piece = decoder.decode(self.model.token_bytes(tok))
                if piece:
                    yield piece
                if guard.feed(tok):
                    finish = "loop"
                    break
            tail = decoder.decode(b"", final=True)
            if tail:
                yield tail
            if finish == "length" and self.model.is_eog(self.engine.last_token):  # generate ended at the model's end
                finish = "stop"
            self.interrupted, self.finish = False, finish
        finally:  # also on Ctrl-C or a reader that stopped: what was decoded is in the cache
            reply = self.model.detokenize(reply_tokens)
            if message:  # a chat's reply (not a plain completion's text)
                self.t.messages.append({"role": "assistant", "content": prefix + reply})
            last = self.engine.last_token
            done = not self.interrupted and self.model.is_eog(last)
            self.t.fed_text += reply + (self.model.token_bytes(last, special=True).decode(errors="replace") if done else "")
