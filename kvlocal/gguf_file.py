"""Checks that a path is a whole GGUF file before llama.cpp sees it (llama.cpp aborts or logs noise)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .errors import UsageError

GGUF_MAGIC = b"GGUF"


def check_gguf(path: str | os.PathLike) -> Path:
    """Return the path if it is a complete GGUF file; raise UsageError naming the problem otherwise."""
    path = Path(path)
    if path.is_file():
        st = path.stat()
        _check_complete(path.resolve(), st.st_size, st.st_mtime_ns)
        return path
    if not path.exists():
        raise UsageError(f"{path}: no such file; give a path to a .gguf model or a name from `kvlocal pull --list`")
    if path.is_dir():
        raise UsageError(f"{path} is a directory; give the path of a .gguf file inside it")
    raise UsageError(f"{path} is not a regular file; give the path of a .gguf model")


@functools.lru_cache(maxsize=16)
def _check_complete(path: Path, size: int, mtime_ns: int) -> None:
    """Header parse (seconds for a 49K-token vocabulary): done once per file version and process."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise UsageError(f"{path} is not a GGUF file (it starts with {magic!r}); convert it with llama.cpp's convert_hf_to_gguf.py or pick a .gguf file")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on damaged headers
        raise UsageError(f"{path} is a damaged or truncated GGUF file ({type(e).__name__}); download it again") from None
    if end > size:
        raise UsageError(f"{path} is truncated ({size} of {end} bytes); download it again (`kvlocal pull --force`)")
