"""A GGUF file's header — metadata and tensor infos — read in milliseconds.

gguf-py's ``GGUFReader`` builds a numpy view for every element of the header: seconds for SmolLM2's
49K-token vocabulary and more for Gemma 3's 262K, paid by every process that opens a model. kvlocal reads a
handful of metadata keys and the tensor table, so this reader walks the header once with ``struct`` and
keeps arrays undecoded (their offset) until a key is asked for. Tensor data is a view of one read-only
memory map, shaped as gguf-py shapes it, so ``gguf.quants.dequantize`` takes it as it is.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, little-endian).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUFValueType: struct format of the scalar types (8 = STRING, 9 = ARRAY are read apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class HeaderError(ValueError):
    """The header is not a readable GGUF header (damaged, truncated or of an unknown version)."""


@dataclass(frozen=True)
class _Array:
    """An array value not decoded yet: its element type, count and where its elements start."""

    type: int
    count: int
    offset: int


@dataclass
class TensorInfo:
    """One tensor of the file: ``shape`` in GGUF's order (``ne``, innermost first), ``data`` a read-only view
    in numpy order — float types as their dtype, quantized types as bytes ``[..., row bytes]`` (gguf-py's)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    _file: "GGUFHeader" = field(repr=False)

    @property
    def data(self) -> np.ndarray:
        from gguf import GGMLQuantizationType as T
        from gguf.quants import quant_shape_to_byte_shape

        raw = self._file._map[self.data_offset:self.data_offset + self.n_bytes]
        dims = tuple(reversed(self.shape))
        plain = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
                 T.I32: np.int32, T.I64: np.int64}
        if self.tensor_type in plain:
            return raw.view(plain[self.tensor_type]).reshape(dims)
        return raw.reshape(quant_shape_to_byte_shape(dims, self.tensor_type))


class GGUFHeader:
    """The metadata and tensor table of a GGUF file (:func:`read_header`); ``get(key)`` decodes a value."""

    def __init__(self, path: Path, buf, size: int):
        self.path, self.size = path, size
        self._buf = buf
        self._map = np.frombuffer(buf, dtype=np.uint8) if size else np.zeros(0, np.uint8)
        self.version = 0
        self._values: dict[str, tuple[int, Any]] = {}
        self.tensors: list[TensorInfo] = []
        self.data_start = 0

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def keys(self):
        return self._values.keys()

    def type_of(self, key: str) -> tuple[int, int | None] | None:
        """``(value type, element type)`` of a key (element type None for scalars), or None if absent."""
        if key not in self._values:
            return None
        t, v = self._values[key]
        return (t, v.type if t == _ARRAY else None)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``: int, float, bool or str; a list for an array; ``default`` if absent."""
        if key not in self._values:
            return default
        t, v = self._values[key]
        if t != _ARRAY:
            return v
        if v.type == _STRING:
            out, off = [], v.offset
            for _ in range(v.count):
                s, off = self._string(off)
                out.append(s)
            return out
        if v.type == _ARRAY:
            raise HeaderError(f"{key}: nested arrays are not read")
        return np.frombuffer(self._buf, dtype=np.dtype(_NUMPY[v.type]).newbyteorder("<"), count=v.count,
                             offset=v.offset).tolist()

    # -- parsing ---------------------------------------------------------------------------------

    def _unpack(self, fmt: str, off: int):
        try:
            return struct.unpack_from("<" + fmt, self._buf, off), off + struct.calcsize("<" + fmt)
        except struct.error:
            raise HeaderError(f"the header ends at byte {self.size} inside a value at byte {off}") from None

    def _string(self, off: int, errors: str = "replace") -> tuple[str, int]:
        (n,), off = self._unpack("Q", off)
        if off + n > self.size:
            raise HeaderError(f"a string of {n} bytes at byte {off} runs past the end of the file")
        return bytes(self._buf[off:off + n]).decode("utf-8", errors=errors), off + n

    def _skip_array(self, etype: int, count: int, off: int) -> int:
        if etype == _STRING:
            for _ in range(count):
                (n,), off = self._unpack("Q", off)
                off += n
        elif etype in _SCALAR:
            off += count * struct.calcsize(_SCALAR[etype])
        else:
            raise HeaderError(f"array of value type {etype} at byte {off}")
        if off > self.size:
            raise HeaderError("an array runs past the end of the file")
        return off

    def _value(self, vtype: int, off: int) -> tuple[Any, int]:
        if vtype == _STRING:
            return self._string(off)
        if vtype == _ARRAY:
            (etype, count), off = self._unpack("IQ", off)
            return _Array(etype, count, off), self._skip_array(etype, count, off)
        if vtype not in _SCALAR:
            raise HeaderError(f"unknown value type {vtype} at byte {off}")
        (v,), off = self._unpack(_SCALAR[vtype], off)
        return v, off

    def _parse(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        (magic, version, n_tensors, n_kv), off = self._unpack("4sIQQ", 0)
        if magic != GGUF_MAGIC:
            raise HeaderError(f"it starts with {magic!r}")
        if version not in (2, 3):
            raise HeaderError(f"GGUF version {version} (2 and 3 are read)")
        self.version = version
        for _ in range(n_kv):
            key, off = self._string(off, errors="strict")
            (vtype,), off = self._unpack("I", off)
            value, off = self._value(vtype, off)
            self._values[key] = (vtype, value)
        infos, names = [], set()
        for _ in range(n_tensors):
            name, off = self._string(off, errors="strict")
            (n_dims,), off = self._unpack("I", off)
            dims, off = self._unpack("Q" * n_dims, off)
            (ttype, rel), off = self._unpack("IQ", off)
            if name in names:
                raise HeaderError(f"tensor {name} appears twice")
            names.add(name)
            infos.append((name, dims, ttype, rel))
        align = self.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise HeaderError(f"general.alignment {align!r} is not a power of two")
        self.data_start = off + (-off % align)
        for name, dims, ttype, rel in infos:
            try:
                qtype = GGMLQuantizationType(ttype)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise HeaderError(f"tensor {name} has unknown type {ttype}") from None
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            self.tensors.append(TensorInfo(name, qtype, tuple(int(d) for d in dims), n_elems * type_size // block,
                                           self.data_start + rel, self))


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse the header of the GGUF file at ``path`` (memory-mapped, read-only). Raises OSError if it cannot
    be opened and :class:`HeaderError` if it is not a readable GGUF header."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    header = GGUFHeader(path, buf, size)
    header._parse()
    return header
