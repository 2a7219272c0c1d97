"""The per-head attention bias of the patched llama.cpp (patches 0003, 0007) on the real runtime.

Every KV cell holds an additive attention logit per KV head: ``log(count)`` for an entry that stands for
``count`` merged tokens (its value their mean), ``-inf`` for an entry a head does not use. These tests
check it against what it must be equivalent to, with llama.cpp computing both sides: no bias, evicted
cells, duplicated cells. Flash attention off and on (separate kernels: a broadcast add over ``kq``, and
the new source of ``ggml_flash_attn_ext``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvlocal.runtime import Context, Model
from kvlocal.runtime.state import read_seq, write_seq

TEXT = ("The history of the city goes back to a small settlement on the river, where traders met every "
        "spring to exchange salt and wool.")

FA = pytest.mark.parametrize("fa", [False, True], ids=["fa-off", "fa-on"])


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) of the next-token distributions of two logit vectors."""
    a, b = (np.asarray(x, dtype=np.float64).ravel() for x in (p_logits, q_logits))
    la, lb = a - a.max(), b - b.max()
    la -= np.log(np.exp(la).sum())
    lb -= np.log(np.exp(lb).sum())
    return float((np.exp(la) * (la - lb)).sum())


NGL = int(os.environ.get("KVLOCAL_TEST_NGL", "0"))  # a GPU machine: offload the model (ggml_patches/gpu_check.sh)


@pytest.fixture(scope="module")
def model(smollm2, smollm2_model):
    """SmolLM2 on the CPU, or with KVLOCAL_TEST_NGL layers offloaded (CUDA/Metal kernels of the bias)."""
    return smollm2_model if NGL == 0 else Model(smollm2, n_gpu_layers=NGL)


@pytest.fixture(scope="module")
def prompt(model):
    toks = model.tokenize(TEXT)
    return toks[:-1], toks[-1]  # the cache, and the token whose logits are compared


def cached(model, tokens, fa: bool) -> Context:
    ctx = Context(model, n_ctx=256, flash_attn=fa)
    ctx.decode(tokens, logits="none")
    return ctx


def n_layers(model) -> int:
    return len(model.arch.full_layers)


@FA
def test_unused_bias_is_bit_identical(model, prompt, fa):
    """A bias set and then zeroed is gone: no cell is marked, the state carries none and the graphs leave it
    out again. A state loaded with all-zero biases marks its cells (they are not looked at) and the graphs
    add them: the logits are the same bits as those of a cache that never had one, either way."""
    cache, last = prompt
    n, hkv = len(cache), model.n_head_kv
    plain = cached(model, cache, fa)
    zeroed, loaded = cached(model, cache, fa), cached(model, cache, fa)
    for il in range(n_layers(model)):
        zeroed.set_bias(il, np.ones((hkv, n), np.float32))
        assert zeroed.bias_cells() == (il + 1) * n
    for il in range(n_layers(model)):
        zeroed.set_bias(il, np.zeros((hkv, n), np.float32))
    assert zeroed.bias_cells() == 0 and read_seq(zeroed).bias is None and read_seq(plain).bias is None
    kv = read_seq(loaded).copy()
    kv.bias = [np.zeros((n, hkv), np.float32) for _ in range(n_layers(model))]
    write_seq(loaded, kv)
    assert loaded.bias_cells() == n_layers(model) * n and read_seq(loaded).bias is not None  # in the graphs
    a, b, c = (ctx.decode([last], [n]) for ctx in (plain, zeroed, loaded))
    assert np.array_equal(a, b) and np.array_equal(a, c)


def test_only_cells_with_a_bias_are_marked(model, prompt):
    """Patch 0007: a cell is marked in a layer while some head's bias there is not zero; a removal clears
    the freed cells' biases at once (so new tokens land on clean cells and decoding writes nothing), and
    setting zeros unmarks them. Two cells of two layers, checked through llama_memory_bias_cells."""
    cache, _ = prompt
    n, hkv = len(cache), model.n_head_kv
    ctx = cached(model, cache, False)
    assert ctx.bias_cells() == 0
    b2 = np.zeros((hkv, n), np.float32)
    b2[0, [3, 4, 9]] = 0.5  # one head is enough to mark a cell
    b2[1, 9] = -np.inf
    b0 = np.zeros((hkv, n), np.float32)
    b0[:, [1, 2]] = np.log(2.0)
    ctx.set_bias(2, b2)
    ctx.set_bias(0, b0)
    assert ctx.bias_cells() == 3 + 2
    ctx.remove(4, 6)  # positions 4 and 5: one marked cell of layer 2 is freed and cleared
    assert ctx.bias_cells() == 4
    _, pos = ctx.cells()
    np.testing.assert_array_equal(ctx.bias(2), b2[:, pos])
    for _ in range(3):  # new tokens: on the freed (now clean) cells and beyond, all at 0
        ctx.decode(model.tokenize(" on", add_special=False)[:1], [int(ctx.cells()[1].max()) + 1], logits="none")
    assert ctx.bias_cells() == 4 and np.all(ctx.bias(2)[:, ctx.cells()[1] >= n] == 0)
    ctx.set_bias(0, np.zeros((hkv, len(ctx.cells()[0])), np.float32))
    assert ctx.bias_cells() == 2
    ctx.remove(0, -1)
    assert ctx.bias_cells() == 0 and read_seq(ctx).bias is None


@FA
def test_minus_inf_bias_is_eviction(model, prompt, fa):
    cache, last = prompt
    n, hkv = len(cache), model.n_head_kv
    gone = np.arange(5, 10)
    masked = cached(model, cache, fa)
    for il in range(n_layers(model)):
        b = np.zeros((hkv, n), np.float32)
        b[:, gone] = -np.inf
        masked.set_bias(il, b)
    evicted = cached(model, cache, fa)
    write_seq(evicted, read_seq(evicted).select(np.setdiff1d(np.arange(n), gone)))
    full = cached(model, cache, fa)
    a, b, c = (ctx.decode([last], [n]) for ctx in (masked, evicted, full))
    assert np.abs(a - b).max() <= 1e-4
    assert np.abs(a - c).max() > 0.1  # negative control: the five cells matter


@FA
def test_identical_keys_merged_with_count(model, prompt, fa):
    """``c`` cells with the same K and V attend exactly like one cell with bias log c (c = 2, the merge of
    two identical adjacent keys, and c = 4, where the control is clearer under flash attention's F16
    rounding)."""
    cache, last = prompt
    n, hkv, nl, j = len(cache), model.n_head_kv, n_layers(model), 7
    for c in (2, 4):
        dup = cached(model, cache, fa)
        dup_kv = read_seq(dup).select(np.concatenate([np.arange(j + 1), [j] * (c - 1), np.arange(j + 1, n)]))
        dup_kv.pos = np.arange(n + c - 1, dtype=np.int32)
        write_seq(dup, dup_kv)

        def merged(count: float) -> np.ndarray:
            ctx = cached(model, cache, fa)
            one = read_seq(ctx).copy()
            one.pos = np.concatenate([np.arange(j + 1), np.arange(j + c, n + c - 1)]).astype(np.int32)  # same next position
            one.bias = [np.zeros((n, hkv), np.float32) for _ in range(nl)]
            for b in one.bias:
                b[j] = np.log(count)
            write_seq(ctx, one)
            return ctx.decode([last], [n + c - 1])

        want = dup.decode([last], [n + c - 1])
        got, uncounted = merged(c), merged(1.0)
        if fa:  # CPU flash attention accumulates V in F16: equal within its own rounding (FA on vs off: KL ~2e-3)
            assert kl(want, got) < 0.01, c
        else:
            assert np.abs(want - got).max() <= 1e-4, c
        if c == 4:  # negative control: without the count the cell weighs a quarter
            assert kl(want, uncounted) > 5 * max(kl(want, got), 1e-4)


def test_bias_moves_with_its_cell(model, prompt):
    """Set and read back through the API and the state; a removed position takes its bias along, and a
    token decoded into a freed cell starts at 0."""
    cache, _ = prompt
    n, hkv = len(cache), model.n_head_kv
    ctx = cached(model, cache, False)
    rng = np.random.default_rng(0)
    bias = rng.normal(size=(hkv, n)).astype(np.float32)
    bias[1, 3] = -np.inf
    ctx.set_bias(2, bias)
    np.testing.assert_array_equal(ctx.bias(2), bias)
    np.testing.assert_array_equal(ctx.bias(0), 0)
    np.testing.assert_array_equal(read_seq(ctx).bias[2], bias.T)  # the state carries it

    ctx.remove(4, 6)  # positions 4, 5 leave; their cells are free
    _, pos = ctx.cells()
    np.testing.assert_array_equal(ctx.bias(2), bias[:, pos])
    ctx.decode(model.tokenize(" again", add_special=False)[:1], [n], logits="none")
    cells, pos = ctx.cells()
    assert cells[pos == n][0] == 4  # the new token took a freed cell ...
    assert np.all(ctx.bias(2)[:, pos == n] == 0)  # ... and not its bias

    kv = read_seq(ctx).copy()  # write the state back: the bias comes back with it
    write_seq(ctx, kv)
    np.testing.assert_array_equal(read_seq(ctx).bias[2], kv.bias[2])


def test_bias_bad_input(model, prompt):
    ctx = cached(model, prompt[0], False)
    with pytest.raises(ValueError, match="refused layer 0"):
        ctx.set_bias(0, np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="no KV layer 99"):
        ctx.bias(99)
    kv = read_seq(ctx).copy()
    kv.bias = [np.full((kv.n, model.n_head_kv), np.nan, np.float32)] * n_layers(model)
    with pytest.raises(ValueError, match="not NaN"):
        write_seq(ctx, kv)


STOCK_SCRIPT = r"""
import sys, numpy as np
from kvlocal.runtime import Context, Model
from kvlocal.runtime.library import runtime_info
assert not runtime_info().patched, runtime_info().describe()
model = Model(sys.argv[1])
cache, last = [int(t) for t in sys.argv[3].split(",")], int(sys.argv[4])
out = {}
for fa in (False, True):
    ctx = Context(model, n_ctx=256, flash_attn=fa)
    ctx.decode(cache, logits="none")
    out[f"fa{int(fa)}"] = ctx.decode([last], [len(cache)])
np.savez(sys.argv[2], **out)
"""


@pytest.mark.skipif(NGL != 0, reason="the unpatched runtime is the CPU build")
def test_patched_runtime_matches_stock_bit_for_bit(smollm2, model, prompt, stock_runtime, tmp_path):
    """Without a bias the patched llama.cpp computes exactly what the unpatched one does (FA off and on):
    the same prompt through ``ggml_patches/build.py --stock`` in a subprocess gives the same logits bits."""
    import subprocess
    import sys

    cache, last = prompt
    out = tmp_path / "stock.npz"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stock_runtime), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", STOCK_SCRIPT, str(smollm2), str(out), ",".join(map(str, cache)), str(last)],
                   check=True, env=env, timeout=600)
    stock = np.load(out)
    for fa in (False, True):
        ctx = cached(model, cache, fa)
        mine = ctx.decode([last], [len(cache)])
        assert np.array_equal(mine, stock[f"fa{int(fa)}"]), (fa, float(np.abs(mine - stock[f"fa{int(fa)}"]).max()))


def test_bench_stock_compares_ordinary_inference_with_the_stock_runtime(smollm2, stock_runtime, capsys):
    """tools/bench_stock: `kvlocal run --method full` on both runtimes in alternation. SmolLM2's attn_output
    is Q4_1, which the CPU does not repack, so patch 0008 changes nothing there: the same greedy text."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tools import bench_stock

    bench_stock.main([str(smollm2), "--stock", str(stock_runtime), "--rounds", "1", "--tokens", "200", "--decode", "8"])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith(smollm2.name[:44])]
    assert len(row) == 1 and row[0].split()[1] == "Q4_1" and row[0].split()[-1] == "True", row
    assert all(float(x) > 0 for x in row[0].split()[2:8]), row
