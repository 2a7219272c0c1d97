"""What kvlocal needs to know about a model's attention, from its GGUF metadata alone.

One description for everything that scores or recomputes attention: the engine (through
``runtime.Model.arch``), the PyTorch reference and ``kvlocal verify``. It reads metadata through a
``meta(key) -> str | None`` function, so llama.cpp's ``llama_model_meta_val_str`` and gguf-py's reader
feed it alike, and it never imports either.

Supported: ``llama`` (Llama 2/3, SmolLM2; Llama 3's rope scaling happens inside llama.cpp's graph and
the captured queries are after RoPE), ``qwen2``, ``qwen3`` (q/k RMS norms, head size ≠ n_embd/n_head)
and ``gemma3`` (interleaved sliding-window attention; query scaling). Anything else is refused at
load with one line: its attention (recurrent state, hybrid caches, MLA, ALiBi, M-RoPE, …) is not
what kvlocal's scorers and KV backend assume.

Attention scale, as llama.cpp's graphs use it (src/models/<arch>.cpp of the pinned llama.cpp):

- llama, qwen2, qwen3: ``1/√head_dim_k`` (llama.cpp's llama graph would honour ``f_attention_scale``,
  but its llama loader never reads ``llama.attention.scale``: a file that has it is still computed with
  ``1/√head_dim_k``, measured in tests/engine/test_engine_archs.py);
- gemma3: the query is multiplied by ``f_attention_scale`` after RoPE (``1/√head_dim_k``; the 27B
  model, 62 layers, uses ``1/√(n_embd/n_head)``) and attention then uses a scale of 1.

Sliding layers (gemma3): ``{arch}.attention.sliding_window_pattern`` (an int n: every n-th layer is
full, the others slide; or a per-layer bool array), default 6, as llama.cpp's ``set_swa_pattern``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from kvlocal.errors import UsageError

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3")
_SWA_PATTERN_DEFAULT = {"gemma3": 6}


@dataclass(frozen=True)
class ArchInfo:
    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    head_dim_k: int
    head_dim_v: int
    attn_scale: float  # multiplies q·k before the softmax, as llama.cpp's graph does in effect
    n_swa: int  # sliding window in tokens (0: none)
    swa: tuple[bool, ...]  # per layer: True where the layer attends over a sliding window

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Layers that attend over the whole context: the ones whose cache kvlocal compresses."""
        return tuple(il for il, s in enumerate(self.swa) if not s)

    @property
    def has_swa(self) -> bool:
        return any(self.swa)


def _int(meta: Callable[[str], str | None], key: str, default: int | None = None) -> int:
    val = meta(key)
    if val is None:
        if default is None:
            raise UsageError(f"the GGUF file has no {key}: it is damaged or was converted by an old tool")
        return default
    return int(float(val))


def _swa_pattern(text: str | None, arch: str, n_layer: int) -> tuple[bool, ...]:
    if text is not None and text.strip().startswith("["):  # per-layer array, as llama.cpp prints it
        items = [s.strip().lower() for s in text.strip()[1:-1].split(",") if s.strip()]
        flags = tuple(s in ("true", "1") for s in items)
        if len(flags) != n_layer:
            raise UsageError(f"{arch}.attention.sliding_window_pattern has {len(flags)} entries for {n_layer} layers")
        return flags
    n = int(float(text)) if text is not None else _SWA_PATTERN_DEFAULT.get(arch, 0)
    return tuple(n == 0 or (il % n < n - 1) for il in range(n_layer))


def arch_info(meta: Callable[[str], str | None], name: str = "the model") -> ArchInfo:
    """The attention description of a model; raises UsageError for an architecture kvlocal refuses."""
    arch = meta("general.architecture")
    if arch not in SUPPORTED:
        raise UsageError(
            f"{name} is a '{arch}' model; kvlocal supports {', '.join(SUPPORTED)} "
            "(recurrent, hybrid, MLA, ALiBi and M-RoPE attention are not supported)"
        )
    n_layer = _int(meta, f"{arch}.block_count")
    n_embd = _int(meta, f"{arch}.embedding_length")
    n_head = _int(meta, f"{arch}.attention.head_count")
    n_head_kv = _int(meta, f"{arch}.attention.head_count_kv", n_head)
    head_k = _int(meta, f"{arch}.attention.key_length", n_embd // n_head)
    head_v = _int(meta, f"{arch}.attention.value_length", head_k)
    if arch == "gemma3":
        scale = 1 / math.sqrt(n_embd / n_head if n_layer == 62 else head_k)
    else:
        scale = 1 / math.sqrt(head_k)
    n_swa = _int(meta, f"{arch}.attention.sliding_window", 0) if arch == "gemma3" else 0
    swa = _swa_pattern(meta(f"{arch}.attention.sliding_window_pattern"), arch, n_layer) if n_swa > 0 else (False,) * n_layer
    return ArchInfo(arch, n_layer, n_head, n_head_kv, n_embd, head_k, head_v, scale, n_swa, swa)


def gguf_meta(header) -> Callable[[str], str | None]:
    """A ``meta`` function over a :class:`~kvlocal.models.gguf_header.GGUFHeader` (scalars as text, arrays as
    ``[a, b]``)."""

    def meta(key: str) -> str | None:
        value = header.get(key)
        if value is None or value == []:
            return None
        return "[" + ", ".join(str(v) for v in value) + "]" if isinstance(value, list) else str(value)

    return meta
