"""Loading llama-cpp-python, version pinning, and detection of the kvlocal patch series."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass

from kvlocal.errors import RuntimeUnavailable

# llama.cpp's internal formats (the sequence-state blob, graph node names) change between versions;
# everything in runtime/ was checked against this one.
REQUIRED_LLAMA_CPP_PYTHON = "0.3.36"
# LLAMA_KVLOCAL_ABI_VERSION written by the last patch in ggml_patches/
REQUIRED_PATCH_ABI = 17

BUILD_HINT = "run `python ggml_patches/build.py` (see README)"


@dataclass(frozen=True)
class RuntimeInfo:
    version: str  # llama-cpp-python version
    library: str  # path of the libllama that was loaded
    patch_abi: int  # LLAMA_KVLOCAL_ABI_VERSION of the loaded library, 0 for a stock build
    gpu_offload: bool  # the build has a GPU backend (CUDA, Metal, ...)
    system_info: str  # llama_print_system_info(): the CPU features / backends compiled in

    @property
    def patched(self) -> bool:
        return self.patch_abi > 0

    def describe(self) -> str:
        kind = f"patched (kvlocal ABI {self.patch_abi})" if self.patched else "stock (not patched)"
        return f"llama-cpp-python {self.version}, {kind}"


def _import_llama_cpp():
    try:
        import llama_cpp
        import llama_cpp.llama_cpp as lib
    except ImportError as e:
        raise RuntimeUnavailable(f"llama-cpp-python is not installed ({e}): {BUILD_HINT}") from None
    except (OSError, RuntimeError) as e:  # the shared library failed to load
        raise RuntimeUnavailable(f"llama.cpp library failed to load ({e}): {BUILD_HINT}") from None
    return llama_cpp, lib


@functools.lru_cache(maxsize=None)
def llama_lib():
    """The ``llama_cpp.llama_cpp`` module, after the version check. Raises RuntimeUnavailable (a UsageError) on a mismatch."""
    llama_cpp, lib = _import_llama_cpp()
    version = getattr(llama_cpp, "__version__", "?")
    if version != REQUIRED_LLAMA_CPP_PYTHON and not os.environ.get("KVLOCAL_ALLOW_ANY_LLAMA_CPP"):
        raise RuntimeUnavailable(
            f"kvlocal needs llama-cpp-python {REQUIRED_LLAMA_CPP_PYTHON}, found {version}: {BUILD_HINT}"
        )
    lib.llama_backend_init()
    _silence_logs(lib)
    if not hasattr(lib._lib, "llama_kvlocal_abi_version"):
        print(f"kvlocal: stock llama.cpp runtime (not patched): eviction only; for the patched one {BUILD_HINT}",
              file=sys.stderr)
    return lib


_LOG_CB = None  # keep the ctypes callback alive
RPC_SOCKET_ERRORS = (b"recv failed (", b"send failed (")  # ggml-rpc's transport.cpp
# while this says so, errors are not printed: set by kvlocal.runtime.rpc to "an rpc-server was lost", whose loss
# and the failed graphs after it kvlocal reports in one line of its own (ServerLost)
quiet_errors = lambda: False  # noqa: E731


def _silence_logs(lib) -> None:
    """llama.cpp logs every load to stderr; keep errors only, unless KVLOCAL_VERBOSE is set."""
    global _LOG_CB
    if os.environ.get("KVLOCAL_VERBOSE"):
        return

    @lib.llama_log_callback
    def _cb(level, text, user_data):
        # ggml-rpc's socket errors come just before a lost server, which kvlocal.runtime.rpc turns into one line
        if level >= 4 and not text.startswith(RPC_SOCKET_ERRORS) and not quiet_errors():  # GGML_LOG_LEVEL_ERROR
            os.write(2, text)

    _LOG_CB = _cb
    lib.llama_log_set(_cb, ctypes.c_void_p(0))


class KvlocalCounters(ctypes.Structure):
    """``struct llama_kvlocal_counters`` (patch ABI 17): what kvlocal's functions cost a context so far."""

    _fields_ = [("n_transfers", ctypes.c_uint64), ("compute_bytes", ctypes.c_size_t), ("kv_compute_peak", ctypes.c_size_t)]


def _symbol(name: str, restype, argtypes):
    """A function of libllama that llama-cpp-python does not bind (our patch's), or None if absent."""
    try:
        fn = getattr(llama_lib()._lib, name)
    except AttributeError:
        return None
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


@functools.lru_cache(maxsize=None)
def patch_functions():
    """ctypes handles of the functions our patch series adds; None for each one the library lacks."""
    return {
        "abi_version": _symbol("llama_kvlocal_abi_version", ctypes.c_int32, []),
        "seq_cells": _symbol(
            "llama_memory_seq_cells",
            ctypes.c_int32,
            [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.c_int32],
        ),
        "buffer_size": _symbol("llama_memory_buffer_size", ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_int32]),
        "get_bias": _symbol(
            "llama_memory_seq_get_bias", ctypes.c_int32,
            [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t],
        ),
        "set_bias": _symbol(
            "llama_memory_seq_set_bias", ctypes.c_int32,
            [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t],
        ),
        "bias_cells": _symbol("llama_memory_bias_cells", ctypes.c_int32, [ctypes.c_void_p]),
        "compact": _symbol(
            "llama_kv_compact", ctypes.c_int32,
            [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
             ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)],
        ),
        "score": _symbol(
            "llama_kv_score", ctypes.c_int32,
            [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_float), ctypes.c_int32, ctypes.c_float,
             ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int32),
             ctypes.c_int32, ctypes.POINTER(ctypes.c_float), ctypes.c_int32, ctypes.POINTER(ctypes.c_float),
             ctypes.POINTER(ctypes.c_float)],
        ),
        "host_view": _symbol(
            "llama_kv_host_view", ctypes.c_int32,
            [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
             ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int32)],
        ),
        "merge": _symbol(
            "llama_kv_merge", ctypes.c_int32,
            [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
             ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float),
             ctypes.POINTER(ctypes.c_float)],
        ),
        "counters": _symbol("llama_kvlocal_get_counters", KvlocalCounters, [ctypes.c_void_p]),
        **{name: _symbol(
            f"llama_kv_{name}", ctypes.c_int32,
            [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
             ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t],
        ) for name in ("rows_get", "rows_set")},
    }


@functools.lru_cache(maxsize=None)
def has_attention_bias() -> bool:
    """Whether the runtime's KV cells carry the per-head attention bias (patch 0007): its state blobs then
    have a bias section, and merging and head-budget methods can run."""
    return patch_functions()["set_bias"] is not None


@functools.lru_cache(maxsize=None)
def has_native_compression() -> bool:
    """Whether the runtime scores and compacts KV cells on their device (patches 0009-0010): the engine's
    ``native`` backend."""
    fns = patch_functions()
    return fns["compact"] is not None and fns["score"] is not None


def has_native_recall() -> bool:
    """Whether the runtime copies chosen K/V rows between the device and the host (patch 0011): the native
    backend's recall tier."""
    fns = patch_functions()
    return fns["rows_get"] is not None and fns["rows_set"] is not None


def local_gpu() -> bool:
    """Whether this machine has a GPU device the runtime can offload to. Not ``llama_supports_gpu_offload()``, which
    says yes for any build with the RPC backend, where the CPU may be the only device here."""
    lib = llama_lib()
    by_type = _symbol("ggml_backend_dev_by_type", ctypes.c_void_p, [ctypes.c_int])
    if by_type is None:
        return bool(lib.llama_supports_gpu_offload())
    return any(by_type(t) for t in (1, 2))  # GGML_BACKEND_DEVICE_TYPE_GPU, _IGPU (RPC devices are never registered)


def runtime_info() -> RuntimeInfo:
    """What runtime kvlocal runs on. A stock runtime is reported, not refused: eviction works on it."""
    lib = llama_lib()
    abi_fn = patch_functions()["abi_version"]
    abi = int(abi_fn()) if abi_fn else 0
    if abi and abi != REQUIRED_PATCH_ABI:
        raise RuntimeUnavailable(
            f"llama.cpp was built from kvlocal patch ABI {abi}, this kvlocal needs {REQUIRED_PATCH_ABI}: {BUILD_HINT}"
        )
    import llama_cpp

    return RuntimeInfo(
        version=llama_cpp.__version__,
        library=str(getattr(lib._lib, "_name", "?")),
        patch_abi=abi,
        gpu_offload=local_gpu(),
        system_info=lib.llama_print_system_info().decode(errors="replace").strip(),
    )
