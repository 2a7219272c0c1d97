"""A chat session on an :class:`~kvlocal.engine.Engine`: turns, streaming text out.

Each turn appends only the new text to the (compressed) cache — the history is never decoded
again. The session keeps the exact text the cache was fed and decodes the difference between it and
the conversation rendered with the model's chat template. The new turn's own tokens are the probe
that scores the cache while it is added (query-aware: the user's question decides what stays).
"""

from __future__ import annotations

import codecs
from typing import Iterator

from .engine import Engine
from .sampling import Sampler


class ChatSession:
    def __init__(self, engine: Engine, sampler: Sampler, system: str | None = None):
        self.engine, self.model, self.sampler = engine, engine.model, sampler
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.fed_text = ""  # the text whose tokens went into the cache, in order

    def ask(self, user_text: str, max_tokens: int = 512) -> Iterator[str]:
        """Add a user turn and stream the reply's text."""
        self.messages.append({"role": "user", "content": user_text})
        prompt = self.model.chat_prompt(self.messages, add_assistant=True)
        before = self.fed_text
        if not prompt.startswith(before) and len(self.messages) > 1:
            # a template that rewrites earlier turns (trims a reply, drops its thoughts): append this turn
            # as the template writes it after them
            before = self.model.chat_prompt(self.messages[:-1], add_assistant=False)
        if prompt.startswith(before):
            delta = prompt[len(before):]
        else:
            delta = self.model.chat_prompt(self.messages[-1:], add_assistant=True)
        tokens = self.model.tokenize(delta, add_special=self.engine.n_past == 0, parse_special=True)
        self.engine.append(tokens, probe=tokens)
        self.fed_text = prompt
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        reply_tokens: list[int] = []
        for tok in self.engine.generate(max_tokens, self.sampler):
            reply_tokens.append(tok)
            piece = decoder.decode(self.model.token_bytes(tok))
            if piece:
                yield piece
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail
        reply = self.model.detokenize(reply_tokens)
        self.messages.append({"role": "assistant", "content": reply})
        last = self.engine.last_token
        end = self.model.token_bytes(last, special=True).decode(errors="replace") if self.model.is_eog(last) else ""
        self.fed_text += reply + end

    def status(self) -> str:
        s = self.engine.stats
        return (f"[kv: {s.kv_cells_live:,} cells live / {self.engine.n_past:,} tokens seen · "
                f"KV {s.kv_bytes_allocated / 2**20:.1f} MiB allocated"
                + (f" (sliding window {s.kv_bytes_swa / 2**20:.1f})" if s.kv_bytes_swa else "")
                + f" vs {s.kv_bytes_full / 2**20:.1f} MiB for a full "
                f"{self.engine.cfg.max_tokens:,}-token cache · "
                f"{s.compression_events} compressions"
                + (f" · kvlocal {(s.wo_cache_bytes + s.host_bytes_peak) / 2**20:.1f} MiB" if s.compression_events else "")
                + "]")
