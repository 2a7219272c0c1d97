"""The only place that talks to llama.cpp; this module is its face — import from here, not from the files.

- ``library``: loads llama-cpp-python, checks its version, detects kvlocal's patch series; ``buildinfo``: what
  ggml_patches/build.py recorded (a Metal build's patches), and so where a biased cache may use flash attention;
- ``llama``: :class:`Model` and :class:`Context` on the low-level API (kvlocal runs its own decode loop,
  because ``Llama.eval`` assumes cell i = position i, which stops being true after eviction);
- ``capture``: the observation queries (:class:`QueryCapture`, an eval callback);
- ``backend``, ``backend_state``, ``backend_native``: the two KV backends (:func:`make_backend`);
- ``state``: llama.cpp's sequence-state format; ``kvquant``: quantized cache rows; ``weights``: W_O;
  ``sampler``: llama.cpp's sampler chain; ``chat_template``: the GGUF's chat template.
"""

from kvlocal.runtime.backend import BACKEND_NAMES, CacheRead, KVBackend, RowRecord, count_bias, resolve_backend
from kvlocal.runtime.backend_native import NativeBackend
from kvlocal.runtime.backend_state import StateBackend
from kvlocal.runtime.buildinfo import MetalBias, flash_attention, metal_bias
from kvlocal.runtime.capture import QueryCapture
from kvlocal.runtime.kvquant import CACHE_TYPES, CacheBasis, bytes_per_value, cache_type
from kvlocal.runtime.library import (REQUIRED_LLAMA_CPP_PYTHON, RuntimeInfo, has_attention_bias, has_native_compression,
                                     runtime_info)
from kvlocal.runtime.llama import N_UBATCH, Context, Model, kv_cache_bytes, pad_cells
from kvlocal.runtime.sampler import (CHAT_SAMPLING, SAMPLING_PARAMS, Sampler, SamplerParamError, chat_sampling,
                                     top_probability)
from kvlocal.runtime.seqstate import row_format
from kvlocal.runtime.state import CacheLost
from kvlocal.runtime.weights import output_projections

BACKENDS = {"native": NativeBackend, "state": StateBackend}


def make_backend(name: str, ctx: Context, layers, n_head_kv: int, head_dim: int, basis=None, wo=None,
                 norm_p: int = 1) -> KVBackend:
    """The KV backend ``name`` (``native`` or ``state``, as :func:`resolve_backend` returns) on ``ctx``; ``norm_p``:
    the p of the value norms the scorer ranks by (:func:`kvlocal.compress.criticalkv.norm_p`)."""
    return BACKENDS[name](ctx, layers, n_head_kv, head_dim, basis=basis, wo=wo, norm_p=norm_p)


__all__ = [
    "BACKEND_NAMES", "CACHE_TYPES", "N_UBATCH", "REQUIRED_LLAMA_CPP_PYTHON",
    "CacheBasis", "CacheLost", "CacheRead", "Context", "KVBackend", "MetalBias", "Model", "NativeBackend",
    "QueryCapture",
    "RowRecord", "RuntimeInfo", "Sampler", "SamplerParamError", "CHAT_SAMPLING", "SAMPLING_PARAMS", "chat_sampling", "StateBackend",
    "bytes_per_value", "cache_type", "count_bias", "flash_attention", "has_attention_bias", "has_native_compression",
    "kv_cache_bytes",
    "make_backend", "metal_bias", "output_projections", "pad_cells", "resolve_backend", "row_format", "runtime_info",
    "top_probability",
]
