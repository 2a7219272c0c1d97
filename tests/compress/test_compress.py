"""The engine's scorers (kvlocal.compress) against the PyTorch reference (kvlocal.reference.compress).

Inputs are random but fixed, in shuffled cell order, with GQA (G = 3), gaps between positions and
causal masks that matter. The kept sets must be *exactly* those of the reference: both break ties
towards the later position (max pooling makes plateaus of equal scores, so this is exercised), and
float differences between the C kernels and torch (~1e-7 relative) could only flip a selection at a
near-tie of two different scores, which these inputs do not have.
"""

import json
import os
import re
import signal
import time

import numpy as np
import pytest
from policy import need

torch = need("torch")  # the PyTorch reference: skip locally, fail under CI

from kvlocal.compress import (
    METHODS,
    VALUE_NORMS,
    CriticalKV,
    Full,
    LayerInputs,
    Plan,
    SnapKV,
    StreamingLLM,
    make_scorer,
    plan_layers,
    projected_value_norms,
    select,
)
from kvlocal import kernels
from kvlocal.compress.base import native_scoring
from kvlocal.errors import UsageError
from kvlocal.reference import compress as ref
from kvlocal.reference.cache import LayerKV

N_SINK = 4


def make_case(seed=0, hkv=3, group=3, n=90, d=16, w=8, big_d=24, queries="tail", per_head_pos=False, merged=False):
    """Random layer in shuffled cell order; returns (LayerInputs, reference LayerKV, reference Observation).

    queries: "tail" — the last w cached tokens (the usual window); "probe" — w positions after every
    cell (nothing window-protected); "inside" — w cached positions followed by w newer cells, so some
    cells are invisible to some queries. merged: cells stand for 1-3 tokens (``log(count)`` bias).
    """
    rng = np.random.default_rng(seed)

    def positions():  # sinks 0..3 present, then gaps
        rest = rng.choice(np.arange(N_SINK, 3 * n), n - N_SINK, replace=False)
        return np.sort(np.concatenate([np.arange(N_SINK), rest]))

    if per_head_pos:
        sorted_pos = np.stack([positions() for _ in range(hkv)])
        pos = np.stack([p[rng.permutation(n)] for p in sorted_pos])
        last = sorted_pos.min(axis=0)  # query positions below are valid for every head
    else:
        last = positions()
        pos = last[rng.permutation(n)]
    if queries == "tail":
        q_pos = np.sort(last)[-w:]
    elif queries == "probe":
        q_pos = np.arange(pos.max() + 1, pos.max() + 1 + w)
    else:
        q_pos = np.sort(last)[-2 * w : -w]
    k = rng.standard_normal((hkv, n, d)).astype(np.float32)
    v = rng.standard_normal((hkv, n, d)).astype(np.float32)
    q = (rng.standard_normal((hkv * group, w, d)) * 1.5).astype(np.float32)
    wo = (rng.standard_normal((big_d, hkv * group * d)) * 0.2).astype(np.float32)
    count = rng.integers(1, 4, (hkv, n)) if merged else np.ones((hkv, n), dtype=np.int64)
    bias = np.log(count).astype(np.float32)
    layer = LayerInputs(k=k, v=v, pos=pos, q=q, q_pos=q_pos, wo=wo, n_sink=N_SINK, bias=bias if merged else None)

    pos_h = torch.as_tensor(np.broadcast_to(pos, (hkv, n)).copy(), dtype=torch.int64)
    kv = LayerKV(k=torch.from_numpy(k), v=torch.from_numpy(v), pos=pos_h,
                 count=torch.as_tensor(count, dtype=torch.int64), bias=torch.from_numpy(bias))
    obs = ref.Observation(q=torch.from_numpy(q), q_pos=torch.as_tensor(q_pos), wo=torch.from_numpy(wo))
    return layer, kv, obs


def pairs(window_size=32, kernel_size=7, pooling="max"):
    """(engine scorer, reference scorer) with the same hyperparameters."""
    snap = dict(window_size=window_size, kernel_size=kernel_size, pooling=pooling)
    return [
        ("streaming", StreamingLLM(), ref.StreamingLLM(n_sink=N_SINK)),
        ("snapkv", SnapKV(**snap), ref.SnapKV(n_sink=N_SINK, **snap)),
        ("criticalkv", CriticalKV(SnapKV(**snap)), ref.CriticalKV(ref.SnapKV(n_sink=N_SINK, **snap))),
        ("criticalkv-streaming", CriticalKV(StreamingLLM()), ref.CriticalKV(ref.StreamingLLM(n_sink=N_SINK))),
        # L2 value norms: the engine's through W_O's d x d factor, the reference's through W_O itself
        ("criticalkv-l2", CriticalKV(SnapKV(**snap), value_norm="l2"),
         ref.CriticalKV(ref.SnapKV(n_sink=N_SINK, **snap), value_norm="l2")),
    ]


def assert_same_keep(mine, layer, want_plan, what):
    """Same cells, hence the same positions, per head, in the same (position) order."""
    for h in range(layer.n_kv):
        want = want_plan.keep[h].numpy()
        np.testing.assert_array_equal(mine[h], want, err_msg=f"{what}: head {h}")
        pos = layer.pos_h[h, mine[h]]
        assert np.all(np.diff(pos) > 0), f"{what}: head {h} not in position order"


@pytest.mark.parametrize("queries,seed", [("tail", 0), ("tail", 1), ("probe", 0), ("inside", 0)])
def test_kept_sets_equal_reference(queries, seed):
    layer, kv, obs = make_case(seed=seed, queries=queries)
    n, floor = layer.n, N_SINK + int(layer.window_mask().sum(axis=1).max())
    for name, mine, theirs in pairs():
        for budget in sorted({floor - 2, floor, 20, n // 2, n - 1, n, n + 7}):
            keep = mine.keep(layer, budget)
            assert keep.shape == (layer.n_kv, min(budget, n))
            assert_same_keep(keep, layer, theirs.plan(kv, obs, budget), f"{name} {queries} budget={budget}")


@pytest.mark.parametrize("snap", [dict(kernel_size=5, pooling="avg"), dict(kernel_size=1), dict(window_size=5)])
def test_kept_sets_equal_reference_other_hyperparameters(snap):
    layer, kv, obs = make_case(seed=3, n=70)
    for name, mine, theirs in pairs(**snap)[1:3]:
        for budget in (12, 30, 55):
            assert_same_keep(mine.keep(layer, budget), layer, theirs.plan(kv, obs, budget), f"{name} {snap} b={budget}")


def test_kept_sets_equal_reference_per_head_positions():
    layer, kv, obs = make_case(seed=5, per_head_pos=True, n=60)
    for name, mine, theirs in pairs():
        for budget in (14, 30, 59):
            assert_same_keep(mine.keep(layer, budget), layer, theirs.plan(kv, obs, budget), f"{name} b={budget}")


def test_kept_sets_equal_reference_merged_slots():
    # merged slots: the log(count) bias enters the window softmax (as the reference's attention)
    layer, kv, obs = make_case(seed=8, merged=True, n=60)
    for name, mine, theirs in pairs()[1:3]:
        for budget in (14, 30, 59):
            assert_same_keep(mine.keep(layer, budget), layer, theirs.plan(kv, obs, budget), f"{name} b={budget}")


def test_kept_sets_equal_reference_numpy_path():
    # without AVX2 the scorers use the numpy definitions of the two kernels: same kept sets
    best = kernels.simd_level()
    kernels.simd_level("generic")
    try:
        assert not native_scoring()
        layer, kv, obs = make_case(seed=10, n=60)
        for name, mine, theirs in [p for p in pairs() if p[0] in ("snapkv", "criticalkv", "criticalkv-l2")]:
            for budget in (14, 30):
                assert_same_keep(mine.keep(layer, budget), layer, theirs.plan(kv, obs, budget), f"{name} b={budget}")
    finally:
        kernels.simd_level(best)


def test_l2_factor_is_computed_once_per_w_o_array_and_dropped_with_it():
    """CriticalKV's L2 factor is shared by every scorer that meets the same W_O array (a server's chats, a bench's
    engines: one QR per layer and process) and leaves the cache when the array does."""
    import gc

    from kvlocal.compress.criticalkv import _FACTORS, l2_factor

    layer, _, _ = make_case(seed=3)
    layer.wo = layer.wo.copy()  # an array of this test's own
    first, _ = CriticalKV(value_norm="l2").norm_weights(layer)
    again, _ = CriticalKV(value_norm="l2").norm_weights(layer)
    assert again is first
    np.testing.assert_array_equal(first, l2_factor(layer.wo, layer.n_head))
    key = (id(layer.wo), layer.n_head)
    assert key in _FACTORS and CriticalKV(value_norm="l1").norm_weights(layer)[0] is layer.wo
    layer.wo = layer.wo.copy()  # the old array's last reference goes: so does its factor
    gc.collect()
    assert key not in _FACTORS
    assert CriticalKV(value_norm="l2").norm_weights(layer)[0] is not first


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_criticalkv_reuses_and_fills_known_norms(norm):
    layer, _, _ = make_case(seed=9)
    crit = CriticalKV(value_norm=norm)
    want = crit.keep(layer, 40)
    layer.vnorm = np.full((layer.n_kv, layer.n), np.nan, dtype=np.float32)
    assert np.array_equal(crit.keep(layer, 40), want)
    filled = ~np.isnan(layer.vnorm)  # the norms stage 2 needed, written in place
    assert 0 < filled.sum() < layer.vnorm.size
    p = VALUE_NORMS[norm]
    exact = np.stack(projected_value_norms(layer.v, layer.wo, layer.n_head, p=p))  # through W_O itself
    np.testing.assert_allclose(layer.vnorm[filled], exact[filled], rtol=1e-5)
    layer.vnorm = exact.copy()  # all known: nothing recomputed, same plan
    assert np.array_equal(crit.keep(layer, 40), want)
    layer.vnorm = np.where(filled, 0, exact).astype(np.float32)  # the known norms are what is used
    assert not np.array_equal(crit.keep(layer, 40), want)


def test_scores_match_reference():
    layer, kv, obs = make_case(seed=2, queries="inside")
    mine, theirs = SnapKV().score(layer), ref.SnapKV(n_sink=N_SINK).score(kv, obs).numpy()
    assert np.array_equal(np.isposinf(mine), np.isposinf(theirs))
    finite = np.isfinite(theirs)
    np.testing.assert_allclose(mine[finite], theirs[finite], rtol=1e-5, atol=1e-8)
    norms = projected_value_norms(layer.v, layer.wo, layer.n_head)
    want = ref.projected_value_norms(kv.v, obs.wo, layer.n_head).numpy()
    np.testing.assert_allclose(np.stack(norms), want, rtol=1e-5)


def test_floor_keeps_exactly_the_protected_cells():
    layer, _, _ = make_case(seed=4)
    protected = layer.protected()
    floor = N_SINK + layer.q.shape[1]
    assert (protected.sum(axis=1) == floor).all()
    for scorer in (SnapKV(), CriticalKV()):
        keep = scorer.keep(layer, floor)
        for h in range(layer.n_kv):
            assert set(keep[h]) == set(np.flatnonzero(protected[h]))


def test_window_rule_recent():
    # a probe outside the cache protects nothing by the default rule; recent=W protects the W newest
    layer, _, _ = make_case(seed=6, queries="probe")
    assert not layer.window_mask().any()
    layer.recent = 10
    newest = np.argsort(layer.pos)[-10:]
    assert set(np.flatnonzero(layer.window_mask()[0])) == set(newest)
    keep = SnapKV().keep(layer, N_SINK + 10)
    for h in range(layer.n_kv):
        assert set(keep[h]) == set(newest) | set(np.flatnonzero(layer.pos < N_SINK))


def test_budget_at_least_n_keeps_everything():
    layer, _, _ = make_case(seed=7)
    in_order = np.argsort(layer.pos)
    for scorer in (Full(), StreamingLLM(), SnapKV(), CriticalKV()):
        for budget in (layer.n, layer.n + 100):
            keep = scorer.keep(layer, budget)
            assert (keep == in_order).all(), type(scorer).__name__
    assert (Full().keep(layer, 3) == in_order).all()  # full ignores the budget


def test_select_ties_go_to_later_positions():
    scores = np.array([[1.0, 5.0, 5.0, 5.0, 2.0]], np.float32)
    pos = np.array([10, 40, 20, 30, 0])
    assert select(scores, 2, pos).tolist() == [[3, 1]]  # positions 30, 40
    assert select(scores, 4, pos).tolist() == [[4, 2, 3, 1]]


def plan_for(seed=0, n_layer=3, budget=40):
    layers = [make_case(seed=seed + il, queries="tail")[0] for il in range(n_layer)]
    # the engine's cells are shared by all layers: give every layer the first one's positions
    for layer in layers[1:]:
        layer.pos, layer.q_pos = layers[0].pos, layers[0].q_pos
    return plan_layers(CriticalKV(), layers, budget), layers


def test_plan_slot_positions_strictly_increasing():
    plan, layers = plan_for()
    sp = plan.slot_positions()
    assert sp.shape == (40,) and np.all(np.diff(sp) > 0)
    assert sp[-1] == layers[0].pos.max()  # the window is kept: the next token goes at the old next position
    assert plan.keep.shape == plan.positions.shape == (3, 3, 40)
    for il, layer in enumerate(layers):
        np.testing.assert_array_equal(plan.positions[il], layer.pos_h[0][plan.keep[il]])
        assert np.all(plan.positions[il] <= sp)
    # per-head source positions (after an earlier event heads hold different tokens in a cell)
    true = np.stack([np.stack([layer.pos + 1000 * h for h in range(3)]) for layer in layers])  # [L, Hkv, n]
    plan2 = Plan.from_keep(list(plan.keep), true)
    np.testing.assert_array_equal(plan2.positions[:, 2], plan.positions[:, 2] + 2000)
    assert np.array_equal(plan2.slot_positions(), plan.positions[:, 2].max(axis=0) + 2000)


def test_plan_json_round_trip():
    plan, _ = plan_for(seed=3)
    text = plan.to_json()
    doc = json.loads(text)
    assert doc["n_layer"] == 3 and doc["n_kv_head"] == 3 and doc["n_slots"] == 40
    assert doc["layers"][1]["positions"] == plan.positions[1].tolist()
    back = Plan.from_json(text)
    np.testing.assert_array_equal(back.keep, plan.keep)
    np.testing.assert_array_equal(back.positions, plan.positions)
    assert back.counts is None and back.merges is None
    counted = Plan(keep=plan.keep, positions=plan.positions, counts=np.ones_like(plan.keep))
    assert Plan.from_json(counted.to_json()).counts[2].tolist() == counted.counts[2].tolist()
    with pytest.raises(ValueError):
        Plan.from_json(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError):
        Plan(keep=[np.array([[0, 1]])], positions=[np.array([[5, 5]])])


def test_make_scorer():
    # (every method of the registry: tests/compress/test_methods.py; the newer ones also in test_compress_merge.py and
    # test_defensivekv.py)
    crit = make_scorer("criticalkv", window_size=16, epsilon=1e-3)
    assert isinstance(crit, CriticalKV) and crit.epsilon == 1e-3 and crit.press == SnapKV(window_size=16)
    assert make_scorer("snapkv", pooling="avg", kernel_size=5) == SnapKV(pooling="avg", kernel_size=5)
    with pytest.raises(UsageError, match=re.escape("known methods: " + ", ".join(METHODS))):
        make_scorer("h2o")
    with pytest.raises(UsageError, match="no parameter"):
        make_scorer("streaming", window_size=3)
    with pytest.raises(UsageError, match="kernel_size"):
        make_scorer("snapkv", kernel_size=4)


def test_inputs_are_checked():
    layer, _, _ = make_case(seed=0, n=20)
    with pytest.raises(ValueError):
        LayerInputs(k=layer.k, v=layer.v, pos=layer.pos[:-1])
    with pytest.raises(ValueError):
        LayerInputs(k=layer.k, v=layer.v, pos=layer.pos, q=layer.q)
    with pytest.raises(ValueError, match="queries"):
        SnapKV().score(LayerInputs(k=layer.k, v=layer.v, pos=layer.pos))
    with pytest.raises(ValueError, match="wo"):
        CriticalKV().keep(LayerInputs(k=layer.k, v=layer.v, pos=layer.pos, q=layer.q, q_pos=layer.q_pos), 10)


def test_every_method_that_reads_w_o_is_marked():
    """The engine reads W_O only for WO_METHODS: a method whose scorer needs it must be there."""
    from kvlocal.compress import METHODS, WO_METHODS, make_scorer

    def uses_wo(scorer) -> bool:
        parts = [scorer] + [getattr(scorer, a) for a in ("press", "merger") if hasattr(scorer, a)]
        return any(type(p).__name__ in ("CriticalKV", "DefensiveKV") or (p is not scorer and uses_wo(p)) for p in parts)

    assert {m for m in METHODS if uses_wo(make_scorer(m))} == WO_METHODS


@pytest.mark.parametrize("method", list(METHODS))
def test_layers_planned_on_threads_give_the_same_plan(method):
    """plan_layers(workers=3) (what an engine event does on its context's threads) against one layer at a
    time: the same plan, and CriticalKV fills in the same value norms of each layer."""
    cases = [make_case(seed=s)[0] for s in range(7)]
    for layer in cases:
        layer.vnorm = np.full((layer.n_kv, layer.n), np.nan, np.float32)
    twins = [LayerInputs(**{**layer.__dict__, "vnorm": layer.vnorm.copy()}) for layer in cases]
    one = plan_layers(make_scorer(method), iter(cases), 40)
    three = plan_layers(make_scorer(method), iter(twins), 40, workers=3)
    assert one.to_dict() == three.to_dict()
    for a, b in zip(cases, twins):
        np.testing.assert_array_equal(a.vnorm, b.vnorm)
    assert not make_scorer(method).needs_wo or not np.isnan(cases[0].vnorm).all()  # the norms were filled in


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_layers_planned_on_threads_in_a_forked_child():
    """plan_layers keeps its threads for the process; a child forked after they started has none of them (a pool
    inherited across the fork queues the layers and never runs them), so it starts its own: the child's plan is
    the parent's. The child is given 60 s, then killed."""
    cases = [make_case(seed=s)[0] for s in range(4)]
    want = plan_layers(make_scorer("snapkv"), iter(cases), 40, workers=2).to_dict()  # the parent's threads
    pid = os.fork()
    if pid == 0:  # the child: exit 0 if it planned the same, 1 if not (no pytest in here)
        same = False
        try:
            same = plan_layers(make_scorer("snapkv"), iter(cases), 40, workers=2).to_dict() == want
        finally:
            os._exit(0 if same else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's plan did not finish in 60 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0
