"""A conversation in a bounded KV cache: :class:`Chat` (the Python API, ``chat.py``), the turns and
their chat template (``session.py``) and the saved-session file format (``saved.py``)."""

from kvlocal.chat.chat import Chat, ChatSettings, ChatStats

__all__ = ["Chat", "ChatSettings", "ChatStats"]
