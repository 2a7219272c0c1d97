"""Dequantization of every block format the reference claims, against ggml's own.

The reference dequantizes with gguf-py (``gguf.quants.dequantize``, through ``kvlocal.models.gguf_file``). For
each type a random tensor is quantized by ggml (``ggml_quantize_chunk`` of the libggml that llama.cpp
runs on — gguf-py cannot write K-quants or IQ types) and dequantized twice: by ggml's ``to_float`` and by
the reference's loader. They must agree exactly, and the round trip must be close to the input (a sanity
check that the tensor was quantized at all, with bounds loose enough for 1.5-bit types).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf.quants import dequantize

from kvlocal.reference.weights import dequantize_tensor

Q = gguf.GGMLQuantizationType
# type → bound on the relative RMS error of the round trip on Gaussian data (1.3-2x the measured error:
# Q8_0 0.005, Q6_K 0.018, Q4_K 0.070, Q2_K 0.27, IQ2_XXS 0.35, IQ1_S 0.49, TQ2_0 0.82, ...)
CLAIMED = {
    Q.Q8_0: 0.01, Q.Q6_K: 0.03, Q.Q5_K: 0.05, Q.Q5_0: 0.07, Q.Q5_1: 0.07, Q.Q4_K: 0.1, Q.Q4_0: 0.15,
    Q.Q4_1: 0.12, Q.IQ4_NL: 0.12, Q.IQ4_XS: 0.12, Q.Q3_K: 0.25, Q.Q2_K: 0.45, Q.IQ3_S: 0.25,
    Q.IQ3_XXS: 0.3, Q.IQ2_S: 0.45, Q.IQ2_XS: 0.45, Q.IQ2_XXS: 0.5, Q.IQ1_M: 0.7, Q.IQ1_S: 0.7,
    Q.TQ1_0: 1.0, Q.TQ2_0: 1.0, Q.MXFP4: 0.2, Q.BF16: 0.003, Q.F16: 0.0004,
}
ROWS, COLS = 4, 512


class _Traits(ctypes.Structure):  # struct ggml_type_traits (ggml.h)
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


@pytest.fixture(scope="module")
def ggml():
    return load_ggml()


def load_ggml():
    """libggml-base of the llama.cpp that kvlocal runs on, with the two functions these tests call."""
    from kvlocal.runtime.library import llama_lib

    llama_lib()  # the version check; the same libggml-base llama.cpp loaded
    import llama_cpp

    lib_dir = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(llama_cpp.__file__).parent / "lib")
    lib = ctypes.CDLL(str(next(lib_dir.glob("libggml-base.*"))))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


def _quantize(lib, qtype: Q, x: np.ndarray) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
    imatrix = np.ones(x.shape[1], dtype=np.float32)  # IQ1/IQ2 refuse to quantize without one
    n = lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                                imatrix.ctypes.data)
    assert n == out.nbytes
    return out


def _ggml_to_float(lib, qtype: Q, data: np.ndarray, n: int) -> np.ndarray:
    to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
        lib.ggml_get_type_traits(int(qtype)).contents.to_float)
    out = np.zeros(n, dtype=np.float32)
    to_float(data.ctypes.data, out.ctypes.data, n)
    return out


class _Tensor:  # what gguf_file.dequantize_tensor reads of a ReaderTensor
    def __init__(self, name, data, qtype, shape):
        self.name, self.data, self.tensor_type, self.shape = name, data, qtype, shape


@pytest.mark.parametrize("qtype", list(CLAIMED), ids=lambda t: t.name)
def test_dequantize_equals_ggml(ggml, qtype):
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    data = _quantize(ggml, qtype, x)
    theirs = _ggml_to_float(ggml, qtype, data, x.size).reshape(x.shape)
    ours = dequantize_tensor(_Tensor("t", data, qtype, (COLS, ROWS)))  # shape as ggml's ne
    assert ours.shape == x.shape
    np.testing.assert_array_equal(ours.numpy(), theirs)
    rel = float(np.sqrt(((theirs - x) ** 2).mean() / (x**2).mean()))
    assert rel <= CLAIMED[qtype], rel


def test_claimed_types_are_gguf_dequantizable():
    """What docs/verify.md lists as dequantizable is what this gguf-py can do (anything else is refused by
    name: test_model.py::test_unsupported_quant_type)."""
    for qtype in CLAIMED:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        out = dequantize(np.zeros(size, dtype=np.uint8), qtype)
        assert out.size == block and not np.any(out), qtype  # one block of zeros is block zeros
