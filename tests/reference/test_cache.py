"""Properties of the explicit KV cache object that the compression ops rely on."""

import math

from policy import need

torch = need("torch")  # the PyTorch reference: skip locally, fail under CI

from kvlocal.reference.cache import LayerKV, attend


def make_kv(k, v, pos=None):
    kv = LayerKV.empty(k.shape[0], k.shape[2])
    kv.append(k, v, torch.arange(k.shape[1]) if pos is None else pos)
    return kv


def random_queries(n_head, n, d, start, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_head, n, d, generator=g), torch.arange(start, start + n)


def test_merged_identical_pair_is_lossless():
    """Two tokens with the same key == one slot with that key, the mean value, count 2 and bias log 2."""
    torch.manual_seed(0)
    hkv, hq, s, d = 2, 4, 6, 8
    k, v = torch.randn(hkv, s, d), torch.randn(hkv, s, d)
    k[:, 3] = k[:, 2]
    full = make_kv(k, v)

    merged = make_kv(k, v)
    merged.gather(torch.tensor([0, 1, 2, 4, 5]).expand(hkv, -1))
    merged.v[:, 2] = (v[:, 2] + v[:, 3]) / 2
    merged.pos[:, 2] = 3  # the later member's position
    count = torch.ones(hkv, 5, dtype=torch.int64)
    count[:, 2] = 2
    merged.set_counts(count)
    assert torch.allclose(merged.bias[:, 2], torch.tensor(math.log(2)))

    q, q_pos = random_queries(hq, 5, d, start=s)
    assert torch.allclose(attend(q, q_pos, full), attend(q, q_pos, merged), atol=1e-6)


def test_log_count_bias_equals_asymkv_count_weighted_softmax():
    """softmax(s + log l) · v_mean == sum_j exp(s_j) v_sum_j / sum_i l_i exp(s_i) (docs/algorithms.md)."""
    torch.manual_seed(1)
    s, d = 5, 4
    k, v = torch.randn(1, s, d), torch.randn(1, s, d)
    count = torch.tensor([[1, 3, 1, 2, 4]])
    kv = make_kv(k, v)
    kv.set_counts(count)
    q, q_pos = random_queries(1, 3, d, start=s)
    logits = q[0] @ k[0].T / math.sqrt(d)  # [3, S]
    v_sum = v[0] * count[0, :, None]
    expected = (logits.exp() @ v_sum) / (logits.exp() * count[0]).sum(-1, keepdim=True)
    assert torch.allclose(attend(q, q_pos, kv)[0], expected, atol=1e-6)


def test_neg_inf_bias_equals_removing_the_slot():
    torch.manual_seed(2)
    hkv, hq, s, d = 2, 4, 7, 8
    k, v = torch.randn(hkv, s, d), torch.randn(hkv, s, d)
    q, q_pos = random_queries(hq, 3, d, start=s)

    removed = make_kv(k, v)
    removed.gather(torch.tensor([0, 1, 2, 3, 5, 6]).expand(hkv, -1))
    expected = attend(q, q_pos, removed)

    biased = make_kv(k, v)
    biased.bias[:, 4] = -math.inf  # only the bias: position and count untouched
    assert torch.allclose(attend(q, q_pos, biased), expected, atol=1e-6)

    cleared = make_kv(k, v)
    cleared.clear(torch.arange(s).expand(hkv, -1) == 4)
    assert torch.allclose(attend(q, q_pos, cleared), expected, atol=1e-6)


def test_each_head_attends_over_its_own_kept_set():
    """Different kept sets per KV head: each query head's output equals attention over that head's
    subset computed on its own (GQA: query head h reads KV head h // G)."""
    torch.manual_seed(3)
    hkv, group, s, d = 2, 2, 8, 4
    k, v = torch.randn(hkv, s, d), torch.randn(hkv, s, d)
    keep = [torch.tensor([0, 2, 5]), torch.tensor([1, 3, 4, 6, 7])]

    kv = make_kv(k, v)
    idx = torch.zeros(hkv, 5, dtype=torch.int64)
    pad = torch.zeros(hkv, 5, dtype=torch.bool)
    for h, r in enumerate(keep):
        idx[h, : len(r)] = r
        pad[h, len(r):] = True
    kv.gather(idx)
    kv.clear(pad)

    q, q_pos = random_queries(hkv * group, 3, d, start=s)
    out = attend(q, q_pos, kv)
    for h in range(hkv * group):
        r = keep[h // group]
        alone = make_kv(k[h // group, r][None], v[h // group, r][None], r)
        assert torch.allclose(out[h], attend(q[h : h + 1], q_pos, alone)[0], atol=1e-6)


def test_causality_by_position_not_slot_order():
    """A query at position p sees rows with pos <= p wherever they are stored."""
    torch.manual_seed(4)
    s, d = 6, 4
    k, v = torch.randn(1, s, d), torch.randn(1, s, d)
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    shuffled = make_kv(k[:, perm], v[:, perm], perm)
    prefix = make_kv(k[:, :4], v[:, :4])
    q, _ = random_queries(1, 1, d, start=0)
    q_pos = torch.tensor([3])
    assert torch.allclose(attend(q, q_pos, shuffled), attend(q, q_pos, prefix), atol=1e-6)
