"""The only place that talks to llama.cpp; this module is its face — import from here, not from the files.

- ``library``: loads llama-cpp-python, checks its version, detects kvlocal's patch series; ``buildinfo``: what
  ggml_patches/build.py recorded (a Metal build's patches), and so where a biased cache may use flash attention;
- ``llama``: :class:`Model` and :class:`Context` on the low-level API (kvlocal runs its own decode loop,
  because ``Llama.eval`` assumes cell i = position i, which stops being true after eviction);
- ``capture``: the observation queries (:class:`QueryCapture`, an eval callback);
- ``state``, ``seqstate``, ``hostview``: llama.cpp's sequence-state format and the cache's rows in host memory;
  ``kvquant``: quantized cache rows; ``sampler``: llama.cpp's sampler chain; ``chat_template``: the GGUF's chat
  template; ``rpc``: llama.cpp's RPC backend (``Model(rpc=…)``: layers and their cache on other machines'
  rpc-servers, each probed and checked first; docs/distributed.md).

It knows nothing of scorers or plans: the KV backends that apply a plan to llama.cpp's cache sit above it, in
:mod:`kvlocal.backends` (``tests/test_layers.py`` holds the layers to their order).
"""

from kvlocal.runtime.buildinfo import MetalBias, flash_attention, metal_bias
from kvlocal.runtime.capture import QueryCapture
from kvlocal.runtime.chat_template import HERMES_OPEN
from kvlocal.runtime.hostview import STATE_IO_ENV, HostView
from kvlocal.runtime.kvquant import CACHE_TYPES, FLOAT_TYPES, CacheBasis, bytes_per_value, cache_type
from kvlocal.runtime.library import (REQUIRED_LLAMA_CPP_PYTHON, RuntimeInfo, has_attention_bias, has_native_compression,
                                     has_native_recall, runtime_info)
from kvlocal.runtime.llama import BIAS_BYTES, N_UBATCH, Context, Model, kv_cache_bytes, pad_cells
from kvlocal.runtime.rpc import (DEFAULT_PORT, SECURITY, check_bias, dead_servers, has_rpc, lost_text,
                                 parse_endpoints, probe, server_binary)
from kvlocal.runtime.sampler import (CHAT_SAMPLING, SAMPLING_PARAMS, Sampler, SamplerParamError, chat_sampling,
                                     top_probability)
from kvlocal.runtime.seqstate import blob_rows, row_bytes, row_format, rows_from_bytes, rows_to_bytes
from kvlocal.runtime.state import CacheLost, clear_seq, get_blob, read_seq, set_blob, write_seq

__all__ = [
    "BIAS_BYTES", "CACHE_TYPES", "DEFAULT_PORT", "FLOAT_TYPES", "HERMES_OPEN", "N_UBATCH", "REQUIRED_LLAMA_CPP_PYTHON",
    "SECURITY", "STATE_IO_ENV", "HostView", "blob_rows", "clear_seq", "get_blob", "has_native_recall",
    "check_bias", "dead_servers", "has_rpc", "lost_text", "parse_endpoints", "probe", "read_seq", "row_bytes",
    "rows_from_bytes", "rows_to_bytes", "server_binary", "set_blob",
    "write_seq",
    "CacheBasis", "CacheLost", "Context", "MetalBias", "Model", "QueryCapture",
    "RuntimeInfo", "Sampler", "SamplerParamError", "CHAT_SAMPLING", "SAMPLING_PARAMS", "chat_sampling",
    "bytes_per_value", "cache_type", "flash_attention", "has_attention_bias", "has_native_compression",
    "kv_cache_bytes", "metal_bias", "pad_cells", "row_format", "runtime_info", "top_probability",
]
