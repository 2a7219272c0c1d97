"""The recall tier's store (kvlocal.recall.tier): rows in and out byte for byte, Quest's page bounds, the
memory cap and the spill file, a session's round trip. Pure numpy: no model."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvlocal.errors import UsageError
from kvlocal.recall import CHUNK, PAGE, HostTier, parse_size

D = 8


def tier(n_layer=2, hkv=2, **kw) -> HostTier:
    return HostTier(n_layer, hkv, (np.float16, (D,)), (np.float16, (D,)), D, **kw)


def rows(rng, m):
    k = rng.standard_normal((m, D)).astype(np.float16)
    v = rng.standard_normal((m, D)).astype(np.float16)
    return k, v


def add(t, rng, layer, head, pos, vnorm=None):
    k, v = rows(rng, len(pos))
    t.reserve(np.full((len(t.heads), len(t.heads[0])), len(pos)))
    t.add(layer, head, np.asarray(pos), k, v, k.astype(np.float32),
          np.full(len(pos), np.nan, np.float32) if vnorm is None else vnorm)
    return k, v


def test_rows_come_back_byte_for_byte_and_each_token_is_stored_once():
    rng = np.random.default_rng(0)
    t = tier()
    k, v = add(t, rng, 1, 0, np.arange(10, 50))
    s = t.heads[1][0]
    ids = s.index_of(np.array([12, 49, 10, 7]))
    assert ids[-1] == -1 and list(s.pos[ids[:3]]) == [12, 49, 10]
    got_k, got_v = s.rows(ids[:3])
    np.testing.assert_array_equal(got_k, k[[2, 39, 0]])
    np.testing.assert_array_equal(got_v, v[[2, 39, 0]])
    t.mark(1, 0, ids[:3])
    assert s.on_device[ids[:3]].all() and t.rows_in == 3
    add(t, rng, 1, 0, np.array([12, 60]))  # 12 leaves again: flagged, not stored twice
    assert s.n == 41 and not s.on_device[ids[0]] and t.rows_out == 41
    assert t.heads[0][0].n == 0 and t.n_rows == 41


def test_page_bounds_bound_every_key_of_the_page_and_are_reached():
    rng = np.random.default_rng(1)
    t = tier()
    k, _ = add(t, rng, 0, 1, np.arange(5 * PAGE + 3))
    s = t.heads[0][1]
    q = rng.standard_normal((6, D)).astype(np.float32)
    bounds = s.page_bounds(q)
    assert len(bounds) == s.n_pages == 6
    exact = q @ k.astype(np.float32).T  # [6, n]
    for p in range(s.n_pages):
        best = exact[:, p * PAGE:(p + 1) * PAGE].max()
        assert bounds[p] >= best - 1e-4
    # the negative control: min and max swapped is not a bound
    kmin, kmax = s.bounds()
    wrong = (np.maximum(q, 0) @ kmin.T + np.minimum(q, 0) @ kmax.T).max(axis=0)
    assert (wrong < exact.reshape(6, -1).max(axis=0)[::PAGE][:6] - 1e-3).any() or (wrong < bounds - 1e-3).any()


def assert_pages_of_the_rows(s, stored: np.ndarray) -> None:
    """Head ``s``'s pages are what a tier given its rows (keys ``stored``, by row id) at once, and told to sort as
    many, has: the first ``sorted_rows`` in position order, then the rest as they came, each page bounded by the
    exact min/max of its keys."""
    n, size = len(stored), s.sorted_rows
    fresh = tier(n_layer=1, hkv=1)
    fresh.reserve(np.array([[n]]))
    fresh.add(0, 0, s.pos[:n], stored, stored, stored.astype(np.float32), np.full(n, np.nan, np.float32))
    fresh.truncate(np.array([[[n, size]]]))
    pages = s.page_order()
    np.testing.assert_array_equal(pages, fresh.heads[0][0].page_order())
    assert sorted(pages[:size]) == list(range(size)) and (np.diff(s.pos[pages[:size]]) > 0).all()
    np.testing.assert_array_equal(pages[size:], np.arange(size, n))
    kmin, kmax = s.bounds()
    for p in range(s.n_pages):
        page = stored[pages[p * PAGE:(p + 1) * PAGE]].astype(np.float32)
        np.testing.assert_array_equal(kmin[p], page.min(axis=0))
        np.testing.assert_array_equal(kmax[p], page.max(axis=0))


def test_pages_are_a_function_of_the_rows_added_in_pieces():
    # events add a head's rows a few at a time (pages begun by one event are finished by the next), questions
    # sort the pages, swaps read them at any moment, and a restored snapshot truncates: whatever the history,
    # the pages are those of the rows and the mark alone (assert_pages_of_the_rows), and every position stored
    # is found at its row (absent: -1)
    rng = np.random.default_rng(5)
    t = tier(n_layer=1, hkv=1)
    s = t.heads[0][0]
    order = rng.permutation(900)
    keys, at = [], 0
    for step in range(40):
        m = int(rng.integers(0, 30))
        k, _ = add(t, rng, 0, 0, np.sort(order[at:at + m]))
        keys.append(k)
        at += m
        if step == 12:
            s.index_of(np.array([0]))  # the index is built here, then kept as rows come
        if rng.random() < 0.3:
            t.order_pages()  # a question
        if step in (15, 30):
            mark, n_before, undone = t.mark_of(), s.n, 40 if step == 15 else 9
            k, v = rows(rng, undone)  # keys outside every other's range, sorted or not, read, then undone
            t.reserve(np.array([[undone]]))
            t.add(0, 0, np.sort(order[at:at + undone]), 8 * k, v, 8 * k.astype(np.float32), np.full(undone, np.nan, np.float32))
            if step == 15:
                t.order_pages()
            s.page_order()
            t.truncate(mark)
            assert s.n == n_before and (s.index_of(order[at:at + undone]) == -1).all()
            np.testing.assert_array_equal(t.mark_of(), mark)
        if rng.random() < 0.3 or step in (15, 30):
            assert_pages_of_the_rows(s, np.concatenate(keys))  # as a swap reads them now
    assert s.n == at and 0 < s.sorted_rows < at
    assert_pages_of_the_rows(s, np.concatenate(keys))
    ids = s.index_of(np.arange(920))
    np.testing.assert_array_equal(s.pos[ids[ids >= 0]], np.flatnonzero(ids >= 0))
    assert sorted(np.flatnonzero(ids >= 0)) == sorted(order[:at])


def test_a_span_that_left_at_different_events_is_one_page():
    # a fact's rows leave the device at different events, between other text's rows: in leaving order they sit
    # in several pages of mixed rows; sorted for a question, the span is one page, and it alone is the candidate
    rng = np.random.default_rng(8)
    t = tier(n_layer=1, hkv=1)
    s = t.heads[0][0]
    q = np.zeros((1, D), np.float32)
    q[0, 0] = 1
    span = np.arange(10 * PAGE, 11 * PAGE)  # positions of the fact, page-aligned
    other = np.setdiff1d(np.arange(30 * PAGE), span)
    rng.shuffle(other)
    for part, pos in enumerate(np.array_split(other, 8)):
        fact = span[part::8]  # two of the fact's rows leave with each event
        pos = np.sort(np.concatenate([pos, fact]))
        k, v = rows(rng, len(pos))
        k[:, 0] = np.where(np.isin(pos, span), 8, -1)  # only the fact's keys answer q
        t.reserve(np.array([[len(pos)]]))
        t.add(0, 0, pos, k, v, k.astype(np.float32), np.full(len(pos), np.nan, np.float32))
    before = s.candidates(q, PAGE)  # leaving order: eight pages hold it, with other rows
    assert len(np.unique(s.page_of(s.index_of(span)))) == 8 and not set(span) <= set(s.pos[before])
    t.order_pages()
    got = s.candidates(q, PAGE)
    assert sorted(s.pos[got]) == list(span) and len(np.unique(s.page_of(got))) == 1


def test_truncate_and_sync_follow_a_restored_engine():
    rng = np.random.default_rng(2)
    t = tier(n_layer=1, hkv=1)
    add(t, rng, 0, 0, np.arange(20))
    mark = t.mark_of()
    add(t, rng, 0, 0, np.arange(20, 30))
    t.truncate(mark)
    assert t.heads[0][0].n == 20
    t.sync(np.array([[[3, 4, -1, 100]]]))
    assert list(np.flatnonzero(t.heads[0][0].on_device[:20])) == [3, 4]


def test_memory_cap_drops_what_does_not_fit_and_counts_it():
    rng = np.random.default_rng(3)
    row = 2 * D * 2
    t = tier(n_layer=1, hkv=2, mem_limit=CHUNK * row + 1)  # one block: head 0's, head 1 gets none
    add(t, rng, 0, 0, np.arange(10))
    add(t, rng, 0, 1, np.arange(10))
    assert t.heads[0][0].n == 10 and t.heads[0][1].n == 0 and t.dropped_rows == 10
    add(t, rng, 0, 0, np.arange(10, CHUNK + 5))
    assert t.heads[0][0].n == CHUNK and t.dropped_rows == 15 and t.pool.ram_bytes == CHUNK * row


def test_spill_file_takes_what_ram_does_not(tmp_path):
    rng = np.random.default_rng(4)
    t = tier(n_layer=1, hkv=1, mem_limit=CHUNK * 2 * D * 2, spill_dir=tmp_path)
    k, v = add(t, rng, 0, 0, np.arange(3 * CHUNK))
    s = t.heads[0][0]
    assert s.n == 3 * CHUNK and t.dropped_rows == 0
    assert t.pool.file_bytes == 2 * CHUNK * 2 * D * 2 and t.pool.ram_bytes == CHUNK * 2 * D * 2 and t.nbytes > t.pool.nbytes
    got_k, got_v = s.rows(np.arange(s.n))
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    assert os.listdir(tmp_path) == []  # the file is unlinked at once: nothing is left behind
    t.close()


def test_bad_settings_are_one_clear_error(tmp_path):
    with pytest.raises(UsageError, match="below one block"):
        tier(mem_limit=100)
    with pytest.raises(UsageError, match="no such folder"):
        tier(mem_limit=CHUNK * 64, spill_dir=tmp_path / "missing")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root writes anywhere but in sysfs
        ro = "/sys"
    try:
        with pytest.raises(UsageError, match="not writable"):
            tier(mem_limit=CHUNK * 64, spill_dir=ro)
    finally:
        (tmp_path / "ro").chmod(0o700)
    assert parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == int(1.5 * (1 << 30)) and parse_size("4096") == 4096
    for bad in ("lots", "-1G", "0"):
        with pytest.raises(UsageError, match="--recall-mem"):
            parse_size(bad)


def test_a_saved_tier_loads_back_identical():
    rng = np.random.default_rng(5)
    t = tier()
    add(t, rng, 0, 1, np.arange(40), vnorm=np.arange(40, dtype=np.float32))
    add(t, rng, 1, 0, np.arange(7))
    for i, part in enumerate(np.array_split(rng.permutation(300), 5)):  # pages in position order, then a tail
        add(t, rng, 1, 1, np.sort(part))
        if i == 2:
            t.order_pages()
    t.mark(0, 1, np.array([3, 4]))
    a = t.to_arrays()
    u = tier()
    u.load_arrays(a)
    for l in range(2):
        for h in range(2):
            s, r = t.heads[l][h], u.heads[l][h]
            assert s.n == r.n
            np.testing.assert_array_equal(s.pos[:s.n], r.pos[:r.n])
            np.testing.assert_array_equal(s.on_device[:s.n], r.on_device[:r.n])
            np.testing.assert_array_equal(s.rows(np.arange(s.n))[1], r.rows(np.arange(r.n))[1])
            np.testing.assert_array_equal(s.page_order(), r.page_order())
            for b, c in zip(s.bounds(), r.bounds()):
                np.testing.assert_array_equal(b, c)
    with pytest.raises(UsageError, match="does not fit"):
        tier(hkv=3).load_arrays(a)


def test_device_table_is_membership_per_layer_and_head():
    # with_candidates asks, for every head, which candidate positions the device holds: the table must say
    # exactly what np.isin says per head (empty rows, positions past the device's, heads that differ)
    from kvlocal.recall.select import device_table

    rng = np.random.default_rng(5)
    for _ in range(20):
        n_layer, hkv, n = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(0, 40))
        true = rng.integers(-1, 60, (n_layer, hkv, n))
        held = device_table(true)
        for l in range(n_layer):
            for h in range(hkv):
                pos = rng.integers(0, 90, int(rng.integers(0, 30)))
                want = np.isin(pos, true[l, h][true[l, h] >= 0])
                np.testing.assert_array_equal(held(l, h, pos), want)


def test_page_candidates_are_the_numpy_steps():
    # kvl_page_candidates (one call per head) against the steps it replaced: Quest's bounds (page_bounds), the
    # pages with a row off the device ranked by bound (stable), taken until n_want rows, their rows off the device
    from kvlocal.compress.kernels import page_candidates

    rng = np.random.default_rng(9)
    checked = 0
    for _ in range(40):
        t = tier(1, 1)
        s = t.heads[0][0]
        n = int(rng.integers(1, 12 * PAGE))
        add(t, rng, 0, 0, rng.permutation(4 * n)[:n])
        s.on_device[:s.n] = rng.random(s.n) < rng.choice([0.0, 0.5, 0.95])
        q = rng.standard_normal((int(rng.integers(1, 6)), D)).astype(np.float32)
        n_want = int(rng.integers(1, n + 5))
        bounds = s.page_bounds(q)
        off = np.add.reduceat((~s.on_device[:s.n]).astype(np.int64), np.arange(0, s.n, PAGE))
        pages = np.flatnonzero(off > 0)
        order = pages[np.argsort(-bounds[pages], kind="stable")]
        taken = np.sort(order[:int(np.searchsorted(np.cumsum(off[order]), n_want)) + 1])
        ids = (taken[:, None] * PAGE + np.arange(PAGE)).reshape(-1)
        ids = ids[ids < s.n]
        want = ids[~s.on_device[ids]]
        got = page_candidates(q, *s.bounds(), s.on_device[:s.n], PAGE, n_want)
        np.testing.assert_array_equal(got, want)
        checked += len(want) > 0
    assert checked > 20
