"""numpy front end of the native CPU kernels (kernels/cpu, compiled into ``kvlocal._kernels``)."""

from __future__ import annotations

import numpy as np

try:
    from ._kernels import ffi, lib
except ImportError as e:  # an install that skipped the cffi step (e.g. a bare checkout on PYTHONPATH)
    raise ImportError(
        f"kvlocal's native kernels are not built ({e}); reinstall with `pip install -e .` (needs a C compiler)"
    ) from None

POOL_KINDS = {"max": 0, "avg": 1}


def _f32_rows(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x.reshape(1, -1) if x.ndim == 1 else x.reshape(-1, x.shape[-1])


def _ptr(a: np.ndarray, ctype: str):
    return ffi.cast(ctype, ffi.from_buffer(a))


def pool1d(x: np.ndarray, kernel: int, kind: str = "max") -> np.ndarray:
    """Stride-1 'same' pooling along the last axis (max, or avg counting zero padding)."""
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd and >= 1, got {kernel}")
    src = _f32_rows(x)
    dst = np.empty_like(src)
    lib.kvl_pool1d_f32(_ptr(src, "float *"), _ptr(dst, "float *"), src.shape[0], src.shape[1], kernel, POOL_KINDS[kind])
    return dst.reshape(np.shape(x))


def topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values along the last axis, in increasing index order (ties: lower index)."""
    src = _f32_rows(x)
    if not 0 <= k <= src.shape[1]:
        raise ValueError(f"k={k} out of range for rows of {src.shape[1]}")
    idx = np.empty((src.shape[0], k), dtype=np.int32)
    lib.kvl_topk_f32(_ptr(src, "float *"), src.shape[0], src.shape[1], k, _ptr(idx, "int *"))
    return idx.reshape(*np.shape(x)[:-1], k)
