"""The "state" KV backend (kvlocal.runtime.state) on the real llama.cpp and SmolLM2-135M.

Contexts are a few hundred cells at most (the suite shares two CPU cores). A decode is deterministic for
a given cache, thread count and cell order, so logits are compared bit for bit wherever the cell order
is the same; where it cannot be (eviction by llama_memory_seq_rm leaves holes that the next token
fills) the comparison is by KL divergence and top-1 agreement, next to an exact comparison of the rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvlocal.errors import UsageError
from kvlocal.runtime import Context
from kvlocal.runtime.seqstate import (GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32, SeqKV, blob_rows, build_blob,
                                      parse_blob)
from kvlocal.runtime.state import get_blob, read_seq, write_seq

GGML_TYPE_Q8_0 = 8
N = 100  # prompt tokens in most tests


# Public-domain prose (Dickens, A Tale of Two Cities; Melville, Moby-Dick): more than N + 10 tokens.
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way. Call me Ishmael. Some years ago, never mind how long precisely, having little or "
    "no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a "
    "little and see the watery part of the world. It is a way I have of driving off the spleen and "
    "regulating the circulation."
)


@pytest.fixture(scope="module")
def tokens(smollm2_model):
    toks = smollm2_model.tokenize(TEXT)
    assert len(toks) > N + 10
    return toks[: N + 10]


def make_ctx(model, toks, n=N, n_ctx=128, **kw) -> Context:
    ctx = Context(model, n_ctx=n_ctx, **kw)
    ctx.decode(toks[:n], logits="none")
    return ctx


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean KL(p ‖ q) over rows of logits [T, V] (or one row [V]), in nats."""
    p = np.atleast_2d(p_logits).astype(np.float64)
    q = np.atleast_2d(q_logits).astype(np.float64)
    lp = p - np.logaddexp.reduce(p, axis=-1, keepdims=True)
    lq = q - np.logaddexp.reduce(q, axis=-1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def same_rows(a: SeqKV, b: SeqKV) -> bool:
    return (
        np.array_equal(a.pos, b.pos)
        and all(np.array_equal(x, y) for x, y in zip(a.k, b.k, strict=True))
        and all(np.array_equal(x, y) for x, y in zip(a.v, b.v, strict=True))
    )


def rearrange(full: SeqKV, subsets: np.ndarray) -> SeqKV:
    """Cell j holds, for KV head h, the row of the cell with position subsets[h, j] (full has pos == cell)."""
    n_head_kv = subsets.shape[0]
    heads = np.arange(n_head_kv)[:, None]
    k = [np.ascontiguousarray(a[subsets, heads].transpose(1, 0, 2)) for a in full.k]  # [H, m, d] → [m, H, d]
    v = [np.ascontiguousarray(a[subsets, heads].transpose(1, 0, 2)) for a in full.v]
    # one position per cell; the per-head sets are sorted, so the column maxima are strictly increasing
    pos = subsets.max(0).astype(np.int32)
    return SeqKV(pos=pos, k=k, v=v, v_trans=full.v_trans, k_type=full.k_type, v_type=full.v_type)


# -- (1) round trip --------------------------------------------------------------------------------


def test_read_layout_and_round_trip_is_bit_exact(smollm2_model, tokens):
    m = smollm2_model
    ctx = make_ctx(m, tokens)
    kv = read_seq(ctx)
    head_dim = m.n_embd // m.n_head
    assert kv.n == N and kv.n_layer == m.n_layer
    np.testing.assert_array_equal(kv.pos, np.arange(N))
    assert kv.v_trans and kv.k_type == kv.v_type == GGML_TYPE_F16
    for a in kv.k + kv.v:
        assert a.shape == (N, m.n_head_kv, head_dim) and a.dtype == np.float16 and np.isfinite(a).all()

    before = ctx.decode([tokens[N]])
    ctx.remove(N)
    write_seq(ctx, kv)
    cells, pos = ctx.cells()
    np.testing.assert_array_equal(cells, np.arange(N))  # written cells land in 0..n-1, in blob order
    np.testing.assert_array_equal(pos, kv.pos)
    after = ctx.decode([tokens[N]])
    np.testing.assert_array_equal(after, before)

    ctx.remove(N)
    assert same_rows(read_seq(ctx), kv)


def test_blob_build_is_the_inverse_of_parse(smollm2_model, tokens):
    ctx = make_ctx(smollm2_model, tokens, n=20, n_ctx=64)
    blob = get_blob(ctx)
    kv = parse_blob(blob, smollm2_model.n_layer, smollm2_model.n_head_kv)
    np.testing.assert_array_equal(build_blob(kv), blob)


def test_write_seq_builds_the_blob_in_the_buffer_it_is_given(smollm2_model, tokens):
    # the state backend hands write_seq a buffer kept between events: the blob is built there (a prefix of it, the
    # rest stale), and the cells are those a blob of its own gives
    m = smollm2_model
    ctx, twin = make_ctx(m, tokens, n=40, n_ctx=64), make_ctx(m, tokens, n=40, n_ctx=64)
    buf = np.full(4 * get_blob(ctx).size, 0xAB, np.uint8)
    asked = []

    def alloc(nbytes):
        asked.append(nbytes)
        return buf[:nbytes]

    for lo in (10, 20):  # twice: the second blob is built over the first
        kv, kv_twin = read_seq(ctx), read_seq(twin)
        write_seq(ctx, kv.select(kv.pos >= lo), alloc=alloc)
        write_seq(twin, kv_twin.select(kv_twin.pos >= lo))
        np.testing.assert_array_equal(buf[:asked[-1]], build_blob(kv.select(kv.pos >= lo)))
    assert len(asked) == 2 and asked[1] < asked[0] and (buf[asked[0]:] == 0xAB).all()
    assert same_rows(read_seq(ctx), read_seq(twin))


@pytest.mark.parametrize("cache", [dict(flash_attn=True), dict(flash_attn=False),
                                   dict(flash_attn=True, type_k=GGML_TYPE_Q8_0, type_v=GGML_TYPE_Q8_0),
                                   dict(flash_attn=True, type_k=GGML_TYPE_BF16, type_v=GGML_TYPE_BF16)],
                         ids=["f16", "f16-transposed-v", "q8_0", "bf16"])
def test_rows_written_into_blob_rows_are_the_blobs_rows(smollm2_model, tokens, cache):
    # the state backend gathers an event's rows straight into the blob's K and V sections (blob_rows): building the
    # blob over them then leaves them where they are, and it is the blob of the same cells given as copies; where
    # the stored bytes are not the arrays' own (a transposed V, BF16) there is no such place
    m = smollm2_model
    kv = read_seq(make_ctx(m, tokens, n=40, n_ctx=64, **cache))
    sub = kv.select(kv.pos % 3 != 1)
    rng = np.random.default_rng(3)
    sub.bias = [rng.normal(size=(sub.n, m.n_head_kv)).astype(np.float32) for _ in range(sub.n_layer)]
    buf = np.full(4 * kv.blob.size, 0xAB, np.uint8)
    asked = []

    def alloc(nbytes):
        asked.append(nbytes)
        return buf[:nbytes]

    rows = blob_rows(kv, sub.n, alloc)
    bf16 = kv.k_type == GGML_TYPE_BF16
    assert [r is None for r in rows] == [bf16, bf16 or kv.v_trans]
    ref = build_blob(sub)
    for placed, given in zip(rows, (sub.k, sub.v)):
        for a, b in zip(placed or [], given):
            assert a.dtype == b.dtype and a.shape == b.shape
            a[:] = b
            at = a.ctypes.data - buf.ctypes.data  # where the rows lie is where the blob has them
            np.testing.assert_array_equal(buf[at:at + a.nbytes], ref[at:at + a.nbytes])
    blob = build_blob(dataclasses.replace(sub, k=rows[0] or sub.k, v=rows[1] or sub.v), alloc=alloc)
    assert blob.ctypes.data == buf.ctypes.data and asked[1] <= asked[0]  # the first ask covers the bias section
    np.testing.assert_array_equal(blob, ref)
    assert blob_rows(kv, 0, alloc) == (None, None)


# -- (2) eviction = llama_memory_seq_rm -----------------------------------------------------------


def test_evicting_a_subset_equals_seq_rm(smollm2_model, tokens):
    """Keep positions 0-3 and the last 40: write_seq of that subset against llama_memory_seq_rm of the rest.

    The two caches hold the same rows (checked exactly) but not in the same cell order: seq_rm leaves a
    hole at cells 4..59 that the next tokens fill, so in the twin they sit between positions 3 and 60,
    while write_seq packs the 44 kept cells into cells 0..43 and the next tokens follow them. Attention
    sums over cells in cell order, and on this Q4 model (activations re-quantized to 8 bits in every
    matmul) a last-bit difference can grow to a few tenths of a logit. So logits are compared by KL and
    top-1, against the size of the effect of eviction itself.
    """
    m = smollm2_model
    a, b = make_ctx(m, tokens), make_ctx(m, tokens)
    full = a.decode(tokens[N : N + 5], logits="all")
    a.remove(N)
    kv = read_seq(a)
    keep = (kv.pos < 4) | (kv.pos >= N - 40)
    write_seq(a, kv.select(keep))
    b.remove(4, N - 40)

    assert same_rows(read_seq(a), read_seq(b))  # same positions, same K/V rows, same (position) order
    la = a.decode(tokens[N : N + 5], logits="all")
    lb = b.decode(tokens[N : N + 5], logits="all")
    assert (la.argmax(-1) == lb.argmax(-1)).all()
    assert kl(lb, la) < 0.01
    assert kl(full, la) > 10 * kl(lb, la)  # the eviction itself moves the logits much more than cell order


def test_evicting_the_tail_is_bit_exact(smollm2_model, tokens):
    """With the kept cells in the same cell order in both contexts, eviction by write_seq is bit-exact."""
    m = smollm2_model
    a, b = make_ctx(m, tokens), make_ctx(m, tokens)
    kv = read_seq(a)
    write_seq(a, kv.select(kv.pos < 60))
    b.remove(60)
    la = a.decode(tokens[60:64], positions=range(60, 64), logits="all")
    lb = b.decode(tokens[60:64], positions=range(60, 64), logits="all")
    np.testing.assert_array_equal(la, lb)


# -- (3) per-KV-head rearrangement ---------------------------------------------------------------


def head_subsets(n_head_kv: int, n: int, keep: int, seed: int = 0) -> np.ndarray:
    """Per head a different sorted subset of range(n) of `keep` positions: 0-3, the last one, and a random rest."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_head_kv):
        mid = np.sort(rng.choice(np.arange(4, n - 1), keep - 5, replace=False))
        out.append(np.concatenate([[0, 1, 2, 3], mid, [n - 1]]))
    out = np.stack(out)
    assert len({tuple(s) for s in out}) == n_head_kv  # every head keeps its own set
    return out


def test_per_head_rows_read_back_and_are_used(smollm2_model, tokens):
    m = smollm2_model
    ctx = make_ctx(m, tokens)
    full = read_seq(ctx)
    subsets = head_subsets(m.n_head_kv, N, 50)
    kv = rearrange(full, subsets)
    write_seq(ctx, kv)
    back = read_seq(ctx)
    assert same_rows(back, kv)  # exactly the rows written, each head its own
    base = ctx.decode([tokens[N]])
    ctx.remove(N)

    write_seq(ctx, back.copy())  # identical content: identical logits
    np.testing.assert_array_equal(ctx.decode([tokens[N]]), base)
    ctx.remove(N)

    swapped = kv.copy()  # heads 0 and 1 exchange their rows in layer 0 only: the logits must move
    swapped.k[0][:, [0, 1]] = kv.k[0][:, [1, 0]]
    swapped.v[0][:, [0, 1]] = kv.v[0][:, [1, 0]]
    write_seq(ctx, swapped)
    assert np.abs(ctx.decode([tokens[N]]) - base).max() > 1e-3


def test_per_head_rearrangement_matches_the_reference_model(smollm2_ref, smollm2_model, tokens):
    """llama.cpp over a per-head rearranged cache against the PyTorch reference over the same rows.

    The reference runs the new token in float32 from dequantized weights over an explicit cache built
    from llama.cpp's own K/V rows, each head with its own kept positions. It differs from llama.cpp by
    the weight/activation quantization (KL ~1e-3 on the full cache); wrong per-head semantics (rows of
    another head's set, or one set for all heads) cost ~0.1. Needs torch (the ``test`` extra, which CI installs):
    ``smollm2_ref`` skips it locally without torch and fails it under CI.
    """
    import torch

    from kvlocal.reference import KVCache

    m = smollm2_model
    ctx = make_ctx(m, tokens)
    full = read_seq(ctx)
    ref = smollm2_ref
    head_dim = full.k[0].shape[-1]

    def ref_logits(subsets: np.ndarray) -> np.ndarray:
        cache = KVCache(m.n_layer, m.n_head_kv, head_dim)
        heads = np.arange(m.n_head_kv)[:, None]
        for il in range(m.n_layer):
            layer = cache[il]
            layer.k = torch.from_numpy(full.k[il][subsets, heads].astype(np.float32))  # [H, S, d]
            layer.v = torch.from_numpy(full.v[il][subsets, heads].astype(np.float32))
            layer.pos = torch.as_tensor(subsets, dtype=torch.int64)
            layer.count = torch.ones_like(layer.pos)
            layer.bias = torch.zeros(layer.pos.shape, dtype=torch.float32)
        return ref(torch.tensor([tokens[N]]), torch.tensor([N]), cache)[0].numpy()

    everything = np.tile(np.arange(N), (m.n_head_kv, 1))
    baseline = kl(ctx.decode([tokens[N]]), ref_logits(everything))
    ctx.remove(N)

    subsets = head_subsets(m.n_head_kv, N, 50)
    write_seq(ctx, rearrange(full, subsets))
    ll = ctx.decode([tokens[N]])
    err = kl(ll, ref_logits(subsets))
    wrong_heads = kl(ll, ref_logits(np.roll(subsets, 1, axis=0)))
    one_set = kl(ll, ref_logits(np.tile(subsets[0], (m.n_head_kv, 1))))
    assert baseline < 0.01
    assert err < max(0.01, 3 * baseline)
    assert wrong_heads > 10 * err and one_set > 10 * err


# -- (4) positions follow the cells -------------------------------------------------------------------


def test_positions_follow_cells_with_holes(smollm2_model, tokens):
    m = smollm2_model
    ctx = make_ctx(m, tokens)
    ctx.remove(10, 20)
    ctx.remove(50, 51)
    ctx.decode(tokens[N : N + 5], logits="none")  # fills the freed cells 10..14 first
    kv = read_seq(ctx)
    cells, pos = ctx.cells()
    np.testing.assert_array_equal(kv.pos, pos)
    assert not (np.diff(kv.pos) > 0).all()  # cell order, not position order
    assert sorted(kv.pos.tolist()) == [p for p in range(N + 5) if not (10 <= p < 20 or p == 50)]

    write_seq(ctx, kv)  # packed into cells 0..n-1, in the same order
    cells2, pos2 = ctx.cells()
    np.testing.assert_array_equal(cells2, np.arange(kv.n))
    np.testing.assert_array_equal(pos2, pos)


def test_empty_sequence(smollm2_model, tokens):
    ctx = make_ctx(smollm2_model, tokens, n=10, n_ctx=64)
    full = read_seq(ctx)
    write_seq(ctx, full.select(np.zeros(full.n, bool)))
    assert ctx.pos_max() == -1
    kv = read_seq(ctx)
    assert kv.n == 0 and kv.k == [] and kv.v == []
    write_seq(ctx, kv)
    assert ctx.pos_max() == -1
    write_seq(ctx, full)  # and a read from before still loads
    assert same_rows(read_seq(ctx), full)


# -- (5) bad input ---------------------------------------------------------------------------------------


def test_bad_input_raises_value_error_and_leaves_the_cache(smollm2_model, tokens):
    m = smollm2_model
    ctx = make_ctx(m, tokens, n=30, n_ctx=64)
    kv = read_seq(ctx)

    def bad(match, **change):
        broken = kv.copy()
        for name, value in change.items():
            setattr(broken, name, value)
        with pytest.raises(ValueError, match=match):
            write_seq(ctx, broken)

    dup = kv.pos.copy()
    dup[5] = dup[6]
    bad("duplicate positions", pos=dup)
    neg = kv.pos.copy()
    neg[0] = -1
    bad("negative position", pos=neg)
    bad("pos must be one-dimensional", pos=kv.pos[None])
    bad("pos must hold integers", pos=kv.pos.astype(np.float32))
    bad(r"k\[3\] has shape", k=[a if i != 3 else a[:-1] for i, a in enumerate(kv.k)])
    bad(r"v\[0\] has shape", v=[a[:, :2] for a in kv.v])
    narrow = np.zeros((kv.n, m.n_head_kv, 32), np.float16)
    bad(r"k\[1\] has shape .*k\[0\] has", k=[a if i != 1 else narrow for i, a in enumerate(kv.k)])
    bad("one array per layer", k=kv.k[:-1])
    bad("must be floating point", k=[a.view(np.int16) for a in kv.k])
    bad("v_trans", v_trans=not kv.v_trans)
    bad("k_type", k_type=GGML_TYPE_F32)
    too_many = ctx.n_ctx + 1  # llama.cpp may round n_ctx up; ctx.n_ctx is what it allocated
    big = kv.select(np.arange(too_many) % kv.n)
    big.pos = np.arange(too_many, dtype=np.int32)
    with pytest.raises(ValueError, match=f"{too_many} cells do not fit in a context of {ctx.n_ctx}"):
        write_seq(ctx, big)
    with pytest.raises(ValueError, match="k\\[0\\] of a Q8_0 cache must hold raw rows \\(uint8\\), got float16"):
        write_seq(ctx, SeqKV(pos=kv.pos, k=kv.k, v=kv.v, v_trans=kv.v_trans, k_type=GGML_TYPE_Q8_0, v_type=kv.v_type))
    with pytest.raises(UsageError, match="IQ4_NL KV cache is not supported"):
        write_seq(ctx, SeqKV(pos=kv.pos, k=kv.k, v=kv.v, v_trans=kv.v_trans, k_type=20, v_type=kv.v_type))

    assert same_rows(read_seq(ctx), kv)  # nothing above touched the cache


def test_float32_arrays_are_written_as_f16(smollm2_model, tokens):
    ctx = make_ctx(smollm2_model, tokens, n=20, n_ctx=64)
    kv = read_seq(ctx)
    wide = kv.copy()
    wide.k = [a.astype(np.float32) for a in kv.k]
    wide.v = [a.astype(np.float64) for a in kv.v]
    write_seq(ctx, wide)
    assert same_rows(read_seq(ctx), kv)


# -- (6) flash attention: V not transposed --------------------------------------------------------------


def test_flash_attention_round_trip_and_same_rows(smollm2_model, tokens):
    m = smollm2_model
    ctx = make_ctx(m, tokens, flash_attn=True)
    kv = read_seq(ctx)
    assert not kv.v_trans
    before = ctx.decode([tokens[N]])
    ctx.remove(N)
    write_seq(ctx, kv)
    np.testing.assert_array_equal(ctx.decode([tokens[N]]), before)

    # layer 0 sees the same input with and without flash attention: its K and V rows must be equal,
    # which checks that the transposed V of the default context is un-transposed correctly
    plain = read_seq(make_ctx(m, tokens))
    assert plain.v_trans
    np.testing.assert_array_equal(plain.k[0], kv.k[0])
    np.testing.assert_array_equal(plain.v[0], kv.v[0])

    subsets = head_subsets(m.n_head_kv, N, 40, seed=1)  # per-head rows in the non-transposed layout too
    re = rearrange(read_seq(ctx), subsets[:, :40])
    write_seq(ctx, re)
    assert same_rows(read_seq(ctx), re)


@pytest.mark.parametrize("flash_attn", [False, True])
def test_f32_and_bf16_caches_round_trip(smollm2_model, tokens, flash_attn):
    for t in (GGML_TYPE_F32, GGML_TYPE_BF16):
        ctx = make_ctx(smollm2_model, tokens, n=40, n_ctx=64, type_k=t, type_v=t, flash_attn=flash_attn)
        kv = read_seq(ctx)
        assert kv.k_type == kv.v_type == t and kv.k[0].dtype == np.float32 and kv.v_trans == (not flash_attn)
        if t == GGML_TYPE_BF16:  # widened exactly: the low 16 bits are zero
            assert not (kv.k[5].view(np.uint32) & 0xFFFF).any()
        before = ctx.decode([tokens[40]])
        ctx.remove(40)
        write_seq(ctx, kv)
        np.testing.assert_array_equal(ctx.decode([tokens[40]]), before)


def test_bf16_rounding_is_nearest_even():
    from kvlocal.runtime.seqstate import _put_rows

    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, -2.5, 3.0e38, np.inf, -np.inf], np.float32)
    out = np.empty(x.size * 2, np.uint8)
    _put_rows(out, x[:, None], GGML_TYPE_BF16)
    back = (out.view("<u2").astype(np.uint32) << 16).view(np.float32)
    # 1+2^-8 is a tie between 1 and 1+2^-7: even mantissa → 1; 1+3·2^-8 ties up to 1+2^-6
    np.testing.assert_array_equal(back[[0, 1, 2, 3, 4, 6, 7]], [1.0, 1.0, 1.0 + 2**-6, 1.0, -2.5, np.inf, -np.inf])
    assert abs(back[5] - 3.0e38) / 3.0e38 < 2**-8
    _put_rows(out[:2], np.array([[np.nan]], np.float32), GGML_TYPE_BF16)
    assert np.isnan((out[:2].view("<u2").astype(np.uint32) << 16).view(np.float32)[0])


# -- (7) quantized cache ------------------------------------------------------------------------------------


@pytest.mark.parametrize("types", [(GGML_TYPE_Q8_0, GGML_TYPE_Q8_0), (GGML_TYPE_Q8_0, None), (2, 2)],
                         ids=["kv-q8_0", "k-q8_0", "kv-q4_0"])
def test_quantized_caches_round_trip_and_evict_as_raw_bytes(smollm2_model, tokens, types):
    """Quantized rows are read as raw bytes per head and written back untouched: a round trip gives the
    same next logits bit for bit, and per-head rearranged rows come back as written."""
    type_k, type_v = types
    m = smollm2_model
    ctx = make_ctx(m, tokens, n=40, n_ctx=64, type_k=type_k, type_v=type_v, flash_attn=type_v is not None)
    kv = read_seq(ctx)
    assert kv.k_type == type_k and kv.k[0].dtype == np.uint8
    head_dim = m.arch.head_dim_k
    block = {GGML_TYPE_Q8_0: 34, 2: 18}[type_k]
    assert kv.k[0].shape == (40, m.n_head_kv, head_dim // 32 * block)
    before = ctx.decode([tokens[40]])
    ctx.remove(40)
    write_seq(ctx, kv)
    np.testing.assert_array_equal(ctx.decode([tokens[40]]), before)

    subsets = head_subsets(m.n_head_kv, 41, 30, seed=2)
    re = rearrange(read_seq(ctx), subsets)
    write_seq(ctx, re)
    assert same_rows(read_seq(ctx), re)


def test_quantized_keys_decode_to_the_f16_cache_keys_after_rotation(smollm2_model, tokens):
    """What kvlocal.runtime.kvquant claims about llama.cpp's storage: a q8_0 K cache holds H·k (blockwise
    Walsh–Hadamard) and a q8_0 V cache H·v. Decoding the rows and rotating them back gives the F16 cache's
    rows to within q8_0's error; without the rotation they are unrelated."""
    from kvlocal.runtime.kvquant import CacheBasis, rotate

    m = smollm2_model
    f16 = read_seq(make_ctx(m, tokens, n=40, n_ctx=64, flash_attn=True))
    q8 = read_seq(make_ctx(m, tokens, n=40, n_ctx=64, type_k=GGML_TYPE_Q8_0, type_v=GGML_TYPE_Q8_0, flash_attn=True))
    basis = CacheBasis.for_cache(GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, m.arch.head_dim_k, m.arch.head_dim_v)
    assert basis.k_rot == 64 and basis.v_rot == 64
    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    # layer 0 sees the same input in both contexts: its rows agree to q8_0's error; later layers' inputs
    # carry the earlier layers' quantization error, so they agree less tightly
    for il, tol in ((0, 0.01), (len(f16.k) - 1, 0.1)):
        k_true, v_true = f16.k[il].astype(np.float32), f16.v[il].astype(np.float32)
        k_stored = basis.keys(q8.k[il])
        assert rel(rotate(k_stored, basis.k_rot), k_true) < tol
        assert rel(k_stored, k_true) > 0.5  # stored rotated, not as computed
        assert rel(basis.values(q8.v[il]), v_true) < tol
        assert rel(basis.v_codec.decode(q8.v[il]), v_true) > 0.5


def test_a_cache_type_kvlocal_cannot_rewrite_is_a_clear_error(smollm2_model, tokens):
    ctx = make_ctx(smollm2_model, tokens, n=20, n_ctx=64, type_k=20, type_v=20, flash_attn=True)  # IQ4_NL
    with pytest.raises(UsageError, match=r"compression with a IQ4_NL KV cache is not supported: use f16, q8_0"):
        read_seq(ctx)


def test_bench_state_times_a_read_and_the_plan_it_applies(smollm2_model, monkeypatch):
    # tools/bench_state (the state backend's round trip at an event, timed) reads the cells it was given, applies a
    # plan that leaves each head its kept rows, and loads the cells back before the next repeat
    import sys
    from pathlib import Path

    from kvlocal.backends import StateBackend

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tools import bench_state

    reads, applied = [], []
    real_read, real_apply = StateBackend.read, StateBackend.apply

    def read(self):
        r = real_read(self)
        reads.append((r.n, r.kv.in_place))
        return r

    def apply(self, r, plan):
        k = [a.copy() for a in r.kv.k]
        real_apply(self, r, plan)
        after = read_seq(self.ctx)
        for il, layer in enumerate(plan.keep):
            for h, cells in enumerate(layer):
                np.testing.assert_array_equal(after.k[il][:, h], k[il][cells, h])
        applied.append(after.n)

    monkeypatch.setattr(StateBackend, "read", read)
    monkeypatch.setattr(StateBackend, "apply", apply)
    for io in ("view", "blob"):  # in place, and through the state blob
        reads.clear(), applied.clear()
        t_read, t_apply = bench_state.run(smollm2_model, cells=90, keep=50, repeat=3, threads=2, io=io)
        assert reads == [(90, io == "view")] * 3 and applied == [50] * 3 and t_read > 0 and t_apply > 0
