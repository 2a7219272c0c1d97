"""The loop guard: a reply that repeats one span of tokens over and over ends.

Small models fall into loops ("la femme au martyre, la femme au martyre, …") that only the reply's token
limit would end. The guard watches the reply's tokens and says "loop" once its last ``tokens`` tokens are one
span repeated exactly, the span at most a quarter of them (so it came at least four times in a row).

It keeps, for every span length ``p`` up to ``tokens // 4``, how many tokens in a row have equalled the token
``p`` places before them; the tail is periodic with period ``p`` over ``tokens`` tokens once that run reaches
``tokens - p``. So each token costs O(tokens / 4), whatever the reply's length.
"""

from __future__ import annotations

LOOP_GUARD = 64  # the default: 64 tokens that are one span repeated end a reply


class LoopGuard:
    """Feed it a reply's tokens one by one; :meth:`feed` answers True once the reply is looping.

    ``tokens``: how many of the last tokens must be one repeated span (0: never a loop, the guard is off).
    """

    def __init__(self, tokens: int = LOOP_GUARD):
        if tokens < 0 or 0 < tokens < 8:
            raise ValueError(f"{tokens}: give 0 (off) or at least 8 tokens")
        self.tokens = tokens
        self._max_span = tokens // 4
        self._tail: list[int] = []  # the last max_span tokens
        self._runs = [0] * (self._max_span + 1)  # _runs[p]: tokens in a row equal to the one p before them
        self.span = 0  # the repeated span's length in tokens once a loop was found

    def feed(self, token: int) -> bool:
        if not self.tokens:
            return False
        tail, runs = self._tail, self._runs
        n = len(tail)
        for p in range(1, self._max_span + 1):
            runs[p] = runs[p] + 1 if p <= n and tail[n - p] == token else 0
            if runs[p] >= self.tokens - p:
                self.span = p
                return True
        tail.append(token)
        if len(tail) > self._max_span:
            del tail[0]
        return False
