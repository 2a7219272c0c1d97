"""Sizes as people write them on a command line or in a request (``512M``, ``2G``, ``1.5GiB``): one parser for
every size flag — the recall tier's ``--recall-mem``, the server's ``--session-max``."""

from __future__ import annotations

import math

from kvlocal.errors import UsageError


def parse_size(text: str, flag: str = "--recall-mem") -> int:
    """A size flag (``--recall-mem``, ``--session-max``): a byte count with an optional unit (``512M``, ``2G``,
    ``1.5GiB``, ``800MB``); UsageError naming ``flag``."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = str(text).strip().lower().removesuffix("b").removesuffix("i")
    unit = s[-1] if s and s[-1] in units else ""
    try:
        value = float(s[:-1] if unit else s)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a size: give bytes or a number with K, M or G (e.g. 512M)") from None
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{flag} {text} must be > 0 (e.g. 512M)")
    return int(value * units[unit])
