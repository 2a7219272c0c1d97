"""Stop strings for streamed text: a reply ends where one appears, and what might be the start of one is
held back until it is clear (the server and :class:`kvlocal.Llama` both stream this way)."""

from __future__ import annotations

from typing import Iterable, Iterator


def find_stop(text: str, stops: list[str], start: int) -> int:
    """Where the first stop string begins in ``text`` at or after ``start``; -1 if none."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def partial_stop(text: str, stops: list[str]) -> int:
    """Characters at the end of text that begin a stop string (held back until it is clear)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def until_stop(pieces: Iterable[str], stops: list[str]) -> Iterator[str]:
    """The text of ``pieces`` up to the first stop string, streamed as soon as it cannot be part of one.
    Closes ``pieces`` when a stop string ends it; returns (``StopIteration.value``) whether one did."""
    longest = max((len(s) for s in stops), default=0)
    text, sent = "", 0
    try:
        for piece in pieces:
            start = max(0, len(text) - longest + 1)
            text += piece
            safe = len(text)
            if stops:
                cut = find_stop(text, stops, start)
                if cut >= 0:
                    if cut > sent:
                        yield text[sent:cut]
                    return True
                safe -= partial_stop(text, stops)
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        if len(text) > sent:
            yield text[sent:]
        return False
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
