"""Checks that a path is a whole GGUF file before llama.cpp sees it (llama.cpp aborts or logs noise)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from kvlocal.errors import ModelUnreadable
from kvlocal.models.gguf_header import GGUF_MAGIC, HeaderError, read_header


def check_gguf(path: str | os.PathLike) -> Path:
    """Return the path if it is a complete GGUF file; raise UsageError naming the problem otherwise."""
    path = Path(path)
    if path.is_file():
        read_gguf(path)
        return path
    if not path.exists():
        raise ModelUnreadable(f"{path}: no such file; give a path to a .gguf model or a name from `kvlocal pull --list`")
    if path.is_dir():
        raise ModelUnreadable(f"{path} is a directory; give the path of a .gguf file inside it")
    raise ModelUnreadable(f"{path} is not a regular file; give the path of a .gguf model")


def read_gguf(path: str | os.PathLike):
    """The header (:class:`~kvlocal.models.gguf_header.GGUFHeader`: metadata, tensor infos and data) of a
    complete GGUF file, shared by everything that reads it in this process (parsed once per file version);
    raises UsageError naming the problem for a missing, foreign, damaged or truncated file."""
    path = Path(path)
    if not path.is_file():
        check_gguf(path)  # raises: missing, a directory, not a regular file
    st = path.stat()
    return _read_complete(path.resolve(), st.st_size, st.st_mtime_ns)


def dequantize_tensor(tensor, path: str | os.PathLike | None = None) -> np.ndarray:
    """One GGUF tensor as a float32 array in numpy order (``reversed(ne)``), with gguf's own routines — or, for
    q8_0, q4_0, q4_1, q5_0 and q5_1, kvlocal's C kernel (:func:`kvlocal.kernels.dequant_rows`: the same
    bits, faster than the gguf package's numpy — a model's W_O is read so at a chat's first compression event)."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))
    fast = _dequantize_blocks(tensor)
    if fast is not None:
        return fast.reshape(shape)
    try:
        arr = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelUnreadable(
            f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf package cannot "
            "dequantize; use a file quantized to a common type (F16, Q8_0, Q4_K_M, ...)"
        ) from None
    arr = np.asarray(arr, dtype=np.float32)
    if np.may_share_memory(arr, tensor.data):  # F32 comes back as a view of the read-only memory map
        arr = arr.copy()
    return np.ascontiguousarray(arr.reshape(shape))


def _dequantize_blocks(tensor) -> np.ndarray | None:
    """``tensor``'s values by the C kernel where its type is one of the kernel's, else None (gguf's routines)."""
    try:
        from kvlocal import kernels
    except ImportError:  # the kernels not built: gguf's routines
        return None
    size = kernels.DEQUANT_BLOCK_BYTES.get(int(tensor.tensor_type))
    data = np.asarray(tensor.data)
    if size is None or data.dtype != np.uint8 or data.size % size:
        return None
    return kernels.dequant_rows(data.reshape(-1), int(tensor.tensor_type))


@functools.lru_cache(maxsize=4)
def _read_complete(path: Path, size: int, mtime_ns: int):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelUnreadable(f"{path} is not a GGUF file (it starts with {magic!r}); convert it with llama.cpp's convert_hf_to_gguf.py or pick a .gguf file")
    try:
        header = read_header(path)
    except HeaderError as e:
        raise ModelUnreadable(f"{path} is a damaged or truncated GGUF file ({e}); download it again") from None
    end = max((t.data_offset + t.n_bytes for t in header.tensors), default=0)
    if end > size:
        raise ModelUnreadable(f"{path} is truncated ({size} of {end} bytes); download it again (`kvlocal pull --force`)")
    return header
