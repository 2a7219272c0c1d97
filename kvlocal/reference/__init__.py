"""PyTorch reference: GGUF weights → a readable float32 forward pass with an explicit KV cache.

``Transformer.from_gguf(path)`` loads a llama, qwen2, qwen3 or gemma3 GGUF file; ``model(tokens, positions, cache)``
returns logits and appends post-RoPE keys and values to a :class:`KVCache` whose rows may be kept,
merged and biased per head. ``kvlocal verify`` checks this model against llama.cpp.

torch is imported only when this package is, so the rest of kvlocal runs without it.
"""

from kvlocal.reference.cache import KVCache, LayerKV, attend
from kvlocal.reference.model import Transformer, apply_rope, attend_window, prefill, rope_angles
from kvlocal.reference.weights import ModelArgs, load_gguf

__all__ = [
    "KVCache", "LayerKV", "attend", "attend_window", "Transformer", "ModelArgs", "load_gguf", "prefill", "rope_angles", "apply_rope",
]
