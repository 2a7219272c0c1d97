"""Right on the models people run, never silently wrong: architectures, Gemma 3's sliding-window cache,
memory measured from llama.cpp's buffers, the state backend on an iSWA memory (the engine's guards — all-or-nothing
rewrites, a lost cache, validation, Ctrl-C — are in tests/engine/test_engine_guards.py).

Real llama.cpp on real GGUF files (SmolLM2-135M, Gemma 3 270M) and on small files written here with the
gguf package (the refused architectures)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_cli
from kvlocal.engine import Engine
from kvlocal.errors import UsageError
from kvlocal.runtime import Context, Model
from kvlocal.runtime.llama import kv_cache_bytes
from kvlocal.runtime.state import read_seq, write_seq
from kvlocal.eval.metrics import compare_logits
from kvlocal.eval.tasks import sample_text

THREADS = 2


@pytest.fixture(scope="module")
def prose():
    return sample_text()


@pytest.fixture(scope="module")
def gpl_text():
    from importlib import resources

    return resources.files("kvlocal").joinpath("data/gpl-3.0.txt").read_text(encoding="utf-8")


# -- architectures -----------------------------------------------------------------------------------

REFUSED = {  # architecture -> what kind of attention it has (for the record; the message names the arch)
    "mamba": "recurrent",
    "jamba": "hybrid",
    "deepseek2": "MLA",
    "bloom": "ALiBi",
    "qwen2vl": "M-RoPE",
}


def write_header_only(path, arch: str) -> None:
    """A complete GGUF file of architecture ``arch`` with a few hyperparameters and one tensor."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_unsupported_architecture_is_refused_at_load(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_header_only(path, arch)
    with pytest.raises(UsageError) as e:
        Model(path)
    msg = str(e.value)
    assert f"'{arch}'" in msg and "llama, qwen2, qwen3, gemma3" in msg
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Hello.")
    r = run_cli("run", str(path), "--prompt-file", str(prompt))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0] == f"kvlocal: error: {msg}"
    print(f"{arch:10} ({REFUSED[arch]}): {lines[0]}")


def test_gemma3_attention_description(gemma3_model):
    a = gemma3_model.arch
    assert (a.arch, a.n_layer, a.n_head, a.n_head_kv, a.head_dim_k, a.n_swa) == ("gemma3", 18, 4, 1, 256, 512)
    assert a.full_layers == (5, 11, 17)  # every 6th layer attends over the whole context
    assert a.head_dim_k != a.n_embd // a.n_head  # 256 vs 160: head sizes come from key_length
    assert a.attn_scale == pytest.approx(1 / 16)


# -- memory is measured ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["smollm2", "qwen", "gemma3"])
@pytest.mark.parametrize("n_ctx", [768, 1000, 4096])
def test_kv_bytes_are_measured(request, name, n_ctx):
    """Context.kv_bytes() reads llama.cpp's K/V buffer sizes (patch 0002); they match the formula kvlocal
    documents (full-attention cache of n_ctx padded cells, sliding cache of min(n_ctx, n_swa + n_ubatch)),
    and the sliding cache stays bounded while the full one grows."""
    model = request.getfixturevalue(f"{name}_model")
    ctx = Context(model, n_ctx=n_ctx, n_threads=1)
    measured = ctx.kv_bytes()
    assert measured is not None and measured[0] > 0
    assert measured == kv_cache_bytes(model, ctx.n_ctx, ctx.n_ubatch), (measured, ctx.n_ctx)
    if model.arch.has_swa:
        # 15 sliding layers × 1,024 cells × (1 KiB of K/V + 4 bytes of attention bias) at most
        assert 0 < measured[1] <= 15 * 1024 * (1024 + 4)
    else:
        assert measured[1] == 0
    print(f"{name} n_ctx {ctx.n_ctx}: measured {measured[0] / 2**20:.2f} + {measured[1] / 2**20:.2f} MiB = formula")


def test_batches_fit_the_sliding_window_cache(gemma3_model):
    """A sliding cache holds the window's last n_swa - 1 tokens plus a batch: the context limits its batches
    so that a chunk fits even when kvlocal has compressed the full-attention cache below the window."""
    for n_ctx, want in ((768, 768 - 512 + 1), (4096, 512), (256, 256)):
        ctx = Context(gemma3_model, n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=1)
        assert ctx.n_batch == want, (n_ctx, ctx.n_batch)


def test_quantized_kv_cache_bytes_are_measured(smollm2_model, prose):
    """``--method full`` with q8_0 K and V (llama.cpp needs flash attention for a quantized V: the engine
    turns it on): the measured buffers are q8_0-sized (34 bytes per 32 values) and the model still reads
    the text."""
    m = smollm2_model
    toks = m.tokenize(prose)[:200]
    f16 = Engine(m, 1.0, method="full", max_tokens=256, n_threads=THREADS)
    q8 = Engine(m, 1.0, method="full", max_tokens=256, n_threads=THREADS, type_k=8, type_v=8)
    bias = 256 * m.n_head_kv * 4 * m.n_layer  # the patched cache's F32 attention bias, the same for both
    assert q8.stats.kv_bytes_measured and (q8.stats.kv_bytes_allocated - bias) * 64 == (f16.stats.kv_bytes_allocated - bias) * 34
    a, b = f16.prefill(toks), q8.prefill(toks)
    assert np.argmax(a) == np.argmax(b)


# -- the state backend on an iSWA memory ------------------------------------------------------------


@pytest.mark.slow(5)
def test_gemma3_state_round_trip_is_exact(gemma3_model, prose):
    """Reading Gemma 3's cache (full-attention layers parsed, the sliding cache kept raw) and writing it
    back leaves llama.cpp computing exactly the same next-token logits."""
    m = gemma3_model
    toks = m.tokenize(prose)[:700]  # longer than the 512-token window: the sliding cache has dropped some
    ctx = Context(m, n_ctx=1536, n_threads=THREADS)
    ctx.decode(toks[:-1], range(len(toks) - 1), "none")
    kv = read_seq(ctx)
    assert kv.n == len(toks) - 1 and len(kv.k) == 3 and kv.k[0].shape[1:] == (1, 256)
    assert kv.tail is not None and kv.tail.size > 0
    cells, pos = ctx.cells()  # patch 0001: the full-attention cache's cells
    assert np.array_equal(np.sort(pos), np.arange(len(toks) - 1))
    ref = Context(m, n_ctx=1536, n_threads=THREADS)
    ref.decode(toks[:-1], range(len(toks) - 1), "none")
    want = ref.decode([toks[-1]], [len(toks) - 1])
    write_seq(ctx, kv.copy())
    got = ctx.decode([toks[-1]], [len(toks) - 1])
    np.testing.assert_array_equal(got, want)
    # the sliding cache really is in the tail: zeroing some of its V rows changes the answer
    shifted = kv.copy()
    shifted.tail[-4096:] = 0
    ctx.remove(len(toks) - 1)
    write_seq(ctx, shifted)
    assert np.abs(ctx.decode([toks[-1]], [len(toks) - 1]) - want).max() > 1e-3


def _forced_logits(eng: Engine, prompt, forced) -> np.ndarray:
    """Next-token logits over a forced continuation after the engine read the prompt: [T, V]."""
    eng.prefill(prompt)
    logits = eng.ctx.decode(forced[:-1], range(eng.n_past, eng.n_past + len(forced) - 1), "all")
    return np.concatenate([eng.logits[None], logits])


@pytest.mark.slow(31)
def test_gemma3_engine_compresses_the_full_attention_cache(gemma3_model, gpl_text):
    """The engine on Gemma 3: chunked prefill with compression events on the 3 full-attention layers,
    positions kept, both caches counted and measured; and the compressed cache predicts a forced
    continuation of the text closer to the full cache than StreamingLLM does at the same budget."""
    m = gemma3_model
    toks = m.tokenize(gpl_text)
    prompt, forced = toks[:1200], toks[1200:1232]
    cap = len(prompt) + len(forced)
    full = _forced_logits(Engine(m, 1.0, method="full", max_tokens=cap, n_threads=THREADS), prompt, forced)
    eng = Engine(m, 300, method="criticalkv", max_tokens=cap, n_threads=THREADS)
    crit = _forced_logits(eng, prompt, forced)
    s = eng.stats
    assert s.compression_events >= 1 and s.kv_bytes_measured
    assert eng.budget_cells == 300 and eng.ctx.n_ctx >= m.arch.n_swa + 128 + 32
    assert s.kv_bytes_allocated == sum(kv_cache_bytes(m, eng.ctx.n_ctx, eng.ctx.n_ubatch)) and s.kv_bytes_swa > 0
    assert eng.last_plan.n_layer == 3 and eng.layers == (5, 11, 17)
    assert len(eng.ctx.cells()[0]) == eng.ctx.pos_max() + 1 - len(prompt) + 300
    stream = _forced_logits(Engine(m, 300, method="streaming", max_tokens=cap, n_threads=THREADS), prompt, forced)

    def kl(logits):  # mean KL(full ‖ method)
        return compare_logits(full, logits)["mean_kl"]

    print(f"gemma3: {s.compression_events} events, n_ctx {eng.ctx.n_ctx}, KV {s.kv_bytes_allocated / 2**20:.1f} MiB "
          f"(sliding {s.kv_bytes_swa / 2**20:.1f}); mean KL vs full over {len(forced)} forced tokens: "
          f"criticalkv {kl(crit):.4f}, streaming {kl(stream):.4f}")
    assert kl(crit) < 0.2 and kl(crit) < kl(stream)
