"""How a chat's figures are printed — the status line (:meth:`kvlocal.Chat.status_line`), the REPL's banner and
``/stats``: one wording for each."""

from __future__ import annotations

from typing import Protocol


class CacheFigures(Protocol):
    """What :func:`full_cache_text` reads (a :class:`~kvlocal.chat.chat.ChatStats`)."""

    tokens_seen: int
    ctx_size: int
    kv_bytes_full: int


def mib_text(n: int) -> str:
    """Bytes as the status line and the banner print them: whole MiB, one decimal under 10 MiB."""
    m = n / 2**20
    return f"{m:,.1f} MiB" if m < 10 else f"{m:,.0f} MiB"


def full_cache_text(s: CacheFigures) -> str:
    """What llama.cpp's own cache would take, as the status line and the banner say it: for the chat's context, or
    for every token seen once they are more."""
    if s.tokens_seen <= s.ctx_size:
        return f"llama.cpp's cache at -c {s.ctx_size}: {mib_text(s.kv_bytes_full)}"
    return f"a full cache for all {s.tokens_seen:,}: {mib_text(s.kv_bytes_full)}"


def rate_text(rate: float, digits: int = 0) -> str:
    """A tokens-per-second rate as the status line and ``/stats`` print it: a dash where none was measured yet
    (a document read before any reply has generated nothing)."""
    return f"{rate:,.{digits}f}" if rate else "–"
