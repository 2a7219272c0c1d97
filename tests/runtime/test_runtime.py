"""The llama.cpp binding on the real runtime and the default model."""

import numpy as np
import pytest

import kvlocal.runtime.library as library
from kvlocal.errors import UsageError
from kvlocal.runtime import Context, runtime_info


def test_runtime_is_the_patched_build():
    info = runtime_info()
    assert info.version == library.REQUIRED_LLAMA_CPP_PYTHON
    assert info.patched and info.patch_abi == library.REQUIRED_PATCH_ABI


def test_version_mismatch_is_a_clear_error(monkeypatch):
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "__version__", "0.3.99")
    library.llama_lib.cache_clear()
    try:
        with pytest.raises(UsageError, match="needs llama-cpp-python 0.3.36, found 0.3.99"):
            library.llama_lib()
    finally:
        monkeypatch.undo()
        library.llama_lib.cache_clear()
        library.llama_lib()


def test_seq_cells_follows_removal_and_refill(smollm2_model):
    """The patch's llama_memory_seq_cells: after removing positions, new tokens fill the freed cells first."""
    ctx = Context(smollm2_model, n_ctx=64)
    tokens = smollm2_model.tokenize("The quick brown fox jumps over the lazy dog again and again")[:12]
    ctx.decode(tokens, range(12), logits="none")
    cells, pos = ctx.cells()
    np.testing.assert_array_equal(cells, np.arange(12))
    np.testing.assert_array_equal(pos, np.arange(12))

    ctx.remove(3, 7)
    cells, pos = ctx.cells()
    np.testing.assert_array_equal(pos, [0, 1, 2, 7, 8, 9, 10, 11])
    np.testing.assert_array_equal(cells, [0, 1, 2, 7, 8, 9, 10, 11])

    ctx.decode(tokens[:2], [12, 13], logits="none")
    cells, pos = ctx.cells()
    assert dict(zip(pos.tolist(), cells.tolist()))[12] in (3, 4, 5, 6)  # a freed cell, not cell 12
    assert sorted(pos.tolist()) == [0, 1, 2, 7, 8, 9, 10, 11, 12, 13]
    assert ctx.pos_max() == 13


def test_decode_in_batches_equals_one_batch(smollm2_model):
    tokens = smollm2_model.tokenize("Paris is the capital of France. Berlin is the capital of Germany.")
    a = Context(smollm2_model, n_ctx=128, n_batch=len(tokens)).decode(tokens, logits="all")
    b = Context(smollm2_model, n_ctx=128, n_batch=5).decode(tokens, logits="all")
    assert a.shape == (len(tokens), smollm2_model.n_vocab)
    np.testing.assert_allclose(a, b, atol=2e-2)
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.9


def test_greedy_answer_from_the_default_model(smollm2_model):
    m = smollm2_model
    ctx = Context(m, n_ctx=256)
    prompt = m.chat_prompt([{"role": "user", "content": "What is the capital of Germany?"}])
    logits = ctx.decode(m.tokenize(prompt, parse_special=True))
    out = []
    for _ in range(16):
        tok = int(np.argmax(logits))
        if m.is_eog(tok):
            break
        out.append(tok)
        logits = ctx.decode([tok])
    assert "Berlin" in m.detokenize(out)


def test_threads_default_to_the_cores_this_process_may_use(smollm2_model):
    """A process narrowed to one core (taskset, a cpuset, a pinned test worker) decodes with one thread."""
    import os

    from kvlocal.runtime.llama import default_threads

    before, was = os.sched_getaffinity(0), default_threads()
    try:
        os.sched_setaffinity(0, {min(before)})
        assert default_threads() == 1
        ctx = Context(smollm2_model, n_ctx=64)
        assert ctx.n_threads == 1
        ctx.close()
    finally:
        os.sched_setaffinity(0, before)
    assert default_threads() == was  # the process's own cores again
