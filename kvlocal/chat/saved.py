"""Saved chat sessions: one versioned, checksummed file with the compressed KV cache and the transcript.

Layout (all integers little-endian)::

    magic    16 bytes   b"KVLOCAL-SESSION\\n"
    format   u32        FORMAT (a newer one is refused: "upgrade kvlocal")
    length   u64        bytes of the header
    header   JSON       settings, model fingerprint, runtime, transcript, engine scalars, and for every
                        array its name, dtype, shape, offset and size in the data section
    data     bytes      the arrays: llama.cpp's sequence state (the cells' K/V rows, positions and
                        per-head biases), kvlocal's per-row record (true positions, counts, value norms),
                        the last logits
    sha256   32 bytes   of everything before it: a truncated or edited file is refused

A file is written to a temporary name next to the target and renamed, so a failed save leaves the old
file (if any) as it was. Loading checks everything — magic, format, checksum, model fingerprint,
runtime — before anything is built, so a refused file changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvlocal.errors import UsageError

MAGIC = b"KVLOCAL-SESSION\n"
FORMAT = 1
_SAMPLE = 1 << 20


def model_fingerprint(path: str | os.PathLike) -> str:
    """sha256 of a GGUF file's size, its first MiB (the header: metadata and tensor table) and four more
    MiB-samples spread over its tensor data — different weights or quantization give a different
    value, and it costs milliseconds for a multi-gigabyte file (a full hash would take seconds)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(struct.pack("<Q", size))
    with open(path, "rb") as f:
        for at in sorted({0, *(size * i // 5 for i in range(1, 5)), max(0, size - _SAMPLE)}):
            f.seek(at)
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


@dataclass
class SavedSession:
    header: dict
    arrays: dict[str, np.ndarray]


def write(path: str | os.PathLike, header: dict, arrays: dict[str, np.ndarray]) -> int:
    """Write a session file atomically; returns its size in bytes."""
    path = Path(path)
    table, offset = [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        arrays[name] = a
        table.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes})
        offset += a.nbytes
    head = json.dumps({**header, "arrays": table}, ensure_ascii=False).encode()
    if path.parent and not path.parent.is_dir():
        raise UsageError(f"cannot save to {path}: the folder {path.parent} does not exist")
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            for part in (MAGIC, struct.pack("<IQ", FORMAT, len(head)), head, *(arrays[t["name"]].tobytes() for t in table)):
                f.write(part)
                h.update(part)
            f.write(h.digest())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read(path: str | os.PathLike) -> SavedSession:
    """Read and check a session file (magic, format, checksum). Raises UsageError naming what is wrong."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such session file") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    fixed = len(MAGIC) + 12
    if len(raw) < fixed + 32 or not raw.startswith(MAGIC):
        raise UsageError(f"{path} is not a kvlocal session file (saved with /save or Chat.save)")
    fmt, n_head = struct.unpack_from("<IQ", raw, len(MAGIC))
    if fmt > FORMAT:
        raise UsageError(f"{path} was saved by a newer kvlocal (session format {fmt}; this one reads {FORMAT}): upgrade kvlocal")
    if hashlib.sha256(raw[:-32]).digest() != raw[-32:]:
        raise UsageError(f"{path} is truncated or was modified (checksum mismatch): it cannot be loaded; save the session again")
    try:
        header = json.loads(raw[fixed:fixed + n_head])
        data = memoryview(raw)[fixed + n_head:-32]
        arrays = {t["name"]: np.frombuffer(data[t["offset"]:t["offset"] + t["nbytes"]], dtype=np.dtype(t["dtype"]))
                  .reshape(t["shape"]).copy() for t in header.pop("arrays")}
    except (ValueError, KeyError, TypeError) as e:  # a valid checksum over a malformed file: written by a bug
        raise UsageError(f"{path} is malformed ({e}): it cannot be loaded") from None
    return SavedSession(header, arrays)
