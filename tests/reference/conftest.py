"""Fixtures of the reference tests: tiny generated GGUF models (four architectures × five weight types),
SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M, each loaded once per session.

The tests run llama.cpp for real (no mocks). SmolLM2 is $KVLOCAL_TEST_SMOLLM2 if set, Gemma 3
$KVLOCAL_TEST_GEMMA3, else the copy in kvlocal's model cache, pulled on first use (``kvlocal.models.pull``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch and ggml start OpenMP; see verify.run
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tiny_gguf, whatever pytest's import mode

import tiny_gguf  # noqa: E402

# One thread for torch and for llama.cpp (`llama_logits`, `--threads 1`): on a busy 2-core machine the
# barriers of two threads per op made the same forward pass 10-40x slower, and tiny models gain nothing.
torch.set_num_threads(1)

GGML_TYPE_F32 = 0


def model_path(name: str = "smollm2-135m", env_var: str = "KVLOCAL_TEST_SMOLLM2") -> Path | None:
    env = os.environ.get(env_var)
    candidates = [Path(env)] if env else []
    from kvlocal.models import pull  # the user's model cache; downloaded on first use

    candidates.append(pull(name, quiet=True))
    return next((p for p in candidates if p.is_file()), None)


def smollm2_path() -> Path | None:
    return model_path("smollm2-135m", "KVLOCAL_TEST_SMOLLM2")


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
def smollm2() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2-135M not found (set KVLOCAL_TEST_SMOLLM2 to its .gguf path)")
    return path


@pytest.fixture(scope="session")
def gemma3() -> Path:
    path = model_path("gemma3-270m", "KVLOCAL_TEST_GEMMA3")
    if path is None:
        pytest.skip("Gemma 3 270M not found (set KVLOCAL_TEST_GEMMA3 to its .gguf path)")
    return path


@pytest.fixture(scope="session")
def smollm2_ref(smollm2):
    from kvlocal.reference import Transformer

    return Transformer.from_gguf(smollm2)


@pytest.fixture(scope="session")
def smollm2_llama(smollm2):
    from kvlocal.runtime import Model

    return Model(smollm2)


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
