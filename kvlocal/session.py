"""A chat session over one llama.cpp context: turns, the decode loop, streaming text out.

Each turn appends only the new text to the cache (the history is never decoded again): the
session keeps the exact text the cache holds and decodes the difference between it and the
conversation rendered with the model's chat template.
"""

from __future__ import annotations

import codecs
from typing import Iterator

from .errors import UsageError
from .runtime import Context, Model
from .sampling import Sampler


class ContextFull(UsageError):
    pass


class ChatSession:
    def __init__(self, model: Model, ctx: Context, sampler: Sampler, system: str | None = None):
        self.model, self.ctx, self.sampler = model, ctx, sampler
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.cached_text = ""  # the text whose tokens the cache holds, in order
        self.n_past = 0  # tokens in the cache (= next position)

    def _feed(self, text: str, logits: bool):
        tokens = self.model.tokenize(text, add_special=self.n_past == 0, parse_special=True)
        self._check_room(len(tokens))
        out = self.ctx.decode(tokens, range(self.n_past, self.n_past + len(tokens)), "last" if logits else "none")
        self.n_past += len(tokens)
        self.cached_text += text
        return out

    def _check_room(self, n: int) -> None:
        if self.n_past + n > self.ctx.n_ctx:
            raise ContextFull(
                f"the context is full ({self.n_past} + {n} tokens > {self.ctx.n_ctx} cells): start a new chat or raise -c/--ctx-size"
            )

    def ask(self, user_text: str, max_tokens: int = 512) -> Iterator[str]:
        """Add a user turn and stream the reply's text."""
        self.messages.append({"role": "user", "content": user_text})
        prompt = self.model.chat_prompt(self.messages, add_assistant=True)
        if not prompt.startswith(self.cached_text):  # a template that rewrites history: start over
            self.ctx.clear()
            self.cached_text, self.n_past = "", 0
        logits = self._feed(prompt[len(self.cached_text):], logits=True)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        reply_tokens: list[int] = []
        end = ""
        for _ in range(max_tokens):
            tok = self.sampler(logits)
            self._check_room(1)
            if self.model.is_eog(tok):
                self.ctx.decode([tok], [self.n_past], "none")  # keep the end-of-turn in the cache
                self.n_past += 1
                end = self.model.token_bytes(tok, special=True).decode(errors="replace")
                break
            reply_tokens.append(tok)
            piece = decoder.decode(self.model.token_bytes(tok))
            if piece:
                yield piece
            logits = self.ctx.decode([tok], [self.n_past], "last")
            self.n_past += 1
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail
        reply = self.model.detokenize(reply_tokens)
        self.messages.append({"role": "assistant", "content": reply})
        self.cached_text += reply + end
