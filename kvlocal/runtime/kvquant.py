"""Quantized KV cache rows (``-ctk`` / ``-ctv q8_0``, ``q4_0``, ...): how to read, score and rewrite them.

A quantized row of this llama.cpp is two things at once:

- **blocks**: ggml's block formats (q8_0: 32 values as an f16 scale and 32 int8; q4_0: an f16 scale and
  32 nibbles; ...). Each KV head's part of a row is a whole number of blocks when the head dimension is a
  multiple of the block size (32), so a head's bytes can be copied from one cell to another untouched:
  eviction and per-head rearrangement work on raw bytes and add no quantization error.
- **rotated**: llama.cpp multiplies K (and the query) by an orthonormal Walsh–Hadamard matrix ``H`` before
  storing a quantized K cache, and V by another before storing a quantized V cache, rotating the attention
  output back (src/llama-kv-cache.cpp ``attn_rot_k`` / ``attn_rot_v``, src/llama-graph.cpp
  ``llama_mul_mat_hadamard``). The matrices act on consecutive blocks of ``nrot`` elements of every head:
  K uses the largest power of two dividing the head dimension (≥ 64), V uses 64. Rotation is on only
  when the head dimension is a multiple of 64 and ``LLAMA_ATTN_ROT_DISABLE`` is unset. ``H`` is
  symmetric and ``H·H = I``.

So scoring in the stored basis needs ``H·q`` (``q·k = Hq·Hk``) and the true value for CriticalKV's
``‖v·W_O‖₁`` is ``H·v_stored``. Merged rows (KVSlimmer, meanmerge) are linear combinations, which commute
with ``H``: they are computed from the stored rows, dequantized, and quantized again (gguf's reference
quantizers; only merged rows are re-quantized).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from kvlocal import kernels
from kvlocal.errors import UsageError
from kvlocal.kernels import as_f32

GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16 = 0, 1, 30
FLOAT_TYPES = (GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16)
# quantized cache types kvlocal reads and writes (llama.cpp's -ctk/-ctv names); gguf's quantizers do all of them
CACHE_TYPES = {"f16": GGML_TYPE_F16, "f32": GGML_TYPE_F32, "bf16": GGML_TYPE_BF16, "q8_0": 8, "q4_0": 2, "q4_1": 3,
               "q5_0": 6, "q5_1": 7}
_QUANTIZED = {t for n, t in CACHE_TYPES.items() if n.startswith("q")}
ROT_MIN = 64  # llama.cpp rotates heads whose dimension is a multiple of 64
_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 20: "IQ4_NL", 30: "BF16", 39: "MXFP4",
}


def type_name(t: int) -> str:
    return _TYPE_NAMES.get(t, f"ggml type {t}")


def cache_type(name: str) -> int:
    """A ``-ctk``/``-ctv`` name → ggml type; UsageError naming the choices."""
    try:
        return CACHE_TYPES[name.lower()]
    except KeyError:
        raise UsageError(f"unknown KV cache type {name!r}: use one of {', '.join(CACHE_TYPES)}") from None


def bytes_per_value(t: int | None) -> float:
    """Bytes one cached value takes in a cache of type t (None: F16): 2 for F16, 34/32 for q8_0, ..."""
    if t is None or t in (GGML_TYPE_F16, GGML_TYPE_BF16):
        return 2.0
    if t == GGML_TYPE_F32:
        return 4.0
    values, nbytes = RowCodec(t).block
    return nbytes / values


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> np.ndarray:
    """The orthonormal ``n×n`` Walsh–Hadamard matrix (Sylvester's construction, as ggml_gen_hadamard)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Walsh–Hadamard matrix needs a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(np.float32(n))).astype(np.float32)


def rotate(x: np.ndarray, nrot: int) -> np.ndarray:
    """``H·x`` on consecutive blocks of ``nrot`` elements of the last axis (its own inverse)."""
    shape = x.shape
    blocks = np.asarray(x, dtype=np.float32).reshape(*shape[:-1], shape[-1] // nrot, nrot)
    return (blocks @ hadamard(nrot)).reshape(shape)  # H is symmetric


def rotation_k(head_dim: int) -> int:
    """llama.cpp's K rotation size for a head dimension (0: none): the largest power of two dividing it."""
    if head_dim % ROT_MIN or _rotation_disabled():
        return 0
    n = ROT_MIN
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def rotation_v(head_dim: int) -> int:
    """llama.cpp's V rotation size (0: none): 64."""
    return 0 if head_dim % ROT_MIN or _rotation_disabled() else ROT_MIN


def _rotation_disabled() -> bool:
    v = os.environ.get("LLAMA_ATTN_ROT_DISABLE")
    try:
        return bool(v) and int(v) != 0  # llama.cpp: atoi
    except ValueError:
        return False


@dataclass(frozen=True)
class RowCodec:
    """One quantized cache type: raw rows ``[..., row_bytes]`` uint8 ↔ float32 ``[..., head_dim]``, in the
    stored (rotated) basis."""

    type: int

    @property
    def _qtype(self):
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(self.type)

    @property
    def block(self) -> tuple[int, int]:
        """(values, bytes) of one block."""
        from gguf.constants import GGML_QUANT_SIZES

        return GGML_QUANT_SIZES[self._qtype]

    def row_bytes(self, n_values: int) -> int:
        values, nbytes = self.block
        if n_values % values:
            raise UsageError(f"a {self._qtype.name} KV cache needs head dimensions that are multiples of {values} "
                             f"(this model's is {n_values}): use the default F16 cache")
        return n_values // values * nbytes

    # Decoding, which every event does for every cell, is one C pass with gguf-py's (and ggml's) bits
    # (kernels.dequant_rows: every type in CACHE_TYPES). Encoding, for merged rows only, is gguf's quantizer,
    # given every row as one: it works through rows 16 at a time, and blocks are independent.

    def decode(self, raw: np.ndarray) -> np.ndarray:
        return kernels.dequant_rows(raw, self.type)

    def encode(self, x: np.ndarray) -> np.ndarray:
        from gguf.quants import quantize

        x = np.ascontiguousarray(x, dtype=np.float32)
        values, nbytes = self.block
        return quantize(x.reshape(1, -1), self._qtype).reshape(*x.shape[:-1], x.shape[-1] // values * nbytes)


def codec(t: int) -> RowCodec | None:
    """The codec of a cache type: None for F32/F16/BF16 (read as arrays of values); UsageError for a type
    kvlocal cannot rewrite."""
    if t in FLOAT_TYPES:
        return None
    if t not in _QUANTIZED:
        raise UsageError(f"compression with a {type_name(t)} KV cache is not supported: use f16, "
                         + ", ".join(n for n in CACHE_TYPES if n.startswith("q")))
    return RowCodec(t)


@dataclass(frozen=True)
class CacheBasis:
    """How a context stores K and V, as the scorers need it: float keys, values and queries in one basis."""

    k_codec: RowCodec | None
    v_codec: RowCodec | None
    k_rot: int  # 0: K is stored as computed
    v_rot: int

    @classmethod
    def for_cache(cls, type_k: int | None, type_v: int | None, head_dim_k: int, head_dim_v: int) -> "CacheBasis":
        tk = GGML_TYPE_F16 if type_k is None else type_k
        tv = GGML_TYPE_F16 if type_v is None else type_v
        kc, vc = codec(tk), codec(tv)
        for c, d in ((kc, head_dim_k), (vc, head_dim_v)):
            if c is not None:
                c.row_bytes(d)  # raises for a head that is not whole blocks
        return cls(kc, vc, rotation_k(head_dim_k) if kc else 0, rotation_v(head_dim_v) if vc else 0)

    def keys(self, rows: np.ndarray) -> np.ndarray:
        """Cache rows ``[..., d or bytes]`` → float32 keys in the stored basis (pair them with :meth:`queries`)."""
        return self.k_codec.decode(rows) if self.k_codec else as_f32(rows)

    def queries(self, q: np.ndarray) -> np.ndarray:
        """Model queries ``[..., d]`` → the basis the keys are stored in."""
        return rotate(q, self.k_rot) if self.k_rot else q

    def turn_keys(self, rows: np.ndarray, turn) -> tuple[np.ndarray, np.ndarray]:
        """Key rows ``[m, d or bytes]`` with their keys changed by ``turn`` (float32 keys as the model computed
        them → float32; RoPE moved to new positions): ``(rows in the cache's format, float32 keys in the stored
        basis)``. A quantized row is decoded, rotated back, turned, rotated and quantized again, as llama.cpp's
        K-shift does on a quantized cache."""
        if self.k_codec is None:
            out = turn(as_f32(rows)).astype(rows.dtype)
            return out, as_f32(out)
        k = self.k_codec.decode(rows)
        k = turn(rotate(k, self.k_rot) if self.k_rot else k)
        raw = self.k_codec.encode(rotate(k, self.k_rot) if self.k_rot else k)
        return raw, self.k_codec.decode(raw)

    def values(self, rows: np.ndarray) -> np.ndarray:
        """Cache rows → float32 values as the model computed them (rotated back), for ``‖v·W_O‖``."""
        if self.v_codec is None:
            return as_f32(rows)
        v = self.v_codec.decode(rows)
        return rotate(v, self.v_rot) if self.v_rot else v
