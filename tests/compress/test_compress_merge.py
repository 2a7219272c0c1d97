"""Head-adaptive budgets (AdaKV) and merging (KVSlimmer, MeanMerge, CriticalKV+KVSlimmer) in the engine's
numpy layer, against the PyTorch reference; empty and merged rows for every scorer; plans with empty
slots and merges (validation, JSON, materialize).

Inputs are random but seeded, in shuffled cell order, with per-head positions, GQA (G = 3), and
optionally empty rows (``pos = -1``, bias ``-inf``; a different number per head) and merged rows
(counts 1-3, bias ``log(count)``). Kept sets and merge groups must be *exactly* the reference's;
merge key weights agree to float32 rounding (the intermediate merged keys are float32 in both).
"""

import dataclasses
import json

import numpy as np
import pytest
from policy import need

torch = need("torch")  # the PyTorch reference: skip locally, fail under CI

from kvlocal import kernels
from kvlocal.compress import (
    AdaKV,
    CriticalKV,
    EvictThenMerge,
    Full,
    KVSlimmer,
    LayerInputs,
    LayerPlan,
    MeanMerge,
    Plan,
    SnapKV,
    StreamingLLM,
    head_budgets,
    make_scorer,
    method_params,
    norm_p,
    plan_layers,
)
from kvlocal.compress import numpy_kernels
from kvlocal.compress.base import RowSource, window_votes
from kvlocal.compress.criticalkv import projected_value_norms
from kvlocal.compress.evict_merge import evict_budget
from kvlocal.errors import UsageError
from kvlocal.reference import compress as ref
from kvlocal.reference.cache import LayerKV, attend

N_SINK = 4


def random_layer(seed=0, hkv=3, group=3, n=70, d=16, w=8, big_d=24, probe=False, empty=0, merged=False,
                 shared_pos=False, same_keys=False):
    """A random layer: per head, sinks 0..3, random middle positions and the last ``w`` positions of the
    span, in shuffled cell order. Queries at those last ``w`` positions (the window is cached and
    protected), or after the span (``probe``: nothing window-protected). ``empty * h`` random middle
    rows of head ``h`` are empty (garbage K/V); ``merged``: live rows stand for 1-3 tokens;
    ``same_keys``: all keys of a head are equal."""
    rng = np.random.default_rng(seed)
    span = 3 * n

    def positions():
        middle = rng.choice(np.arange(N_SINK, span - w), n - N_SINK - w, replace=False)
        return np.concatenate([np.arange(N_SINK), np.sort(middle), np.arange(span - w, span)])

    pos = np.stack([positions()] * hkv if shared_pos else [positions() for _ in range(hkv)])
    for h in range(hkv):
        pos[h, rng.choice(np.arange(N_SINK, n - w), empty * h, replace=False)] = -1
    perm = rng.permutation(n)
    pos = pos[:, perm] if shared_pos else np.stack([p[rng.permutation(n)] for p in pos])
    k = rng.standard_normal((hkv, n, d)).astype(np.float32)
    if same_keys:
        k[:] = k[:, :1]
    v = rng.standard_normal((hkv, n, d)).astype(np.float32)
    q = (rng.standard_normal((hkv * group, w, d)) * 1.5).astype(np.float32)
    wo = (rng.standard_normal((big_d, hkv * group * d)) * 0.2).astype(np.float32)
    q_pos = np.arange(span, span + w) if probe else np.arange(span - w, span)
    count = rng.integers(1, 4, (hkv, n)) if merged else np.ones((hkv, n), np.int64)
    with np.errstate(divide="ignore"):
        bias = np.where(pos >= 0, np.log(count), -np.inf).astype(np.float32)
    return LayerInputs(k=k, v=v, pos=pos, q=q, q_pos=q_pos, wo=wo, n_sink=N_SINK,
                       bias=bias if merged or empty else None)


def to_reference(layer):
    """The same layer as the reference's cache and observation."""
    bias = np.zeros((layer.n_kv, layer.n), np.float32) if layer.bias is None else layer.bias
    kv = LayerKV(k=torch.from_numpy(layer.k.copy()), v=torch.from_numpy(layer.v.copy()),
                 pos=torch.from_numpy(np.array(layer.pos_h)), count=torch.from_numpy(layer.counts),
                 bias=torch.from_numpy(bias.copy()))
    obs = ref.Observation(q=torch.from_numpy(layer.q), q_pos=torch.as_tensor(layer.q_pos), wo=torch.from_numpy(layer.wo))
    return kv, obs


def kept(keep_row):
    return keep_row[keep_row >= 0]


def groups(lp: LayerPlan, h: int):
    """Head ``h`` of a layer plan as (members, weights) per filled slot, in slot order."""
    row = lp.keep[h]
    members = [[int(c)] for c in kept(row)]
    weights = [[1.0] for _ in members]
    if lp.merges is not None:
        first = int((row < 0).sum())
        m = lp.merges[h]
        for j, cells, w in zip(m["slots"], m["cells"], m["weights"]):
            members[j - first], weights[j - first] = cells[cells >= 0].tolist(), w[cells >= 0].tolist()
    return members, weights


def assert_same_groups(lp: LayerPlan, theirs: "ref.MergeGroups", what: str):
    for h in range(len(lp.keep)):
        members, weights = groups(lp, h)
        assert members == [m.tolist() for m in theirs.members[h]], f"{what}: head {h}"
        for mine, want in zip(weights, theirs.weights[h]):
            np.testing.assert_allclose(mine, want.numpy(), rtol=1e-4, atol=1e-5, err_msg=f"{what}: head {h}")


# ---------------------------------------------------------------- empty and merged rows, every scorer


def test_live_counts_and_checks():
    layer = random_layer(seed=0, empty=4, merged=True)
    live = layer.pos_h >= 0
    assert np.array_equal(layer.live, live) and layer.n_live.tolist() == [70, 66, 62]
    assert np.array_equal(layer.counts == 0, ~live) and set(np.unique(layer.counts[live])) == {1, 2, 3}
    assert np.array_equal(np.log(layer.counts[live]).astype(np.float32), layer.bias[live])
    plain = LayerInputs(k=layer.k, v=layer.v, pos=np.where(live, layer.pos_h, -1))
    assert np.array_equal(plain.counts, live.astype(np.int64))  # no bias: 1 per live row
    with pytest.raises(ValueError, match="-inf exactly"):  # a live row with bias -inf
        LayerInputs(k=layer.k, v=layer.v, pos=np.abs(layer.pos_h), bias=layer.bias)
    with pytest.raises(ValueError, match="-inf exactly"):  # an empty row with a finite bias
        LayerInputs(k=layer.k, v=layer.v, pos=layer.pos, bias=np.where(live, layer.bias, 0))
    with pytest.raises(ValueError, match=">= 0"):
        LayerInputs(k=layer.k, v=layer.v, pos=np.where(live, layer.pos_h, -2))


def test_empty_rows_get_no_attention_and_no_protection():
    layer = random_layer(seed=1, empty=5, probe=True)
    empty = ~layer.live
    # empty rows at positions below n_sink would be "sinks" if protection did not look at liveness
    assert (layer.pos_h[empty] < N_SINK).all()
    votes = window_votes(layer.q, layer.q_pos, layer.k, layer.pos, layer.bias)  # [Hq, n]
    assert (votes.reshape(layer.n_kv, 3, layer.n) * empty[:, None, :]).max() == 0 and votes.max() > 0
    assert not layer.protected()[empty].any()
    layer.recent = 10  # the 10 most recent live rows of each head
    window = layer.window_mask()
    for h in range(layer.n_kv):
        assert set(layer.pos_h[h, window[h]]) == set(np.sort(layer.pos_h[h][layer.live[h]])[-10:])
    for scorer in (Full(), StreamingLLM(), SnapKV(), CriticalKV()):
        ranking = scorer.rerank(layer, scorer.score(layer), layer.n_live)
        assert np.isneginf(ranking[empty]).all(), type(scorer).__name__


SCORERS = [  # (name, numpy, reference) for the existing eviction scorers
    ("streaming", StreamingLLM(), ref.StreamingLLM(n_sink=N_SINK)),
    ("snapkv", SnapKV(), ref.SnapKV(n_sink=N_SINK)),
    ("criticalkv", CriticalKV(), ref.CriticalKV(ref.SnapKV(n_sink=N_SINK))),
]


@pytest.mark.parametrize("seed,probe", [(0, False), (1, True), (2, False)])
def test_existing_scorers_with_empty_and_merged_rows_equal_reference(seed, probe):
    layer = random_layer(seed=seed, empty=6, merged=True, probe=probe)
    kv, obs = to_reference(layer)
    for name, mine, theirs in SCORERS:
        for budget in (8, 20, 40, 58, 64, 70, 90):
            keep = mine.keep(layer, budget)
            assert keep.shape[1] == min(budget, layer.n_live.max())
            want = theirs.plan(kv, obs, budget)
            for h in range(layer.n_kv):
                cells = kept(keep[h])
                assert len(cells) == min(budget, layer.n_live[h]) and (keep[h][: keep.shape[1] - len(cells)] == -1).all()
                assert layer.live[h, cells].all(), f"{name}: an empty row kept"
                np.testing.assert_array_equal(cells, want.keep[h].numpy(), err_msg=f"{name} b={budget} head {h}")
            lp = mine.plan_layer(layer, budget)  # the counts of merged input rows are carried
            np.testing.assert_array_equal(lp.counts, np.where(keep >= 0, np.take_along_axis(
                layer.counts, np.maximum(keep, 0), axis=1), 0))


# ---------------------------------------------------------------- AdaKV


def ada_pair(critical: bool, **kw):
    if critical:
        return AdaKV(CriticalKV(), **kw), ref.AdaKV(ref.CriticalKV(ref.SnapKV(n_sink=N_SINK)), mode="safeguard", **_ref_kw(kw))
    return AdaKV(SnapKV(), **kw), ref.AdaKV(ref.SnapKV(n_sink=N_SINK), mode="safeguard", **_ref_kw(kw))


def _ref_kw(kw):
    return {{"alpha_safeguard": "alpha"}.get(key, key): val for key, val in kw.items()}


@pytest.mark.parametrize("critical", [False, True], ids=["adakv", "criticalkv+adakv"])
@pytest.mark.parametrize("case", [dict(seed=0), dict(seed=1, probe=True), dict(seed=2, empty=6, merged=True),
                                  dict(seed=3, hkv=4, group=2)])
def test_adakv_kept_sets_equal_reference(critical, case):
    layer = random_layer(**case)
    layer.q[: layer.q.shape[0] // layer.n_kv] *= 4  # sharp attention in KV head 0: uneven budgets
    kv, obs = to_reference(layer)
    uneven = False
    for kw in (dict(), dict(max_share=1.5, alpha_safeguard=0.1)):
        mine, theirs = ada_pair(critical, **kw)
        for budget in (5, 12, 25, 40, 69, 100):
            keep = mine.keep(layer, budget)
            want = theirs.plan(kv, obs, budget)
            for h in range(layer.n_kv):
                np.testing.assert_array_equal(kept(keep[h]), want.keep[h].numpy(), err_msg=f"{kw} b={budget} h={h}")
            uneven |= len(set(want.budgets.tolist())) > 1
    assert uneven  # the test exercises different budgets per head


@pytest.mark.parametrize("seed", range(4))
def test_adakv_budgets_sum_safeguard_and_cap(seed):
    layer = random_layer(seed=seed, hkv=4, group=2, n=80)
    layer.q[:2] *= 6  # KV head 0 concentrated, the others want more
    scores = SnapKV().score(layer)
    kv, _ = to_reference(layer)
    hit_cap = False
    for budget in (3, 10, 20, 30, 60, 80):
        for alpha, share in ((0.2, 2.0), (0.0, 1.0), (0.5, 1.5), (0.2, 4.0)):
            b = head_budgets(scores, budget, layer.pos, layer.live, alpha, share)
            want = ref.adakv_budgets(torch.from_numpy(scores), budget, kv.pos, alpha, "safeguard", share)
            assert b.tolist() == want.tolist()
            assert b.sum() == layer.n_kv * min(budget, layer.n)
            assert b.max() <= int(share * budget) and b.min() >= min(max(1, int(alpha * budget)), budget)
            hit_cap |= budget < 40 and b.max() == int(share * budget)
    assert hit_cap  # the cap binds somewhere: without it a head would take more


def test_adakv_plan_left_pads_and_slot_positions_increase():
    budget = 20
    layers = [random_layer(seed=il, n=60, shared_pos=True) for il in range(4)]
    for layer in layers[1:]:  # the engine's cells are shared by all layers
        layer.pos, layer.q_pos = layers[0].pos, layers[0].q_pos
    for il, layer in enumerate(layers):
        layer.q[3 * (il % 3) : 3 * (il % 3) + 3] *= 5  # a different sharp head in every layer
    for scorer in (make_scorer("adakv"), make_scorer("criticalkv+adakv")):
        plan = plan_layers(scorer, layers, budget)
        assert budget < plan.n_slots <= 2 * budget  # some head took more than the uniform budget, within the cap
        filled = plan.keep >= 0
        assert (filled.sum(axis=2) >= 1).all() and (filled.sum(axis=(1, 2)) == 3 * budget).all()  # Hkv*budget
        assert np.array_equal(filled, np.sort(filled, axis=2))  # empty slots first
        assert np.array_equal(plan.positions < 0, ~filled) and plan.counts is None
        sp = plan.slot_positions()
        assert np.all(np.diff(sp) > 0) and (sp >= plan.positions.max(axis=(0, 1))).all()
        assert Plan.from_json(plan.to_json()).to_dict() == plan.to_dict()


# ---------------------------------------------------------------- KVSlimmer, MeanMerge, CriticalKV+KVSlimmer


MERGE_CASES = [dict(seed=0), dict(seed=1, probe=True), dict(seed=2, merged=True, empty=5),
               dict(seed=3, probe=True, merged=True, empty=3), dict(seed=4, hkv=2, group=4)]


@pytest.mark.parametrize("case", MERGE_CASES)
@pytest.mark.parametrize("method", ["kvslimmer", "meanmerge"])
def test_merges_equal_reference(case, method):
    layer = random_layer(**case)
    kv, obs = to_reference(layer)
    theirs = (ref.KVSlimmer if method == "kvslimmer" else ref.MeanMerge)(n_sink=N_SINK)
    most_rounds = biggest = 0
    for budget in (6, 14, 30, 50, 69, 80):
        lp = make_scorer(method).plan_layer(layer, budget)
        want = theirs.plan(kv, obs, budget)
        assert_same_groups(lp, want, f"{method} {case} b={budget}")
        assert lp.keep.shape[1] == min(budget, layer.n_live.max())
        counts = lp.counts if lp.counts is not None else (lp.keep >= 0).astype(int)
        for h in range(layer.n_kv):  # every token is still counted, unless the budget forced evictions
            if budget > N_SINK + 8:
                assert counts[h].sum() == layer.counts[h].sum()
        most_rounds = max(most_rounds, len(want.rounds))
        biggest = max([biggest] + [len(m) for per_head in want.members for m in per_head])
    assert most_rounds >= 3 and biggest >= 4  # several rounds, groups of more than two


def test_merge_fallback_evicts_when_protected_rows_fill_the_budget():
    layer = random_layer(seed=5, n=40)  # 4 sinks + 8 window rows protected
    kv, obs = to_reference(layer)
    lp = KVSlimmer().plan_layer(layer, 6)
    assert_same_groups(lp, ref.KVSlimmer(n_sink=N_SINK).plan(kv, obs, 6), "fallback")
    for h in range(layer.n_kv):  # only protected rows left: the 6 most recent (the window's last 6)
        cells = kept(lp.keep[h])
        assert len(cells) == 6 and set(layer.pos_h[h, cells]) == set(layer.q_pos[-6:])


def test_meanmerge_differs_from_kvslimmer_only_in_key_weights():
    layer = random_layer(seed=6, merged=True)
    budget = 60  # one round: the same attention, hence the same pairs
    slim, mean = KVSlimmer().plan_layer(layer, budget), MeanMerge().plan_layer(layer, budget)
    np.testing.assert_array_equal(slim.keep, mean.keep)
    np.testing.assert_array_equal(slim.counts, mean.counts)
    for a, b in zip(slim.merges, mean.merges):
        np.testing.assert_array_equal(a["cells"], b["cells"])
        assert (b["weights"] == 0.5).all() and not np.allclose(a["weights"], 0.5)


@pytest.mark.parametrize("case", [dict(seed=0), dict(seed=7, merged=True, empty=4), dict(seed=8, probe=True)])
def test_criticalkv_kvslimmer_equals_reference(case):
    layer = random_layer(**case)
    kv, obs = to_reference(layer)
    theirs = ref.EvictThenMerge(ref.CriticalKV(ref.SnapKV(n_sink=N_SINK)), ref.KVSlimmer(n_sink=N_SINK), 0.5)
    for budget in (10, 20, 33, 45):
        layer.vnorm = None
        lp = make_scorer("criticalkv+kvslimmer").plan_layer(layer, budget)
        copy = LayerKV(*(t.clone() for t in (kv.k, kv.v, kv.pos, kv.count, kv.bias)))
        assert_same_groups(lp, theirs.compress(copy, obs, budget), f"b={budget}")
        if budget <= N_SINK + 8:
            continue  # (the protected rows fill the budget: the merge evicts some)
        # the merged rows are exactly CriticalKV's kept set at the larger budget, all of it counted
        evicted = CriticalKV().keep(layer, evict_budget(budget, 0.5))
        counts = lp.counts if lp.counts is not None else (lp.keep >= 0).astype(int)
        for h in range(layer.n_kv):
            members = [c for group in groups(lp, h)[0] for c in group]
            assert sorted(members) == sorted(kept(evicted[h]))
            assert counts[h].sum() == layer.counts[h, kept(evicted[h])].sum()
            assert len(kept(lp.keep[h])) == min(budget, layer.n_live[h])


class ArrayRows(RowSource):
    """Serves a layer's own rows, counting the ones asked for (as the native backend copies them)."""

    def __init__(self, layer: LayerInputs):
        self.layer, self.q, self.q_pos, self.asked = layer, layer.q, layer.q_pos, set()

    def fetch(self, cells):
        heads = np.arange(len(cells))[:, None]
        self.asked |= {(h, c) for h, c in zip(*np.nonzero(cells >= 0)) for c in [int(cells[h, c])]}
        return self.layer.k[heads, np.maximum(cells, 0)], self.layer.v[heads, np.maximum(cells, 0)]


@pytest.mark.parametrize("method", ["kvslimmer", "meanmerge", "criticalkv+kvslimmer", "defensivekv"])
def test_inputs_without_rows_fetch_what_a_scorer_reads(method):
    """Inputs without K/V (the native backend's: the device's window votes and value norms instead) plan as the
    inputs with them, fetching the rows the scorer reads from ``LayerInputs.rows``: every row for KVSlimmer and
    DefensiveKV, only CriticalKV's kept rows (1.5 × the budget per head) for criticalkv+kvslimmer."""
    layer = random_layer(seed=3, merged=True, empty=2)
    budget = 20
    layer.vnorm = np.full((layer.n_kv, layer.n), np.nan, np.float32)
    want = make_scorer(method).plan_layer(layer, budget)
    every_row = [np.arange(layer.n)] * layer.n_kv  # the device gives the norms of every row it is asked for,
    p = norm_p(make_scorer(method))  # through W_O itself, in the norm the scorer ranks by
    norms = np.stack(projected_value_norms(layer.v, layer.wo, layer.n_head, every_row, p)).astype(np.float32)
    source = ArrayRows(layer)
    bare = dataclasses.replace(layer, k=None, v=None, pos=layer.pos_h, vnorm=norms, rows=source,
                               votes=window_votes(layer.q, layer.q_pos, layer.k, layer.pos, layer.bias))
    got = make_scorer(method).plan_layer(bare, budget)
    np.testing.assert_array_equal(got.keep, want.keep)
    np.testing.assert_array_equal(got.counts, want.counts)
    for a, b in zip(got.merges or [], want.merges or []):
        for key in ("slots", "cells", "positions"):
            np.testing.assert_array_equal(a[key], b[key])
        np.testing.assert_allclose(a["weights"], b["weights"], rtol=0, atol=1e-6)
    every = layer.n_kv * layer.n
    if method == "criticalkv+kvslimmer":
        assert len(source.asked) <= layer.n_kv * evict_budget(budget, 0.5) < every / 2
    else:
        assert len(source.asked) == every
    with pytest.raises(ValueError, match="no rows"):
        make_scorer(method).plan_layer(dataclasses.replace(bare, rows=None), budget)


def test_evict_budget_rounds_half_up():
    assert [evict_budget(b, 0.5) for b in (1, 3, 5, 10)] == [2, 5, 8, 15]
    assert evict_budget(7, 0.0) == 7


# ---------------------------------------------------------------- plans: validation, JSON, materialize


def merge_plan(seed=0, n_layer=3, budget=20, method="kvslimmer", **case):
    """A plan over layers that share cell positions (the engine's case), and its layers."""
    layers = [random_layer(seed=seed + il, shared_pos=True, **case) for il in range(n_layer)]
    for layer in layers[1:]:
        layer.pos, layer.q_pos, layer.bias = layers[0].pos, layers[0].q_pos, layers[0].bias
    return plan_layers(make_scorer(method), layers, budget), layers


def test_merge_plan_json_round_trip():
    plan, layers = merge_plan(empty=10, merged=True, budget=55)  # KV head 2 has 50 live rows: 5 empty slots
    assert plan.merges is not None and plan.counts is not None and (plan.keep < 0).any()
    text = plan.to_json()
    doc = json.loads(text)
    assert doc["version"] == 2 and doc["slot_positions"] == plan.slot_positions().tolist()
    head = doc["layers"][1]["merges"][2]
    assert set(head) == {"slots", "cells", "positions", "weights"}
    assert all(len(c) == len(p) == len(w) >= 2 for c, p, w in zip(head["cells"], head["positions"], head["weights"]))
    back = Plan.from_json(text)
    assert back.to_dict() == doc
    np.testing.assert_array_equal(back.counts, plan.counts)
    for a, b in zip(back.merges[1], plan.merges[1]):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    with pytest.raises(ValueError, match="v2"):
        Plan.from_dict(dict(doc, version=1))


def test_plan_validation():
    keep = np.array([[[-1, 3, 5], [1, 2, 4]]])
    pos = np.array([[[-1, 30, 50], [10, 20, 40]]])
    Plan(keep=keep, positions=pos)
    with pytest.raises(ValueError, match="empty slots must come first"):
        Plan(keep=keep[:, :, [1, 0, 2]], positions=pos[:, :, [1, 0, 2]])
    with pytest.raises(ValueError, match="only an empty slot"):
        Plan(keep=keep, positions=np.abs(pos))
    with pytest.raises(ValueError, match="counts must be 0"):
        Plan(keep=keep, positions=pos, counts=np.ones_like(keep))
    merge = {"slots": [2], "cells": [[0, 1, 4]], "positions": [[5, 7, 40]], "weights": [[0.2, 0.3, 0.5]]}
    none = {"slots": [], "cells": [], "positions": [], "weights": []}
    plan = Plan(keep=keep, positions=pos, merges=[[none, merge]])
    assert plan.merges[0][1]["cells"].tolist() == [[0, 1, 4]]
    with pytest.raises(ValueError, match="latest member"):
        Plan(keep=keep, positions=pos, merges=[[none, dict(merge, cells=[[0, 4, 1]])]])
    with pytest.raises(ValueError, match="sum to 1"):
        Plan(keep=keep, positions=pos, merges=[[none, dict(merge, weights=[[0.5, 0.5, 0.5]])]])


def cell_major(layers):
    """K, V per layer as the state backend gives them: [n, Hkv, d]."""
    return [layer.k.transpose(1, 0, 2) for layer in layers], [layer.v.transpose(1, 0, 2) for layer in layers]


def test_materialize_rows_counts_and_bias():
    plan, layers = merge_plan(seed=3, empty=10, merged=True, budget=55)
    assert (plan.keep[:, 2, :5] == -1).all() and (plan.keep[:, :2] >= 0).all()
    k, v = cell_major(layers)
    counts_in = np.stack([layer.counts for layer in layers])
    k16 = [x.astype(np.float16) for x in k]  # float16 in, float32 out
    k_out, v_out, counts, bias = plan.materialize(k16, v, counts_in)
    assert k_out[0].shape == (plan.n_slots, 3, 16) and k_out[0].dtype == np.float32
    np.testing.assert_array_equal(counts, plan.counts)  # what the scorers planned with
    with np.errstate(divide="ignore"):
        np.testing.assert_array_equal(bias, np.log(counts.astype(np.float32)))
    n_merged = 0
    for il, layer in enumerate(layers):
        for h in range(3):
            m = plan.merges[il][h]
            for j, slot in enumerate(plan.keep[il, h]):
                if slot < 0:  # empty: zeros, count 0, bias -inf
                    assert counts[il, h, j] == 0 and np.isneginf(bias[il, h, j])
                    assert not k_out[il][j, h].any() and not v_out[il][j, h].any()
                elif j not in m["slots"]:  # plain: the row itself
                    np.testing.assert_array_equal(k_out[il][j, h], k16[il][slot, h].astype(np.float32))
                    np.testing.assert_array_equal(v_out[il][j, h], layer.v[h, slot])
                    assert counts[il, h, j] == layer.counts[h, slot]
            for slot, cells, w in zip(m["slots"], m["cells"], m["weights"]):
                cells, w = cells[cells >= 0], w[cells >= 0]
                c = layer.counts[h, cells]
                np.testing.assert_allclose(k_out[il][slot, h], w @ k16[il][cells, h].astype(np.float64), atol=1e-5)
                np.testing.assert_allclose(v_out[il][slot, h], c @ layer.v[h, cells] / c.sum(), rtol=1e-5, atol=1e-6)
                assert counts[il, h, slot] == c.sum() and plan.positions[il, h, slot] == layer.pos_h[h, cells].max()
                n_merged += 1
    assert n_merged > 30


def test_materialize_into_given_arrays_is_materialize():
    # the state backend has the plan's rows gathered straight into the blob llama.cpp loads (out=): the same rows,
    # merged and empty slots included, in the arrays given, and a row outside the cells refused, not wrapped around
    from kvlocal.compress.plan import cell_rows

    plan, layers = merge_plan(seed=4, empty=10, merged=True, budget=55)
    k, v = cell_major(layers)
    k16 = [x.astype(np.float16) for x in k]
    counts_in = np.stack([layer.counts for layer in layers])
    want = plan.materialize(k16, v, counts_in, dtype=None)
    out = ([np.full_like(a, 7) for a in want[0]], [np.full_like(a, 7) for a in want[1]])
    got = plan.materialize(k16, v, counts_in, dtype=None, out=out)
    for mine, theirs, given in zip(got[:2], want[:2], out):
        assert all(a is b for a, b in zip(mine, given))
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[2], want[2])
    with pytest.raises(ValueError, match="dtype=None"):
        plan.materialize(k16, v, counts_in, out=out)
    n = k16[0].shape[0]
    for bad in (n, -1):
        with pytest.raises(IndexError):
            cell_rows(k16[0], np.array([[0, bad]]), np.array([[0, 1]]), out=np.empty((1, 2, 16), np.float16))
        with pytest.raises(IndexError):
            cell_rows(k16[0], np.array([[0, bad if bad > 0 else -10 * n]]), np.array([[0, 1]]))


def reference_cache(plan, il, k_out, v_out, counts, bias) -> LayerKV:
    """Layer ``il`` of a materialized plan as a reference cache (each head's rows at their source positions)."""
    return LayerKV(k=torch.from_numpy(k_out[il].transpose(1, 0, 2).copy()),
                   v=torch.from_numpy(v_out[il].transpose(1, 0, 2).copy()),
                   pos=torch.from_numpy(plan.positions[il].copy()), count=torch.from_numpy(counts[il].copy()),
                   bias=torch.from_numpy(bias[il].copy()))


@pytest.mark.parametrize("method", ["kvslimmer", "meanmerge", "criticalkv+kvslimmer"])
def test_merging_identical_keys_is_lossless(method):
    # every key of a head is the same: a merge (any weights summing to 1) changes nothing for later
    # queries, if the slot keeps the members' mean value and its log(count) bias
    layer = random_layer(seed=9, hkv=2, group=2, n=40, d=8, w=4, same_keys=True, merged=True)
    budget = 14 if method != "criticalkv+kvslimmer" else 20
    plan = plan_layers(make_scorer(method), [layer], budget)
    assert plan.merges is not None
    k, v = cell_major([layer])
    out = plan.materialize(k, v, layer.counts[None])
    merged = reference_cache(plan, 0, *out)
    full, _ = to_reference(layer)
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.standard_normal((4, 6, 8)).astype(np.float32) * 2)
    q_pos = torch.arange(200, 206)
    want = attend(q, q_pos, full)
    if method == "criticalkv+kvslimmer":  # the eviction stage loses tokens: compare with its own cache
        full = LayerKV(*(t.clone() for t in (full.k, full.v, full.pos, full.count, full.bias)))
        ref.CriticalKV(ref.SnapKV(n_sink=N_SINK)).compress(full, to_reference(layer)[1], evict_budget(budget, 0.5))
        want = attend(q, q_pos, full)
    got = attend(q, q_pos, merged)
    assert torch.allclose(got, want, atol=1e-5)
    # negative control: the same slots without their counts (bias 0) are not lossless
    k_out, v_out, counts, bias = out
    assert not torch.allclose(attend(q, q_pos, reference_cache(plan, 0, k_out, v_out, counts, np.where(
        counts > 0, 0, -np.inf).astype(np.float32))), want, atol=1e-2)


def test_merging_near_identical_keys_beats_eviction():
    # smoothly drifting keys: the merged cache's attention output stays close to the full cache's,
    # evicting as many rows instead (SnapKV at the same budget) loses the values
    rng = np.random.default_rng(2)
    layer = random_layer(seed=10, hkv=2, group=2, n=48, d=8, w=4, shared_pos=True)
    order = np.argsort(layer.pos_h, axis=1)
    base, drift = rng.standard_normal((2, 1, 8)), rng.standard_normal((2, 1, 8))
    smooth = (base + 0.02 * np.arange(48)[None, :, None] * drift).astype(np.float32)
    np.put_along_axis(layer.k, order[..., None], smooth, axis=1)
    full, _ = to_reference(layer)
    q = torch.from_numpy(rng.standard_normal((4, 6, 8)).astype(np.float32))
    q_pos = torch.arange(200, 206)
    want = attend(q, q_pos, full)
    errors = {}
    for method in ("kvslimmer", "snapkv"):
        plan = plan_layers(make_scorer(method, **({} if method == "kvslimmer" else {"kernel_size": 1})), [layer], 24)
        out = plan.materialize(*cell_major([layer]), layer.counts[None])
        errors[method] = float((attend(q, q_pos, reference_cache(plan, 0, *out)) - want).norm() / want.norm())
    assert errors["kvslimmer"] < 0.05 and errors["kvslimmer"] < 0.2 * errors["snapkv"], errors


def test_layer_plan_remap():
    merge = {"slots": np.array([1]), "cells": np.array([[0, 2]]), "positions": np.array([[5, 9]]),
             "weights": np.array([[0.4, 0.6]])}
    lp = LayerPlan(keep=np.array([[-1, 2], [0, 1]]), counts=None,
                   merges=[merge, {k: a[:0] for k, a in merge.items()}])
    out = lp.remap(np.array([[7, 8, 9], [3, 4, 5]]))
    assert out.keep.tolist() == [[-1, 9], [3, 4]] and out.merges[0]["cells"].tolist() == [[7, 9]]


# ---------------------------------------------------------------- kernel and registry


@pytest.mark.parametrize("seed", range(5))
def test_greedy_pairs_kernel_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    for m in (0, 1, 2, 3, 10, 301):
        mass = rng.random(m).astype(np.float32)
        mass[rng.random(m) < 0.3] = 0.5  # ties
        for n_pairs in (0, 1, m // 3, m // 2, m):
            np.testing.assert_array_equal(kernels.greedy_pairs(mass, n_pairs), numpy_kernels.greedy_pairs(mass, n_pairs))
            assert kernels.greedy_pairs(mass, n_pairs).tolist() == ref.select_pairs(torch.from_numpy(mass), n_pairs).tolist()
    mass = np.array([5.0, 1, 1, 5, 2, 2, 9])  # pair masses [6, 2, 6, 7, 4, 11]
    assert kernels.greedy_pairs(mass, 3).tolist() == [1, 4]  # every other pair overlaps (1,2) or (4,5)


def test_make_scorer_new_methods():
    assert method_params("adakv") == ["alpha_safeguard", "kernel_size", "max_share", "pooling", "window_size"]
    assert method_params("kvslimmer") == method_params("meanmerge") == []
    assert "merge_ratio" in method_params("criticalkv+kvslimmer") and "epsilon" in method_params("criticalkv+adakv")
    ada = make_scorer("criticalkv+adakv", max_share=1.5, epsilon=1e-3, window_size=16)
    assert ada == AdaKV(CriticalKV(SnapKV(window_size=16), epsilon=1e-3), max_share=1.5)
    both = make_scorer("criticalkv+kvslimmer", merge_ratio=0.25, first_stage_ratio=0.3)
    assert both == EvictThenMerge(CriticalKV(first_stage_ratio=0.3), KVSlimmer(), merge_ratio=0.25)
    assert isinstance(make_scorer("meanmerge"), MeanMerge) and make_scorer("kvslimmer") == KVSlimmer()
    for name, params in (("adakv", {"max_share": 0.5}), ("adakv", {"alpha_safeguard": 2}),
                         ("criticalkv+kvslimmer", {"merge_ratio": -1}), ("kvslimmer", {"n_sink": 32}),
                         ("meanmerge", {"window_size": 8}), ("criticalkv+adakv", {"kernel_size": 4})):
        with pytest.raises(UsageError):
            make_scorer(name, **params)


def test_merging_needs_queries():
    layer = random_layer(seed=0, n=30)
    bare = LayerInputs(k=layer.k, v=layer.v, pos=layer.pos)
    for name in ("kvslimmer", "meanmerge"):
        with pytest.raises(ValueError, match="observation queries"):
            make_scorer(name).plan_layer(bare, 10)
    lp = KVSlimmer().plan_layer(layer, 30)  # nothing to merge: every row kept as it is
    assert lp.merges is None and lp.counts is None and lp.keep.shape == (3, 30) and (lp.keep >= 0).all()
