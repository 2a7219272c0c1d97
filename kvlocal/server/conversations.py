"""The conversation cache of ``kvlocal serve``: finished chats kept for reuse, keyed by their transcript
(docs/server.md, "Reusing conversations")."""

from __future__ import annotations

from collections import OrderedDict

Key = tuple  # a transcript: ((role, content), ...)


class ConversationCache:
    """Finished chats by transcript, least recently used first; bounded by KV bytes and by count. Used
    only from the worker thread (``len`` and ``bytes`` are read by /health)."""

    def __init__(self, max_bytes: int, max_chats: int):
        self.max_bytes, self.max_chats = max_bytes, max_chats
        self._items: OrderedDict[Key, tuple[object, int]] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def take(self, key: Key):
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.bytes -= item[1]
        return item[0]

    def take_parent(self, key: Key):
        """The most recent chat whose transcript is ``key`` plus one assistant reply."""
        for k in reversed(self._items):
            if len(k) == len(key) + 1 and k[-1][0] == "assistant" and k[:-1] == key:
                return self.take(k)
        return None

    def take_prefix(self, settings: Key, text: str):
        """The plain-completion chat (key ``settings + (("text", read),)``) whose text ``text`` goes on from,
        the longest if several."""
        best = None
        for k in self._items:
            if (len(k) == len(settings) + 1 and k[:-1] == settings and k[-1][0] == "text"
                    and len(k[-1][1]) < len(text) and text.startswith(k[-1][1])
                    and (best is None or len(k[-1][1]) > len(best[-1][1]))):
                best = k
        return None if best is None else self.take(best)

    def put(self, key: Key, chat, nbytes: int) -> None:
        old = self.take(key)
        if old is not None and old is not chat:
            old.close()
        self._items[key] = (chat, nbytes)
        self.bytes += nbytes
        while self._items and (self.bytes > self.max_bytes or len(self._items) > self.max_chats):
            _, (c, n) = self._items.popitem(last=False)
            self.bytes -= n
            self.evictions += 1
            c.close()

    def close(self) -> None:
        while self._items:
            _, (c, _) = self._items.popitem()
            c.close()
        self.bytes = 0
