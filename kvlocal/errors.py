"""kvlocal's errors, by kind, worded where they land.

Every error here is a :class:`UsageError` — something the user can fix; the command line prints it as one line
and exits with code 2. The text raised deep inside (the engine, the budget, the recall tier) names no flag and no
JSON field: a setting is written as ``{name}`` in it, the name of its :mod:`kvlocal.settings` field, and each front
door fills the names in as its user knows them — the command line with the flag (``--budget``,
:func:`kvlocal.settings.flag_name`), the server with the request's JSON path (``kv.budget``) and an HTTP status
(:attr:`KvlocalError.status`). ``str(e)`` is the neutral text: each setting by its field name (``budget``), as
``kvlocal.Chat``'s keywords call it."""

from __future__ import annotations

import re

_NAME = re.compile(r"\{([a-z][a-z0-9_]*)\}")


class UsageError(Exception):
    """Bad input or setup that the user can fix; the message names the problem and the fix."""


class KvlocalError(UsageError):
    """An error whose text names settings as ``{field}``: :meth:`worded` fills them in the way the reader knows
    them. ``field``: the setting at fault (None: no one setting); ``status``: the HTTP status a server answers."""

    status = 400
    code = "invalid_value"

    def __init__(self, text: str, field: str | None = None):
        self.text, self.field = text, field
        super().__init__(self.worded(lambda name: name))

    def worded(self, name) -> str:
        """The text with every ``{field}`` as ``name(field)`` (a flag, a JSON path)."""
        return _NAME.sub(lambda m: name(m.group(1)), self.text)


class SettingError(KvlocalError):
    """A setting's value no chat can run with: ``field`` names it (``budget``), the text says why and the fix."""


class CacheFull(KvlocalError):
    """The cache has no room for what was asked: a session sized for fewer tokens, a full cache that cannot
    compress."""

    code = "context_length_exceeded"


class RuntimeUnavailable(KvlocalError):
    """llama.cpp is missing, or a build this feature cannot run on (stock, another ABI): the fix is the install's,
    not the request's."""

    status, code = 500, "runtime_unavailable"


class ServerLost(KvlocalError):
    """An rpc-server that held some of the model's layers stopped (or broke the protocol) mid-computation: those
    layers and their KV cache are gone, so no chat on this model can go on until it is back and the model is loaded
    again. Not bad input: the command line exits with 1."""

    status, code, exit_code = 503, "rpc_server_lost", 1

    def __init__(self, endpoints, text: str, stopped: bool = True):
        # stopped: the server refuses connections (else it answers, but broke the protocol)
        self.endpoints, self.stopped = tuple(endpoints), stopped
        super().__init__(text)


class ModelUnreadable(KvlocalError):
    """The model file cannot be read as a GGUF model: missing, truncated, not a GGUF."""

    status, code = 500, "model_unreadable"


def worded(e: BaseException, name) -> str:
    """``e``'s message for a reader who names settings by ``name(field)``; any other error's text as it is."""
    return e.worded(name) if isinstance(e, KvlocalError) else str(e)
