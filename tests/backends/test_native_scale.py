"""The native backend at the sizes its users run: kvlocal's graphs of any size, on a scheduler of their own
(patches 0009, 0010, 0013), and rows that cross in one copy per tensor (patch 0011).

Before kvlocal's graphs had a scheduler of their own, the score, merge and compaction graphs ran on the context's,
whose hash set is sized for the decode's graph (1,024 slots on a small model, ~4K at Llama-3-8B's shape): a score
over many cells in value-norm chunks, or a merge of more than ~13 members, ended the process in
``ggml_backend_sched_alloc_graph``'s assert. Here such graphs run and give what the one-chunk graph and numpy give;
the decode's compute buffer and its graph reuse are left alone by an event; ``llama_kv_rows_get/set`` make the same
number of copies for 10 rows as for 500.
Then the whole path at Llama-3-8B's attention shape (d 4096, 32 query heads, 8 KV heads, head size 128; two layers
of a random-weight file from ``ggml_patches/random_gguf.py``): 16,384 cells scored, merged in groups of 40 and
compacted to a tenth, against numpy.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "reference"))  # tiny_gguf
sys.path.insert(0, str(Path(__file__).parents[2] / "ggml_patches"))  # random_gguf

import random_gguf  # noqa: E402
import tiny_gguf  # noqa: E402

from kvlocal.compress import numpy_kernels  # noqa: E402
from kvlocal.runtime import Context, Model  # noqa: E402
from kvlocal.runtime.seqstate import SeqKV  # noqa: E402
from kvlocal.runtime.state import read_seq, write_seq  # noqa: E402
from kvlocal.backends.weights import output_projections  # noqa: E402
from kvlocal.eval.tasks import sample_text  # noqa: E402

NGL = int(os.environ.get("KVLOCAL_TEST_NGL", "0"))
THREADS = 2


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Model:
    return Model(tiny_gguf.write_tiny(tmp_path_factory.mktemp("scale") / "llama.gguf", arch="llama"), n_gpu_layers=NGL)


def prose_context(model: Model, fa: bool = False, n: int = 300) -> Context:
    ctx = Context(model, n_ctx=512, n_batch=512, n_threads=THREADS, flash_attn=fa)
    tokens = model.tokenize(sample_text())[:n]
    ctx.decode(tokens, range(len(tokens)), "none")
    return ctx


def window(model: Model, n_layer: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n_layer, model.n_head, w, model.arch.head_dim_k)).astype(np.float32)


@pytest.fixture
def chunk_env(monkeypatch):
    """Set ``LLAMA_KVLOCAL_SCORE_CHUNK`` (cells per value-norm chunk; read by llama_kv_score at each call)."""
    return lambda n: monkeypatch.setenv("LLAMA_KVLOCAL_SCORE_CHUNK", str(n))


def test_a_score_of_many_chunks_fits(tiny_llama, chunk_env):
    """One-cell value-norm chunks over every cell: ~17 nodes a chunk, ~9K in all, nine times what the decode's
    scheduler holds for this model (the process aborted here when the graph ran on the decode's scheduler). The
    scores are those of one chunk."""
    ctx = prose_context(tiny_llama)
    n_layer = len(tiny_llama.arch.full_layers)
    q, cells = window(tiny_llama, n_layer, 8, 0), np.arange(len(ctx.cells()[0]))
    one = ctx.score(q, 0.125, vnorm_cells=cells)
    chunk_env(1)
    many = ctx.score(q, 0.125, vnorm_cells=cells)
    assert np.array_equal(one[0], many[0])
    np.testing.assert_allclose(many[1], one[1], rtol=1e-6)


def test_a_merge_of_many_members_fits(tiny_llama):
    """Merges of 48 members (the graph was sized for ~13): each merged row is the weighted sum of its members."""
    ctx = prose_context(tiny_llama)
    before = read_seq(ctx).copy()
    hkv, n_layer = tiny_llama.n_head_kv, len(tiny_llama.arch.full_layers)
    rng = np.random.default_rng(3)
    cells = np.stack([rng.permutation(before.n)[:96].reshape(2, 48) for _ in range(n_layer)]).reshape(-1, 48)
    heads = np.tile([0, hkv - 1], n_layer)
    wk = rng.dirichlet(np.ones(48), len(cells))
    ctx.merge(np.full(n_layer, 2), cells, heads, wk, wk)
    after = read_seq(ctx)
    for i, (c, h) in enumerate(zip(cells, heads)):
        l = i // 2
        for name in ("k", "v"):
            want = wk[i] @ getattr(before, name)[l][c, h].astype(np.float32)
            got = getattr(after, name)[l][c[-1], h].astype(np.float32)
            np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max() + 1e-6, err_msg=f"{name} merge {i}")


def test_an_event_leaves_the_decode_alone(tiny_llama):
    """kvlocal's graphs run on a scheduler of their own: the decode's compute buffer is the same after a score, a
    merge and a compaction, and a decode after a score reuses the graph of the decode before it."""
    ctx = prose_context(tiny_llama)
    n_layer, hkv = len(tiny_llama.arch.full_layers), tiny_llama.n_head_kv
    compute = ctx.counters()["compute_bytes"]
    reused = lambda: llama_cpp.llama_perf_context(ctx._ptr).n_reused  # noqa: E731
    ctx.decode([5], [300], "last")
    ctx.decode([6], [301], "last")
    r0 = reused()
    ctx.score(window(tiny_llama, n_layer, 8, 1), 0.125, vnorm_cells=np.arange(200))
    ctx.decode([7], [302], "last")
    assert reused() == r0 + 1, "the decode after a score built its graph again"
    n = len(ctx.cells()[0])
    ctx.merge(np.full(n_layer, 1), np.tile([[0, 1, 2, 3]], (n_layer, 1)), np.zeros(n_layer), np.ones((n_layer, 4)), np.ones((n_layer, 4)))
    ctx.compact(np.tile(np.arange(n - 100, dtype=np.int32), (n_layer, hkv, 1)), np.arange(n - 100))
    assert ctx.counters()["compute_bytes"] == compute
    assert np.isfinite(ctx.decode([8], [n - 100], "last")).all()


@pytest.mark.parametrize("fa", [False, True], ids=["v-transposed", "v-rows"])
def test_rows_cross_in_one_copy_per_tensor(tiny_llama, fa, monkeypatch):
    """``llama_kv_rows_get/set`` copy as many times for 10 scattered rows as for 500: a gather on the device and one
    copy per tensor (and per index). The per-run copies they replaced (``LLAMA_KVLOCAL_ROWS_RUNS``), counted by the
    same counter, grow with the rows; both read and write the same bytes."""
    ctx = prose_context(tiny_llama, fa)
    n, hkv, d = len(ctx.cells()[0]), tiny_llama.n_head_kv, tiny_llama.arch.head_dim_k
    row = 2 * d  # F16
    rng = np.random.default_rng(4)

    def copies(n_rows: int, runs: bool) -> tuple[int, np.ndarray, np.ndarray]:
        if runs:
            monkeypatch.setenv("LLAMA_KVLOCAL_ROWS_RUNS", "1")
        else:
            monkeypatch.delenv("LLAMA_KVLOCAL_ROWS_RUNS", raising=False)
        pick = np.random.default_rng(n_rows).choice(n * hkv, n_rows, replace=False)
        cells, heads = pick // hkv, pick % hkv
        t0 = ctx.counters()["transfers"]
        k, v = ctx.get_rows(1, cells, heads, row, row)
        ctx.set_rows(1, cells, heads, k, v)
        return ctx.counters()["transfers"] - t0, k, v

    few, k_few, _ = copies(10, runs=False)
    many, k_graph, v_graph = copies(500, runs=False)
    assert few == many <= 12
    runs, k_runs, v_runs = copies(500, runs=True)
    assert runs > 10 * many
    assert np.array_equal(k_graph, k_runs) and np.array_equal(v_graph, v_runs)
    assert np.array_equal(read_seq(ctx).k[1][0], read_seq(ctx).k[1][0])  # (a read after the writes succeeds)
    # a write of other rows lands where a read finds it
    k_new = rng.integers(0, 255, k_few.shape, dtype=np.uint8)
    k_new.view(np.float16)[np.isnan(k_new.view(np.float16))] = 0
    ctx.set_rows(1, [0, 3], [0, hkv - 1], k_new[:2], k_new[:2])
    k_back, v_back = ctx.get_rows(1, [0, 3], [0, hkv - 1], row, row)
    assert np.array_equal(k_back, k_new[:2]) and np.array_equal(v_back, k_new[:2])


# -- Llama-3-8B's attention shape -----------------------------------------------------------------------------------

N_CELLS = 16384


@pytest.fixture(scope="module")
def attn_8b(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("llama3") / "llama3-8b-attn.gguf"
    random_gguf.write(str(path), "llama3-8b-attn")
    return Model(path, n_gpu_layers=NGL)


@pytest.mark.slow(4)
def test_llama3_8b_shape_scores_merges_and_compacts_16k_cells(attn_8b):
    """16,384 cells of random F16 rows at Llama-3-8B's per-layer shape: window attention over all of them and value
    norms for 1,024 through the layer's 4096 x 4096 attn_output (against numpy), 64 merges of 40 members a layer, a
    compaction to 1,638 cells (the merged and moved rows against numpy). Prints each step's time."""
    m = attn_8b
    n_layer, hkv, hq, d = m.n_layer, m.n_head_kv, m.n_head, m.arch.head_dim_k
    assert (m.arch.n_embd, hq, hkv, d) == (4096, 32, 8, 128)
    ctx = Context(m, n_ctx=N_CELLS + 256, n_batch=64, n_threads=THREADS)
    ctx.decode([1, 2], [0, 1], "none")
    like = read_seq(ctx)
    rng = np.random.default_rng(0)
    rows = lambda: [rng.standard_normal((N_CELLS, hkv, d)).astype(np.float16) for _ in range(n_layer)]  # noqa: E731
    kv = SeqKV(pos=np.arange(N_CELLS, dtype=np.int32), k=rows(), v=rows(), v_trans=like.v_trans,
               k_type=like.k_type, v_type=like.v_type)
    write_seq(ctx, kv)
    times = {}

    q = window(m, n_layer, 8, 2)
    vn_cells = np.sort(rng.choice(N_CELLS, 1024, replace=False))
    t0 = time.perf_counter()
    attn, vnorm = ctx.score(q, d ** -0.5, vnorm_cells=vn_cells)
    times["score"] = time.perf_counter() - t0
    wo = output_projections(str(m.path))
    sample = np.arange(0, 1024, 97)
    for l in range(n_layer):
        keys = kv.k[l].astype(np.float32).transpose(1, 0, 2)  # [hkv, n, d]
        want = numpy_kernels.window_votes(q[l], np.full(8, 10**6), keys, kv.pos)
        np.testing.assert_allclose(attn[l], want, rtol=1e-3, atol=1e-9, err_msg=f"attention, layer {l}")
        values = kv.v[l].transpose(1, 0, 2)
        for h in range(hkv):
            want_vn = numpy_kernels.vnorm(values[h], wo[l], h * (hq // hkv), hq // hkv, vn_cells[sample])
            np.testing.assert_allclose(vnorm[l, h, sample], want_vn, rtol=1e-4, err_msg=f"value norms, layer {l}")

    groups = np.stack([rng.permutation(N_CELLS)[:64 * 40].reshape(64, 40) for _ in range(n_layer)]).reshape(-1, 40)
    heads = rng.integers(0, hkv, len(groups))
    w = np.full(groups.shape, 1 / 40)
    t0 = time.perf_counter()
    ctx.merge(np.full(n_layer, 64), groups, heads, w, w)
    times["merge"] = time.perf_counter() - t0

    keep = N_CELLS // 10
    src = np.stack([np.stack([np.sort(rng.choice(N_CELLS, keep, replace=False)) for _ in range(hkv)])
                    for _ in range(n_layer)]).astype(np.int32)
    for i, (c, h) in enumerate(zip(groups, heads)):  # keep every merged row, in its head's slot 0..63
        src[i // 64, h, i % 64] = c[-1]
    t0 = time.perf_counter()
    ctx.compact(src, np.arange(keep))
    times["compact"] = time.perf_counter() - t0
    after = read_seq(ctx)
    assert after.n == keep
    for l in range(n_layer):
        for h in range(hkv):
            merged = {c[-1]: c for c, hh, ll in zip(groups, heads, np.repeat(np.arange(n_layer), 64)) if ll == l and hh == h}
            for j in (0, 1, keep // 2, keep - 1):
                c = src[l, h, j]
                want = kv.k[l][merged[c], h].astype(np.float32).mean(axis=0) if c in merged else kv.k[l][c, h]
                np.testing.assert_allclose(after.k[l][j, h].astype(np.float32), want, atol=2e-3)
    print(f"\nLlama-3-8B attention shape, {N_CELLS:,} cells, {n_layer} layers, {THREADS} threads: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
