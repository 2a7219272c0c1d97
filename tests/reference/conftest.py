"""Fixtures of the reference tests: tiny generated GGUF models (four architectures × five weight types),
and llama.cpp logits for a token sequence.

The tests run llama.cpp for real (no mocks). The real models are the suite's own fixtures (tests/conftest.py:
``smollm2``, ``smollm2_model``, ``smollm2_ref``, ``gemma3``: pulled and loaded once per session).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from policy import need

torch = need("torch")  # the reference is PyTorch: skip locally, fail under CI

sys.path.insert(0, str(Path(__file__).parent))  # tiny_gguf, whatever pytest's import mode

import tiny_gguf  # noqa: E402

# One thread for torch and for llama.cpp (`llama_logits`, `--threads 1`): on a busy 2-core machine the
# barriers of two threads per op made the same forward pass 10-40x slower, and tiny models gain nothing.
torch.set_num_threads(1)

GGML_TYPE_F32 = 0


def _llama_logits(model, tokens, positions=None, rope_freq_base: float = 0.0) -> np.ndarray:
    """llama.cpp's logits [T, V] for tokens decoded in one fresh context (F32 cache, no flash attention)."""
    from kvlocal.runtime import Context

    ctx = Context(model, n_ctx=max(len(tokens), 256), n_batch=512, rope_freq_base=rope_freq_base,
                  type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, n_threads=1)
    try:
        return ctx.decode(tokens, positions=positions, logits="all")
    finally:
        ctx.close()


@pytest.fixture(scope="session")
def llama_logits():
    """llama_logits(model, tokens, positions=None, rope_freq_base=0.0) → [T, V] from llama.cpp."""
    return _llama_logits


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_gguf")
    for arch in tiny_gguf.ARCHS:
        for wtype in tiny_gguf.WTYPES:
            tiny_gguf.write_tiny_gguf(d / f"tiny-{arch}-{wtype}.gguf", arch, wtype)
    return d


@pytest.fixture(scope="session")
def tiny_path(tiny_dir):
    def path(arch: str, wtype: str) -> Path:
        return tiny_dir / f"tiny-{arch}-{wtype}.gguf"

    return path


@pytest.fixture(scope="session")
def sample_text() -> str:
    from kvlocal.eval.tasks import sample_text

    return sample_text()


@pytest.fixture(scope="session")
def smollm2_llama(smollm2_model):
    """SmolLM2 as llama.cpp loaded it: the suite's one copy (tests/conftest.py)."""
    return smollm2_model


@pytest.fixture(scope="session")
def unsupported_gguf(tmp_path_factory, tiny_path) -> Path:
    return tiny_gguf.write_unsupported_gguf(tmp_path_factory.mktemp("bad") / "q8_1.gguf", tiny_path("llama", "F32"))


@pytest.fixture(scope="session")
def write_tiny(tmp_path_factory):
    """write_tiny(name, **kwargs) → path of a tiny model written with tiny_gguf.write_tiny_gguf(**kwargs)."""
    d = tmp_path_factory.mktemp("tiny_variants")

    def write(name: str, **kwargs) -> Path:
        return tiny_gguf.write_tiny_gguf(d / f"{name}.gguf", **kwargs)

    return write
