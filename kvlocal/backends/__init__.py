"""The KV backends: where a compression event reads llama.cpp's cache and writes a plan back.

They sit between the scorers (:mod:`kvlocal.compress`: ``LayerInputs`` in, a ``Plan`` out) and the runtime
(:mod:`kvlocal.runtime`, the only code that talks to llama.cpp, which knows nothing of either); the engine
imports them from here.

- ``base``: the interface (:class:`KVBackend`), each row's record (:class:`RowRecord`), what an event read
  (:class:`CacheRead`), and which backend an engine runs (:func:`resolve_backend`);
- ``state``: :class:`StateBackend`, the cells scored on the host; ``native``: :class:`NativeBackend`, the patched
  llama.cpp scores them and moves the kept rows on the device;
- ``weights``: W_O read from the GGUF, for CriticalKV's value norms on the host (:func:`output_projections`).
"""

from kvlocal.backends.base import BACKEND_NAMES, CacheRead, KVBackend, RowRecord, count_bias, resolve_backend
from kvlocal.backends.native import NativeBackend
from kvlocal.backends.state import StateBackend
from kvlocal.backends.weights import output_projections

BACKENDS = {"native": NativeBackend, "state": StateBackend}


def make_backend(name: str, ctx, layers, n_head_kv: int, head_dim: int, basis=None, wo=None,
                 norm_p: int = 1) -> KVBackend:
    """The KV backend ``name`` (``native`` or ``state``, as :func:`resolve_backend` returns) on ``ctx`` (a
    :class:`kvlocal.runtime.Context`); ``norm_p``: the p of the value norms the scorer ranks by
    (:func:`kvlocal.compress.criticalkv.norm_p`)."""
    return BACKENDS[name](ctx, layers, n_head_kv, head_dim, basis=basis, wo=wo, norm_p=norm_p)


__all__ = [
    "BACKENDS", "BACKEND_NAMES", "CacheRead", "KVBackend", "NativeBackend", "RowRecord", "StateBackend",
    "count_bias", "make_backend", "output_projections", "resolve_backend",
]
