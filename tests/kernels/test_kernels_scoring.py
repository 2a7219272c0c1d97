"""Native scoring kernels (window votes, projected value norms, the recall tier's page bounds) against their numpy definitions.

Every instruction-set variant this CPU supports (generic, AVX2, AVX-512) is checked.
"""

import numpy as np
import pytest

from kvlocal import kernels
from kvlocal.compress import numpy_kernels
from kvlocal.compress.criticalkv import l2_factor

_BEST = kernels.simd_level()
LEVELS = kernels.SIMD_LEVELS[: kernels.SIMD_LEVELS.index(_BEST) + 1]


@pytest.fixture(params=LEVELS)
def level(request):
    kernels.simd_level(request.param)
    assert kernels.simd_level() == request.param
    yield request.param
    kernels.simd_level(_BEST)


def window_case(seed, hkv, group, w, n, d, bias=False, per_head_pos=False, q_pos=None):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((hkv * group, w, d)) * 2).astype(np.float32)
    k = rng.standard_normal((hkv, n, d)).astype(np.float32)
    if per_head_pos:
        pos = np.stack([rng.permutation(np.arange(0, 2 * n, 2)) for _ in range(hkv)])
    else:
        pos = rng.permutation(np.arange(0, 2 * n, 2))
    if q_pos is None:
        q_pos = np.sort(rng.choice(np.arange(0, 2 * n + 4), w, replace=False))  # causal mask matters
    b = rng.standard_normal((hkv, n)).astype(np.float32) if bias else None
    return q, np.asarray(q_pos), k, pos, b


@pytest.mark.parametrize(
    "hkv,group,w,n,d",
    [(3, 3, 32, 200, 64), (1, 1, 1, 1, 1), (2, 4, 5, 33, 7), (3, 1, 8, 17, 16), (1, 2, 3, 64, 3)],
)
def test_window_votes_matches_numpy(level, hkv, group, w, n, d):
    q, q_pos, k, pos, _ = window_case(n + d, hkv, group, w, n, d)
    got = kernels.window_votes(q, q_pos, k, pos)
    want = numpy_kernels.window_votes(q, q_pos, k, pos)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("n,d", [(200, 64), (33, 7), (1, 3)])
def test_window_votes_of_an_f16_caches_cells_are_those_of_its_keys_in_float32(level, n, d):
    """Keys given as an F16 cache's cells ([n, Hkv, d] half floats, seen as [Hkv, n, d]) are converted as the kernel
    reads them: the same bits as the keys converted to float32 first (sizes not a whole register block of keys, and
    head sizes not a whole vector, included)."""
    q, q_pos, k, pos, b = window_case(n * d, 3, 2, 5, n, d, bias=True, per_head_pos=True)
    cells = k.transpose(1, 0, 2).astype(np.float16)  # as the cache holds them
    got = kernels.window_votes(q, q_pos, cells.transpose(1, 0, 2), pos, b)
    want = kernels.window_votes(q, q_pos, cells.transpose(1, 0, 2).astype(np.float32), pos, b)
    np.testing.assert_array_equal(got, want)
    assert got.any()


def test_window_votes_bias_per_head_positions_and_empty_cells(level):
    q, q_pos, k, pos, b = window_case(7, 2, 3, 6, 45, 8, bias=True, per_head_pos=True)
    pos = pos.copy()
    pos[1, [3, 10]] = -1  # empty rows: never visible
    got = kernels.window_votes(q, q_pos, k, pos, b)
    want = numpy_kernels.window_votes(q, q_pos, k, pos, b)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert np.all(got[3:6, [3, 10]] == 0)


def test_window_votes_is_a_mean_of_distributions(level):
    # every query sees some key: each head's votes sum to 1; a query that sees none adds zeros
    q, _, k, pos, _ = window_case(3, 3, 3, 4, 50, 16)
    votes = kernels.window_votes(q, np.full(4, 10_000), k, pos)
    np.testing.assert_allclose(votes.sum(axis=1), 1.0, rtol=1e-5)
    votes = kernels.window_votes(q, np.array([-5, -5, 10_000, 10_000]), k, pos)
    np.testing.assert_allclose(votes.sum(axis=1), 0.5, rtol=1e-5)


def test_window_votes_extreme_logits_and_shapes(level):
    q, q_pos, k, pos, _ = window_case(11, 2, 2, 4, 40, 8, q_pos=[100, 100, 100, 100])
    q *= 60  # logit gaps far beyond exp's range: probabilities 0 / 1 without NaN
    got = kernels.window_votes(q, q_pos, k, pos)
    # logits up to ~470: a float32 logit is only good to eps * |logit| (~3e-5), and so is each exp; two sums
    # in different orders (SIMD here, numpy's BLAS there) agree to a few times that, not to 2e-5
    logit = np.abs(np.einsum("hwd,gnd->hgwn", q, k)).max() / np.sqrt(q.shape[-1])
    rtol = 4 * np.finfo(np.float32).eps * logit
    np.testing.assert_allclose(got, numpy_kernels.window_votes(q, q_pos, k, pos), rtol=rtol, atol=1e-7)
    assert np.isfinite(got).all()
    assert kernels.window_votes(q[:, :0], np.zeros(0), k, pos).shape == (4, 40)
    with pytest.raises(ValueError):
        kernels.window_votes(q[:3], q_pos, k, pos)  # Hq not a multiple of Hkv


@pytest.mark.parametrize(
    "n,d,n_head,group,big_d", [(150, 64, 9, 3, 576), (5, 3, 1, 1, 7), (33, 16, 4, 2, 100), (1, 1, 1, 1, 1)]
)
@pytest.mark.parametrize("p", [1, 2])
def test_vnorm_matches_numpy(level, n, d, n_head, group, big_d, p):
    rng = np.random.default_rng(n * d)
    v = rng.standard_normal((n, d)).astype(np.float32)
    wo = (rng.standard_normal((big_d, n_head * d)) * 0.1).astype(np.float32)
    for first in range(0, n_head, group):  # every group's slice of W_O, read in place
        np.testing.assert_allclose(kernels.vnorm(v, wo, first, group, p=p),
                                   numpy_kernels.vnorm(v, wo, first, group, p=p), rtol=2e-5)
    rows = rng.permutation(n)[: max(1, n // 3)]
    np.testing.assert_allclose(kernels.vnorm(v, wo, n_head - group, group, rows, p),
                               numpy_kernels.vnorm(v, wo, n_head - group, group, rows, p), rtol=2e-5)


@pytest.mark.parametrize("d,n_head,group,big_d", [(64, 9, 3, 576), (64, 14, 7, 896), (8, 4, 2, 6), (3, 2, 1, 40)])
def test_l2_norms_through_the_factor_are_those_through_wo(level, d, n_head, group, big_d):
    # ||v W_O^h||_2 = ||v R_h^T||_2 with W_O^h^T = Q_h R_h: d columns per head instead of D, the same norms
    # (big_d < d: a rank-deficient slice, whose R has rows of zeros)
    rng = np.random.default_rng(d + big_d)
    v = rng.standard_normal((50, d)).astype(np.float32)
    wo = (rng.standard_normal((big_d, n_head * d)) * 0.1).astype(np.float32)
    factor = l2_factor(wo, n_head)
    assert factor.shape == (min(d, big_d), n_head * d)
    for first in range(0, n_head, group):
        np.testing.assert_allclose(kernels.vnorm(v, factor, first, group, p=2),
                                   numpy_kernels.vnorm(v, wo, first, group, p=2), rtol=1e-5)
    assert not np.allclose(kernels.vnorm(v, factor, 0, group, p=1), numpy_kernels.vnorm(v, wo, 0, group, p=1),
                           rtol=1e-3)  # the factor keeps the L2 norm only


def test_l2_factor_of_a_head_of_zeros(level):
    # a pruned head's slice of W_O is zero: its Gram matrix has no Cholesky factor, so the factor comes from the QR;
    # the norms are still those through W_O (0 for that head)
    rng = np.random.default_rng(5)
    d, n_head, big_d = 8, 4, 40
    v = rng.standard_normal((20, d)).astype(np.float32)
    wo = rng.standard_normal((big_d, n_head * d)).astype(np.float32)
    wo[:, d:2 * d] = 0
    factor = l2_factor(wo, n_head)
    assert not factor[:, d:2 * d].any()
    for first in range(n_head):
        np.testing.assert_allclose(kernels.vnorm(v, factor, first, 1, p=2),
                                   numpy_kernels.vnorm(v, wo, first, 1, p=2), rtol=1e-5, atol=1e-6)


def test_vnorm_is_the_norm_of_the_projection(level):
    # one row, one head: ||v W_O^h||_1 and ||v W_O^h||_2 written out
    v = np.array([[1.0, -2.0]], np.float32)
    wo = np.array([[0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 3, 1]], np.float32)  # D=3, heads of d=2
    assert kernels.vnorm(v, wo, 1, 1).tolist() == [1 + 2 + 1]
    assert kernels.vnorm(v, wo, 0, 2).tolist() == [(0 + 4) / 2]
    assert kernels.vnorm(v, wo, 1, 1, p=2).tolist() == [np.float32(np.sqrt(1 + 4 + 1))]
    assert kernels.vnorm(v, wo, 0, 2, p=2).tolist() == [np.float32(np.sqrt(6)) / 2]


def test_vnorm_rows_edge_cases(level):
    rng = np.random.default_rng(0)
    v = rng.standard_normal((10, 4)).astype(np.float32)
    wo = rng.standard_normal((6, 12)).astype(np.float32)
    assert kernels.vnorm(v, wo, 0, 3, np.zeros(0, np.int64)).shape == (0,)
    np.testing.assert_allclose(kernels.vnorm(v, wo, 1, 2, [9, 9, 0]), numpy_kernels.vnorm(v, wo, 1, 2, [9, 9, 0]),
                               rtol=2e-5)
    with pytest.raises(ValueError):
        kernels.vnorm(v, wo, 0, 1, [10])
    with pytest.raises(ValueError):
        kernels.vnorm(v, wo, 2, 2)  # heads 2..3 of d=4 do not fit in 12 columns
    with pytest.raises(ValueError, match="p must be 1 or 2"):
        kernels.vnorm(v, wo, 0, 1, p=3)


def test_levels_agree_closely():
    # the variants differ only in summation order and FMA contraction
    q, q_pos, k, pos, _ = window_case(5, 3, 3, 32, 300, 64)
    out = {}
    try:
        for lv in LEVELS:
            kernels.simd_level(lv)
            out[lv] = kernels.window_votes(q, q_pos, k, pos)
    finally:
        kernels.simd_level(_BEST)
    for lv in LEVELS:
        np.testing.assert_allclose(out[lv], out[LEVELS[0]], rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("m,d,n_rows", [(1, 64, 16), (7, 64, 1000), (33, 64, 3700), (5, 13, 530), (224, 64, 1290)])
def test_page_candidates_rank_by_quests_bound(level, m, d, n_rows):
    """kvl_page_candidates on every instruction set against the bounds written out in numpy (float64) and the
    ranking steps: pages by bound, taken until n_want rows off the device, their off-device rows. Shapes cross the
    vector widths (pages per register block 8-32, queries per block 4, a scalar key dimension of 13)."""
    rng = np.random.default_rng(m * 1000 + n_rows)
    page = 16
    n_pages = -(-n_rows // page)
    lo = rng.standard_normal((n_pages, d)).astype(np.float32)
    hi = lo + np.abs(rng.standard_normal((n_pages, d))).astype(np.float32)
    q = rng.standard_normal((m, d)).astype(np.float32)
    on_device = rng.random(n_rows) < 0.3
    bound = np.maximum(q[:, None, :].astype(np.float64) * lo, q[:, None, :].astype(np.float64) * hi).sum(-1).max(0)
    off = np.add.reduceat((~on_device).astype(np.int64), np.arange(0, n_rows, page))
    for n_want in (1, n_rows // 3, n_rows):
        pages = np.flatnonzero(off > 0)
        order = pages[np.argsort(-bound[pages], kind="stable")]
        taken = np.sort(order[:int(np.searchsorted(np.cumsum(off[order]), n_want)) + 1])
        ids = (taken[:, None] * page + np.arange(page)).reshape(-1)
        ids = ids[ids < n_rows]
        np.testing.assert_array_equal(kernels.page_candidates(q, lo, hi, on_device, page, n_want), ids[~on_device[ids]])


@pytest.mark.parametrize("d", [64, 13])  # a whole number of F16C vectors, and a scalar tail
def test_f16_heads_is_numpys_conversion_bit_for_bit(level, d):
    """Every half-float bit pattern (normals, subnormals, zeros, infinities, NaN), from cells [n, H, d] to
    heads [H, n, d]: the same float32 bits as numpy's conversion."""
    bits = np.arange(65536, dtype=np.uint16)
    n = len(bits) // (2 * d) + 1
    cells = np.resize(bits, (n, 2, d)).view(np.float16)
    got = kernels.f16_heads_f32(cells.transpose(1, 0, 2))
    want = np.ascontiguousarray(cells.transpose(1, 0, 2), dtype=np.float32)
    assert got.flags.c_contiguous and got.shape == (2, n, d)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))


def test_as_f32_of_half_rows_is_numpys_conversion(level):
    """as_f32 (the scorers' and the recall tier's conversion of an F16 cache's rows) on heads [H, n, d] and on rows
    [n, d], contiguous or a strided slice: numpy's float32 values, C-contiguous."""
    from kvlocal.kernels import as_f32

    rows = np.random.default_rng(3).standard_normal((50, 3, 16)).astype(np.float16)
    for x in (rows.transpose(1, 0, 2), rows[:, 1], rows.reshape(150, 16), rows[::2, 0]):
        got = as_f32(x)
        assert got.flags.c_contiguous and got.dtype == np.float32
        np.testing.assert_array_equal(got, x.astype(np.float32))


def test_bench_kernels_times_every_step(capsys):
    """tools/bench_kernels (the C kernels against numpy, step by step) runs and prints every step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tools import bench_kernels

    bench_kernels.main(["--layers", "2", "--n", "300", "--budget", "128", "--repeat", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.rstrip().endswith("x")]
    assert [r[:56].strip() for r in rows] == [name for name, _ in bench_kernels.steps(128)]
    bench_kernels.main(["--layers", "2", "--n", "300", "--budget", "128", "--repeat", "1", "--plan"])
    out = capsys.readouterr().out
    assert all(f"\n{m} " in out for m in bench_kernels.PLAN_METHODS), out
