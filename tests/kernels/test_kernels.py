"""Native CPU kernels against numpy."""

import numpy as np
import pytest

from kvlocal import kernels


def np_pool(x, kernel, kind):
    half = kernel // 2
    out = np.empty_like(x)
    for j in range(x.shape[-1]):
        lo, hi = max(0, j - half), min(x.shape[-1], j + half + 1)
        out[..., j] = x[..., lo:hi].max(-1) if kind == "max" else x[..., lo:hi].sum(-1) / kernel
    return out


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 7])
@pytest.mark.parametrize("n", [1, 5, 300])
def test_pool1d_matches_numpy(kind, kernel, n):
    x = np.random.default_rng(n + kernel).standard_normal((4, n)).astype(np.float32)
    np.testing.assert_allclose(kernels.pool1d(x, kernel, kind), np_pool(x, kernel, kind), rtol=1e-6, atol=1e-6)


def test_pool1d_avg_matches_torch_convention():
    # zero padding counts: the end values are damped exactly like torch's avg_pool1d(count_include_pad=True)
    x = np.ones((1, 5), np.float32)
    np.testing.assert_allclose(kernels.pool1d(x, 3, "avg"), [[2 / 3, 1, 1, 1, 2 / 3]], rtol=1e-6)


def test_pool1d_rejects_even_kernel():
    with pytest.raises(ValueError):
        kernels.pool1d(np.zeros(4), 2)


@pytest.mark.parametrize("k", [0, 1, 17, 64])
def test_topk_matches_numpy(k):
    x = np.random.default_rng(k).standard_normal((6, 64)).astype(np.float32)
    got = kernels.topk(x, k)
    want = np.sort(np.argsort(-x, axis=-1, kind="stable")[:, :k], axis=-1)
    np.testing.assert_array_equal(got, want)


def test_topk_of_every_size_with_ties_infinities_and_nan():
    """Every k of a row with many ties, +-inf and NaN: the kernel selects the k best when k <= n/2 and drops
    the n-k worst otherwise; both must be numpy's stable ranking (NaN last, ties to the lower index)."""
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, (3, 41)).astype(np.float32)
    x[:, [2, 9]], x[:, [5, 30]], x[:, [11, 40]] = np.inf, -np.inf, np.nan
    # numpy's ranking: NaN after every number (-inf included), then larger first, then the lower index
    rank = np.stack([np.lexsort((np.arange(41), np.nan_to_num(-row, nan=0), np.isnan(row))) for row in x])
    for k in range(42):
        want = np.sort(rank[:, :k], axis=-1)
        np.testing.assert_array_equal(kernels.topk(x, k), want, err_msg=f"k={k}")


def test_topk_ties_prefer_lower_index_and_nan_last():
    x = np.array([[1.0, 2.0, 2.0, np.nan, 2.0, 0.5]], np.float32)
    np.testing.assert_array_equal(kernels.topk(x, 2), [[1, 2]])
    np.testing.assert_array_equal(kernels.topk(x, 5), [[0, 1, 2, 4, 5]])


def test_topk_keeps_shape_and_checks_k():
    x = np.random.default_rng(0).standard_normal((2, 3, 10)).astype(np.float32)
    assert kernels.topk(x, 4).shape == (2, 3, 4)
    with pytest.raises(ValueError):
        kernels.topk(x, 11)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_dequant_rows_is_ggmls_dequantization_bit_for_bit(name):
    """Random bytes as cache rows [cells, heads, row bytes] (every nibble and high-bit pattern, scales of
    every exponent, infinities and NaN among them): the same float32 bits as gguf-py's dequantizer."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[name]
    _, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (300, 3, 2 * size), dtype=np.uint8)
    got = kernels.dequant_rows(raw.transpose(1, 0, 2), int(qtype))  # a transposed view, as the scorers read it
    with np.errstate(invalid="ignore"):  # inf * 0 in the reference, where a random scale is infinite
        want = dequantize(np.ascontiguousarray(raw.transpose(1, 0, 2)), qtype)
    assert got.shape == want.shape == (3, 300, 64)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))
    with pytest.raises(ValueError, match="not blocks"):
        kernels.dequant_rows(raw[..., :-1], int(qtype))


def test_gather_rows_copies_rows_of_chunks_into_a_strided_destination():
    rng = np.random.default_rng(5)
    chunks = [rng.integers(0, 255, (4, 18), dtype=np.uint8) for _ in range(5)]  # 5 chunks of 4 rows (q4_0-sized)
    addr = np.array([c.ctypes.data for c in chunks], dtype=np.uintp)
    ids = np.array([19, 0, 7, 7, 12, 3])
    dst = np.zeros((len(ids), 3, 18), np.uint8)  # the rows go to head 1 of [m, Hkv, bytes]: 54 bytes apart
    kernels.gather_rows(addr, 4, ids, dst[:, 1])
    np.testing.assert_array_equal(dst[:, 1], np.concatenate(chunks)[ids])
    assert not dst[:, [0, 2]].any()  # nothing written outside the rows
    with pytest.raises(IndexError):
        kernels.gather_rows(addr, 4, np.array([20]), dst[:1, 0])


def test_page_boxes_are_each_pages_min_and_max_across_pieces():
    # rows join a store a piece at a time (a page begun by one piece is finished by the next): each page's box is
    # the element-wise min and max of all its keys, as numpy's reductions give it, NaN included; no page past the
    # rows' is touched
    rng = np.random.default_rng(11)
    page, d = 16, 5
    for _ in range(20):
        n = int(rng.integers(1, 200))
        keys = rng.standard_normal((n, d)).astype(np.float32)
        keys[rng.random((n, d)) < 0.002] = np.nan
        pages = -(-n // page)
        kmin = np.full((pages + 2, d), 7.0, np.float32)  # two spare pages: must stay as they were
        kmax = kmin.copy()
        cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 6))))
        for a, b in zip([0, *cuts], [*cuts, n]):
            kernels.page_boxes(keys[a:b], a, page, kmin, kmax)
        for p in range(pages):
            np.testing.assert_array_equal(kmin[p], keys[p * page:(p + 1) * page].min(axis=0))
            np.testing.assert_array_equal(kmax[p], keys[p * page:(p + 1) * page].max(axis=0))
        assert (kmin[pages:] == 7).all() and (kmax[pages:] == 7).all()
    with pytest.raises(ValueError):  # boxes that do not reach the rows' last page
        kernels.page_boxes(keys, 0, page, kmin[:1], kmax[:1])


def test_transpose16_moves_every_element_as_bits():
    # an F16 V cache stored transposed (no flash attention) is turned into cell rows and back at every event: the
    # kernel's 8 x 8 tiles and its edges, strided rows on both sides, and bit patterns numpy's float16 would not
    # compare equal (NaN payloads, -0) come out as numpy's transpose gives them; nothing outside out is written
    rng = np.random.default_rng(5)
    for rows, cols in [(1, 1), (7, 9), (8, 8), (16, 24), (192, 1400), (13, 64), (64, 3), (0, 5)]:
        src = rng.integers(0, 1 << 16, (rows, cols + 5), dtype=np.uint16)[:, 2:cols + 2]  # rows 5 elements apart
        np.testing.assert_array_equal(kernels.transpose16(src), src.T)
        wide = np.full((cols, rows + 3), 7, np.uint16)
        got = kernels.transpose16(src.view(np.float16), wide[:, 1:rows + 1].view(np.float16))
        assert got.dtype == np.float16
        np.testing.assert_array_equal(wide[:, 1:rows + 1], src.T)
        assert (wide[:, 0] == 7).all() and (wide[:, rows + 1:] == 7).all()
    with pytest.raises(ValueError):
        kernels.transpose16(np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError):
        kernels.transpose16(np.zeros((4, 4), np.uint16)[:, ::2])
    with pytest.raises(ValueError):
        kernels.transpose16(np.zeros((4, 6), np.uint16), np.zeros((4, 6), np.uint16))


def _kept_cells(rng, n_head, n, width, stay=0):
    """Per head ``width`` cells of ``n`` rising with the slots, the first ``stay`` left where they are."""
    rest = [np.sort(rng.choice(np.arange(stay, n), width - stay, replace=False)) for _ in range(n_head)]
    return np.stack([np.concatenate([np.arange(stay), r]) for r in rest]).astype(np.int32)


def test_compact_moves_kept_rows_forward_in_place_as_a_gather_would():
    # a prompt's event on a CPU cache: each head's kept cells moved to its first slots where they lie (the cache's
    # own memory; K, V as rows, a quantized cache's raw bytes), the same rows as a gather into other memory, the
    # cells past the slots and the other rows untouched; a transposed V moved as columns
    rng = np.random.default_rng(11)
    for dtype, shape, stay in [(np.float16, (140, 3, 64), 0), (np.float32, (40, 2, 8), 5), (np.uint8, (90, 4, 34), 30)]:
        size, hkv, row = shape
        n, width = size - 10, size // 2
        cells = (rng.integers(0, 255, shape) if dtype == np.uint8 else rng.standard_normal(shape)).astype(dtype)
        keep = _kept_cells(rng, hkv, n, width, stay)
        want = cells[keep.T, np.arange(hkv)]  # [width, Hkv, row]
        before = cells.copy()
        assert kernels.compact_rows(cells, keep)
        np.testing.assert_array_equal(cells[:width], want)
        np.testing.assert_array_equal(cells[width:], before[width:])
        vt = np.ascontiguousarray(before.transpose(1, 2, 0).reshape(hkv * row, size))  # [Hkv * d, cells]
        if dtype != np.uint8:
            assert kernels.compact_columns(vt, keep)
            np.testing.assert_array_equal(vt[:, :width], want.reshape(width, -1).T)
            np.testing.assert_array_equal(vt[:, width:], before.transpose(1, 2, 0).reshape(hkv * row, size)[:, width:])


def test_compact_refuses_moves_that_would_read_an_overwritten_row():
    # slots before their cell, cells that do not rise, an empty slot below a kept one, a cell past n: nothing moved
    rng = np.random.default_rng(12)
    cells = rng.standard_normal((30, 2, 4)).astype(np.float32)
    vt = np.ascontiguousarray(cells.transpose(1, 2, 0).reshape(8, 30))
    good = np.array([[0, 2, 5], [1, 3, 4]], np.int32)
    for bad in (np.array([[0, 2, 5], [1, 0, 4]]), np.array([[0, 5, 2], [1, 3, 4]]), np.array([[-1, 0, 5], [1, 3, 4]]),
                np.array([[0, 2, 30], [1, 3, 4]]), good[:, ::-1]):
        before, vt_before = cells.copy(), vt.copy()
        assert not kernels.compact_rows(cells, bad) and not kernels.compact_columns(vt, bad)
        np.testing.assert_array_equal(cells, before)
        np.testing.assert_array_equal(vt, vt_before)
    keep = np.array([[0, 2, 5], [-1, 3, 4]], np.int32)  # an empty slot after which nothing reads its cell: zeroed
    assert kernels.compact_rows(cells[:29], keep) and (cells[0, 1] == 0).all()


@pytest.mark.parametrize("level", kernels.SIMD_LEVELS)
def test_window_votes_of_f16_cells_are_those_of_their_float32_keys(level):
    # an F16 cache's keys are converted block by block as the votes read them (whole blocks transposed as bits
    # first, then converted; the last cells one row at a time): the exact float32 values, so the same votes to
    # the bit as float32 keys, at every instruction set the CPU has — whole blocks of 8, 16 and 32 cells and a
    # partial one, head dimensions off the 8 x 8 tiles, one query row (a recall step's) and many
    best = kernels.simd_level()
    if kernels.SIMD_LEVELS.index(level) > kernels.SIMD_LEVELS.index(best):
        pytest.skip(f"this CPU has no {level}")
    rng = np.random.default_rng(5)
    kernels.simd_level(level)
    try:
        for n, d, hkv, group, w in ((75, 64, 3, 3, 1), (64, 24, 2, 1, 5), (150, 40, 1, 7, 32), (7, 16, 2, 2, 3)):
            k = rng.standard_normal((n, hkv, d)).astype(np.float16)  # the cells as the cache holds them
            pos = rng.permutation(2 * n)[:n].astype(np.int64)
            pos[rng.random(n) < 0.1] = -1
            q = rng.standard_normal((hkv * group, w, d)).astype(np.float32)
            q_pos = np.sort(rng.integers(0, 2 * n + 2, size=w))
            halves = kernels.window_votes(q, q_pos, k.transpose(1, 0, 2), pos)
            floats = kernels.window_votes(q, q_pos, k.transpose(1, 0, 2).astype(np.float32), pos)
            assert np.array_equal(halves.view(np.uint32), floats.view(np.uint32)), (level, n, d)
    finally:
        kernels.simd_level(best)


def random_layer(rng, *, votes_given=False, half_values=False, half_keys=False):
    """A layer of random size (cells in shuffled order, empty rows, merged rows' bias, some norms known);
    ``half_values``/``half_keys``: its values/keys an F16 cache's cells ``[n, Hkv, d]``, seen as ``[Hkv, n, d]``."""
    from kvlocal.compress import LayerInputs

    hkv, group, d = int(rng.integers(1, 4)), int(rng.choice([1, 3, 7])), 16
    n, w = int(rng.choice([0, 1, 9, 150])), int(rng.integers(1, 12))
    pos = np.stack([rng.permutation(2 * n)[:n] for _ in range(hkv)]).astype(np.int64)
    pos[rng.random(pos.shape) < 0.2] = -1
    if rng.random() < 0.3:  # one position for every head: [n]
        pos = rng.permutation(2 * n)[:n].astype(np.int64)
    top = int(np.max(pos, initial=0))
    q_pos = np.sort(rng.integers(max(top - 20, 0), top + 3, size=w))
    k, v = (rng.standard_normal((hkv, n, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((hkv * group, w, d)).astype(np.float32)
    live = np.broadcast_to(pos, (hkv, n)) >= 0
    bias = np.where(live, np.log(rng.integers(1, 4, (hkv, n))), -np.inf).astype(np.float32) if rng.random() < 0.3 else None
    vnorm = np.abs(rng.standard_normal((hkv, n))).astype(np.float32)
    vnorm[rng.random(vnorm.shape) < (0.05 if votes_given else 0.6)] = np.nan
    if half_values:
        v = v.transpose(1, 0, 2).astype(np.float16).transpose(1, 0, 2)
    if half_keys:
        k = k.transpose(1, 0, 2).astype(np.float16).transpose(1, 0, 2)
    extra = dict(k=k, v=v)
    if votes_given:  # the native backend's inputs: votes from the device, K/V stay there
        extra = dict(k=None, v=None, votes=kernels.window_votes(q[:, -8:], q_pos[-8:], k, pos, bias))
        pos = np.broadcast_to(pos, (hkv, n)).copy()
    return LayerInputs(pos=pos, q=q, q_pos=q_pos, wo=rng.standard_normal((24, hkv * group * d)).astype(np.float32),
                       recent=None if rng.random() < 0.6 else int(rng.integers(0, 12)), bias=bias, vnorm=vnorm, **extra)


@pytest.mark.parametrize("inputs", ["host", "half values", "half keys and values", "votes given"])
def test_attention_keep_is_the_scorers_keep(inputs):
    # kvl_attention_keep (SnapKV's and CriticalKV's keep() in one call) against the numpy scorers it replaces:
    # the same kept cells (max pooling makes plateaus: ties go to the later position in both), the same
    # norms written back (and, where a few are computed, those of stage 1's and the window's rows, exact), the
    # same refusal where a norm is needed and the rows are not on the host; an F16 cache's values, converted
    # only where a norm is computed, give the norms of the values converted whole; its keys, converted as the
    # votes read them, the cells of the keys converted whole (the numpy steps get float32 keys)
    import copy

    from kvlocal.compress import CriticalKV, Scorer, SnapKV
    from kvlocal.compress.criticalkv import projected_value_norms

    votes_given = inputs == "votes given"
    rng = np.random.default_rng(11 + votes_given)
    refused = more = 0
    for case in range(150):
        layer = random_layer(rng, votes_given=votes_given, half_values=inputs.startswith("half"),
                             half_keys=inputs == "half keys and values")
        snap = SnapKV(window_size=8, kernel_size=int(rng.choice([1, 7])), pooling=str(rng.choice(["max", "avg"])))
        critical = CriticalKV(snap, first_stage_ratio=float(rng.choice([0.5, 0.3])), value_norm=("l1", "l2")[case % 2])
        for scorer in (snap, critical):
            budget = int(rng.integers(0, layer.n + 3))
            mine, theirs = copy.deepcopy(layer), copy.deepcopy(layer)
            if theirs.k is not None:
                theirs.k = theirs.k.astype(np.float32)
            try:
                want = Scorer.keep(scorer, theirs, budget)  # the numpy steps
            except ValueError as e:
                refused += 1
                with pytest.raises(ValueError, match="needs the norms"):
                    scorer.keep(mine, budget)
                assert "needs the norms" in str(e)
                continue
            got = scorer.keep(mine, budget)
            assert got.dtype == want.dtype and np.array_equal(got, want), f"case {case} {scorer}"
            theirs_known, mine_known = ~np.isnan(theirs.vnorm), ~np.isnan(mine.vnorm)
            assert (mine_known >= theirs_known).all()
            np.testing.assert_array_equal(mine.vnorm[theirs_known], theirs.vnorm[theirs_known])
            extra = mine_known & ~theirs_known  # computed ahead, with W_O read anyway: exact, and never a sink's
            more += extra.sum()
            if extra.any():
                assert (layer.pos_h[extra] >= layer.n_sink).all()
                matrix, p = critical.norm_weights(layer)  # W_O (L1), or its factor (L2)
                exact = np.stack(projected_value_norms(layer.v.astype(np.float32), matrix, layer.n_head, p=p))
                np.testing.assert_array_equal(mine.vnorm[extra], exact[extra])
    assert refused == 0 if not votes_given else refused > 0
    assert more > 0 if not votes_given else more == 0
