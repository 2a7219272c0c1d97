"""Work a GPU would hand back to the CPU without a word, said once instead.

ggml's scheduler runs an op on the CPU when the GPU backend's ``supports_op`` refuses it, copying its inputs across
on every call: for flash attention that is each layer's K and V at every decoded token. On CUDA that happens for
head sizes without a flash-attention kernel (ggml-cuda's ``fattn.cu``: 40, 64, 72, 80, 96, 112, 128 and 256 for
K and V alike, and the MLA shapes of DeepSeek, which kvlocal does not load) — the tiny test models' 32 and 48
among them. kvlocal then keeps attention on the GPU through the soft-max path, which every backend runs and which
adds the attention bias too; where llama.cpp needs flash attention (a quantized V cache) it says what it costs.
(ALiBi, whose bias CUDA's flash attention does not combine with kvlocal's, is refused at load: kvlocal.models.arch.)
"""

from __future__ import annotations

import functools
import sys

CUDA_FLASH_HEAD_DIMS = frozenset({40, 64, 72, 80, 96, 112, 128, 256})


def cuda_flash_gap(head_dim_k: int, head_dim_v: int) -> str | None:
    """Why CUDA's flash attention cannot run this model's attention, or None when it can."""
    if head_dim_k == head_dim_v and head_dim_k in CUDA_FLASH_HEAD_DIMS:
        return None
    sizes = f"{head_dim_k}" if head_dim_k == head_dim_v else f"{head_dim_k} (K) and {head_dim_v} (V)"
    return f"CUDA has no flash-attention kernel for head size {sizes}"


@functools.lru_cache(maxsize=None)
def say_once(line: str) -> None:
    """Print ``line`` to stderr the first time it comes up in this process."""
    print(f"kvlocal: {line}", file=sys.stderr)


def is_cuda_build() -> bool:
    from kvlocal.runtime.library import runtime_info

    return "CUDA" in runtime_info().system_info
