"""``kvlocal serve --session-dir DIR``: conversations that survive a restart, in a :class:`ChatStore` (the server's
store of saved chats; a file is :mod:`kvlocal.chat.saved`'s format, a chat's turns :mod:`kvlocal.chat.turns`).

After each reply the conversation's compressed cache is written to DIR as a kvlocal saved session (the
format of ``Chat.save``: versioned, checksummed, the model's fingerprint; written to a temporary file and
renamed, so a crash mid-write leaves the previous file), named by a hash of the transcript the client
saw. A request that continues a conversation the server no longer holds in memory loads its file (lazily,
only then). ``--session-max`` bounds the folder: the least recently written files go first. A file that
cannot be used (damaged, another model or runtime, other settings) is skipped with a warning, and a save
that fails (a full disk) is a warning too: the server keeps serving either way."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

SUFFIX = ".kvl"


def key_name(key: tuple) -> str:
    """The file name of a transcript ``((role, content), ...)``."""
    return hashlib.sha256(json.dumps(key, ensure_ascii=False).encode()).hexdigest()[:32] + SUFFIX


class ChatStore:
    def __init__(self, path: str | os.PathLike, max_bytes: int):
        self.path, self.max_bytes = Path(path), max_bytes

    def _warn(self, message: str) -> None:
        print(f"kvlocal serve: warning: {message}; serving on", file=sys.stderr, flush=True)

    def save(self, key: tuple, chat) -> None:
        """Write ``chat`` under ``key`` (the transcript after its reply), then keep the folder in its bound."""
        target = self.path / key_name(key)
        try:
            chat.save(target)
        except Exception as e:  # noqa: BLE001 - a failed save never fails the reply
            self._warn(f"could not save the conversation to {target} ({type(e).__name__}: {e})")
            return
        self._trim(keep=target)

    def load(self, key: tuple, model, other_settings, **kw):
        """The chat saved under ``key``, or None (no file, or one that cannot be used: warned and left).
        ``other_settings(chat.settings)``: how the saved settings differ from the server's (empty: none)."""
        from kvlocal.chat import Chat
        from kvlocal.errors import UsageError

        path = self.path / key_name(key)
        if not path.is_file():
            return None
        try:
            chat = Chat.load(path, model=model, **kw)
        except (UsageError, OSError, ValueError, KeyError) as e:
            self._warn(f"skipped {path.name} in the session folder ({e})")
            return None
        differ = other_settings(chat.settings)
        if differ:
            chat.close()
            self._warn(f"skipped {path.name}: it was saved with other settings ({', '.join(differ)}), "
                       f"so that conversation is read afresh")
            return None
        os.utime(path)  # recently used: the last to go
        return chat

    def _trim(self, keep: Path) -> None:
        files = sorted((p for p in self.path.glob("*" + SUFFIX) if p.is_file()), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for p in files:
            if total <= self.max_bytes:
                break
            if p != keep:
                total -= p.stat().st_size
                p.unlink(missing_ok=True)
