"""A conversation in a bounded KV cache: :class:`Chat` (the Python API, ``chat.py``); the turns and their chat
template (``turns.py``); the saved-chat file format (``saved.py``); the conversation core every front door calls —
continuation lookup, stop strings, finish reasons, usage (``conversation.py``) — and the messages it takes
(``messages.py``); tool calls (``toolcalls.py``)."""

from kvlocal.chat.chat import Chat, ChatSettings, ChatStats

__all__ = ["Chat", "ChatSettings", "ChatStats"]
