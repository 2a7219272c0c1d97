"""The recall tier's store (kvlocal.recall.tier): rows in and out byte for byte, Quest's page bounds, the
memory cap (the oldest rows dropped past it, one cap shared by several tiers, the default) and the spill file, a
session's round trip. Pure numpy: no model."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvlocal.errors import UsageError
from kvlocal.units import parse_size
from kvlocal.recall import (CHUNK, PAGE, HostTier, TierMemory, default_recall_mem, recall_mem_setting,
                            tier_figures)

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
    wrong = (np.maximum(q, 0) @ s.kmin[:6].T + np.minimum(q, 0) @ s.kmax[:6].T).max(axis=0)
    assert (wrong < exact.reshape(6, -1).max(axis=0)[::PAGE][:6] - 1e-3).any() or (wrong < bounds - 1e-3).any()


def test_page_bounds_and_index_follow_rows_added_in_pieces():
    # events add a head's rows a few at a time, pages begun by one event are finished by the next, and a
    # restored snapshot truncates: the page bounds stay the exact min/max of each page's keys, and every
    # position stored is found at its row (absent ones: -1)
    rng = np.random.default_rng(5)
    t = tier(n_layer=1, hkv=1)
    s = t.heads[0][0]
    order = rng.permutation(400)
    keys, at = [], 0
    for step in range(30):
        m = int(rng.integers(0, 23))
        k, _ = add(t, rng, 0, 0, np.sort(order[at:at + m]))
        keys.append(k.astype(np.float32))
        at += m
        if step == 12:
            s.index_of(np.array([0]))  # the index is built here, then kept as rows come
        if step == 20:
            mark = t.mark_of()
            n_before = s.n
            k, _ = add(t, rng, 0, 0, np.sort(order[at:at + 9]))
            t.truncate(mark)  # those 9 rows are forgotten
            assert s.n == n_before and (s.index_of(order[at:at + 9]) == -1).all()
    stored = np.concatenate(keys)
    assert s.n == len(stored) == at
    for p in range(s.n_pages):
        page = stored[p * PAGE:(p + 1) * PAGE]
        if p == n_before // PAGE and n_before % PAGE:  # still counts the forgotten rows' keys: a looser bound
            assert (s.kmin[p] <= page.min(axis=0)).all() and (s.kmax[p] >= page.max(axis=0)).all()
            continue
        np.testing.assert_array_equal(s.kmin[p], page.min(axis=0))
        np.testing.assert_array_equal(s.kmax[p], page.max(axis=0))
    ids = s.index_of(np.arange(420))
    np.testing.assert_array_equal(s.pos[ids[ids >= 0]], np.flatnonzero(ids >= 0))
    assert sorted(np.flatnonzero(ids >= 0)) == sorted(order[:at])


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


def test_past_the_cap_the_oldest_rows_go_and_are_counted():
    # a cap of three blocks on one head, rows added in pieces past it: the oldest blocks go, what stays is the newest
    # rows byte for byte, found by position and bounded by their pages; what went is counted; a mark taken before a
    # block went still truncates to the rows stored before it
    rng = np.random.default_rng(3)
    row = 2 * D * 2
    t = tier(n_layer=1, hkv=1, mem_limit=3 * CHUNK * row)
    s = t.heads[0][0]
    total, ks, vs = 5 * CHUNK + 37, [], []
    for a in range(0, total, 100):
        if a == 4 * CHUNK - 24:
            mark, last, base = t.mark_of(), a - 1, s.base
        k, v = add(t, rng, 0, 0, np.arange(a, min(a + 100, total)))
        ks.append(k), vs.append(v)
    k, v = np.concatenate(ks), np.concatenate(vs)
    assert t.pool.ram_bytes <= 3 * CHUNK * row and t.pool.memory.used <= 3 * CHUNK * row
    assert s.n + t.cap_dropped_rows == total and t.cap_dropped_rows % CHUNK == 0 and t.cap_dropped_rows >= 2 * CHUNK
    assert t.dropped_rows == 0 and s.base == t.cap_dropped_rows
    kept = np.arange(total - s.n, total)
    np.testing.assert_array_equal(s.pos[:s.n], kept)
    got_k, got_v = s.rows(np.arange(s.n))
    np.testing.assert_array_equal(got_k, k[kept])
    np.testing.assert_array_equal(got_v, v[kept])
    np.testing.assert_array_equal(s.index_of(kept), np.arange(s.n))
    assert (s.index_of(np.arange(total - s.n)) == -1).all()
    for p in range(s.n_pages):
        page = k[kept][p * PAGE:(p + 1) * PAGE].astype(np.float32)
        np.testing.assert_array_equal(s.kmin[p], page.min(axis=0))
        np.testing.assert_array_equal(s.kmax[p], page.max(axis=0))
    f = tier_figures(t)
    assert (f["host_tier_cap"], f["host_tier_past_cap"], f["host_tier_dropped_rows"]) == (
        3 * CHUNK * row, "drop_oldest", t.cap_dropped_rows) and f["host_tier_cap_used"] <= f["host_tier_cap"]
    u = tier(n_layer=1, hkv=1, mem_limit=3 * CHUNK * row)  # a saved session's round trip keeps the numbering
    u.load_arrays(t.to_arrays())
    np.testing.assert_array_equal(u.mark_of(), t.mark_of())
    np.testing.assert_array_equal(u.heads[0][0].rows(np.arange(s.n))[0], got_k)
    assert s.base > base  # a block went after the mark
    t.truncate(mark)
    assert s.pos[:s.n].max() == last and s.n == last + 1 - s.base


def test_tiers_sharing_one_memory_stay_under_its_cap_oldest_first():
    # a server's conversations share one cap: a tier that needs room takes the oldest block of all (here another
    # tier's), and a closed tier's blocks go to the next that asks, none dropped for them
    rng = np.random.default_rng(6)
    block = CHUNK * 2 * D * 2
    memory = TierMemory(4 * block)
    a, b = tier(1, 1, mem_limit=memory), tier(1, 1, mem_limit=memory)
    add(a, rng, 0, 0, np.arange(3 * CHUNK))
    add(b, rng, 0, 0, np.arange(2 * CHUNK))
    assert memory.used == 4 * block and a.heads[0][0].n == 2 * CHUNK and b.heads[0][0].n == 2 * CHUNK
    assert (a.cap_dropped_rows, b.cap_dropped_rows) == (CHUNK, 0) and a.heads[0][0].pos[0] == CHUNK
    assert tier_figures(b)["host_tier_cap_used"] == 4 * block
    b.close()
    add(a, rng, 0, 0, np.arange(3 * CHUNK, 5 * CHUNK))
    assert memory.used == 4 * block and a.heads[0][0].n == 4 * CHUNK and a.cap_dropped_rows == CHUNK
    unlimited = TierMemory()
    c = tier(1, 1, mem_limit=unlimited)
    add(c, rng, 0, 0, np.arange(5 * CHUNK))
    assert c.heads[0][0].n == 5 * CHUNK and c.cap_dropped_rows == 0 and tier_figures(c)["host_tier_past_cap"] is None


def test_rows_an_open_turn_needs_are_held_from_the_cap():
    # while a turn may be undone its tier keeps what the undo reads back: the rows stored since it began and those
    # stored before that left the device again since (here row 5, in the oldest block); past the cap the event's
    # own rows are dropped instead, counted where the undo looks (dropped_rows); released, the oldest block goes
    rng = np.random.default_rng(7)
    t = tier(n_layer=1, hkv=1, mem_limit=3 * CHUNK * 2 * D * 2)
    s = t.heads[0][0]
    add(t, rng, 0, 0, np.arange(2 * CHUNK))
    t.hold([t.mark_of()])
    t.mark(0, 0, np.array([5]))  # row 5 comes back, then leaves again: an undo brings it back from here
    add(t, rng, 0, 0, np.array([5]))
    add(t, rng, 0, 0, np.arange(2 * CHUNK, 3 * CHUNK))
    add(t, rng, 0, 0, np.arange(3 * CHUNK, 4 * CHUNK))
    assert (s.n, s.base, t.cap_dropped_rows, t.dropped_rows) == (3 * CHUNK, 0, CHUNK, CHUNK)
    t.hold([])
    add(t, rng, 0, 0, np.arange(3 * CHUNK, 4 * CHUNK))
    assert (s.n, s.base, s.pos[0]) == (3 * CHUNK, CHUNK, CHUNK) and t.cap_dropped_rows == 2 * CHUNK
    t.mark(0, 0, np.array([3]))  # rows on the device when a turn begins are not held: they are stored again if they leave
    t.hold([t.mark_of()])
    add(t, rng, 0, 0, np.arange(4 * CHUNK, 5 * CHUNK))
    assert s.base == 2 * CHUNK and t.cap_dropped_rows == 3 * CHUNK - 1  # (row 3 was on the device)


def test_the_default_cap_is_a_share_of_the_machines_memory():
    from kvlocal.recall.memory import RECALL_MEM_MAX, RECALL_MEM_SHARE, machine_memory

    ram = machine_memory()
    assert default_recall_mem() == (RECALL_MEM_MAX if ram is None else min(ram // RECALL_MEM_SHARE, RECALL_MEM_MAX))
    if os.path.exists("/proc/meminfo"):  # the machine's memory as the kernel tells it, a container's limit at most
        total = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) * 1024
        assert 0 < ram <= total
    assert TierMemory.of(None).limit == default_recall_mem() and TierMemory.of("none").limit is None
    assert TierMemory.of("64M").limit == 64 << 20 and TierMemory.of(1 << 20).limit == 1 << 20
    shared = TierMemory(1 << 20)
    assert TierMemory.of(shared) is shared and recall_mem_setting(shared) == 1 << 20
    assert recall_mem_setting(" None ") == "none" and recall_mem_setting(None) is None
    from kvlocal.errors import worded
    from kvlocal.settings import flag_name

    for bad in ("0", "lots", 0, -5):  # the field named; the command line words it as the flag
        with pytest.raises(UsageError, match="^recall_mem .*none for no limit") as e:
            recall_mem_setting(bad)
        assert worded(e.value, flag_name).startswith("--recall-mem ")


def test_ram_chunks_come_from_slabs_no_larger_than_the_cap():
    # chunks are cut from slabs (fewer page faults), each chunk its own bytes; a slab never holds more address space
    # than the cap leaves, and without a cap chunks share a slab
    from kvlocal.recall.memory import Pool

    size = 1000
    capped = Pool(TierMemory(3 * size + 10))
    chunks = [capped.alloc(size) for _ in range(3)]
    assert capped.ram_bytes == 3 * size and capped.memory._slab.nbytes <= capped.memory.limit
    for i, c in enumerate(chunks):
        c[:] = i
    assert [int(c[0]) for c in chunks] == [0, 1, 2] and all((c == i).all() for i, c in enumerate(chunks))
    free = Pool()
    a, b = free.alloc(size), free.alloc(size)
    assert a.base is b.base is not None and free.ram_bytes == 2 * size


@pytest.mark.skipif(not (hasattr(__import__("mmap"), "MAP_POPULATE") and os.path.exists("/proc/self/statm")),
                    reason="no MAP_POPULATE or /proc on this platform")
def test_a_slab_is_mapped_before_its_chunks_are_written():
    # the rows an event stores land in memory mapped when its slab was made (one system call), not page by page as
    # they are first written: the process's resident memory grows by the slab when the first chunk is cut from it
    from kvlocal.recall.memory import SLAB, Pool

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    pool, size = Pool(), SLAB // 8
    before = resident()
    chunks = [pool.alloc(size)]
    assert resident() - before >= SLAB * 3 // 4
    chunks += [pool.alloc(size) for _ in range(7)]
    assert pool.ram_bytes == SLAB and all(c.base is chunks[0].base for c in chunks)
    for i, c in enumerate(chunks):
        c.fill(i)
    assert all((c == i).all() for i, c in enumerate(chunks))


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
            np.testing.assert_array_equal(s.kmax[:s.n_pages], r.kmax[:r.n_pages])
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
    from kvlocal.kernels import page_candidates

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
        got = page_candidates(q, s.kmin, s.kmax, s.on_device[:s.n], PAGE, n_want)
        np.testing.assert_array_equal(got, want)
        checked += len(want) > 0
    assert checked > 20


def test_bench_tier_stores_every_row_of_its_events(capsys):
    # tools/bench_tier (the tier's storing of an event's evicted rows, timed) runs and prints its figure, and what it
    # times is the tier's own add, once per head and event with every row
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tools import bench_tier

    seen = []
    real = HostTier.add

    def counted(self, layer, head, pos, *a):
        seen.append((layer, head, len(pos)))
        return real(self, layer, head, pos, *a)

    HostTier.add = counted
    try:
        reserve, add = bench_tier.run(layers=2, heads=3, rows=40, events=3, d=D)
    finally:
        HostTier.add = real
    assert sorted(seen) == sorted((l, h, 40) for l in range(2) for h in range(3) for _ in range(3))
    assert reserve >= 0 and add > 0
    bench_tier.main(["--layers", "2", "--heads", "2", "--rows", "20", "--events", "2", "--repeat", "1",
                     "--head-dim", str(D)])
    out = capsys.readouterr().out
    assert re.search(r"first tier .* storing +\d+\.\d+", out) and re.search(r"best of 1 more .* storing +\d+\.\d+", out)


@pytest.mark.parametrize("shuffled", [False, True], ids=["cells in position order", "positions out of order"])
def test_evicted_rows_are_the_device_rows_a_plan_drops_in_position_order(shuffled):
    # what an event sends to the tier: every device row the plan does not keep (not the empty ones, not rows that came
    # from the tier for the event), per layer grouped by head, each head's in rising position — whether the cells hold
    # rising positions (after a compaction) or not (a recall union: the tier's candidates after the device's cells)
    from types import SimpleNamespace

    from kvlocal.recall.select import evicted

    rng = np.random.default_rng(8)
    n_layer, hkv, n, width = 3, 2, 40, 25
    true = np.stack([np.stack([rng.permutation(1000)[:n] if shuffled else np.sort(rng.permutation(1000)[:n])
                               for _ in range(hkv)]) for _ in range(n_layer)])
    true[rng.random(true.shape) < 0.1] = -1  # empty rows
    tier_ids = np.where(rng.random(true.shape) < 0.2, rng.integers(0, 50, true.shape), -1)
    keep = np.stack([np.stack([np.where(rng.random(width) < 0.2, -1, np.sort(rng.choice(n, width, replace=False)))
                               for _ in range(hkv)]) for _ in range(n_layer)])
    for ids in (tier_ids, None):
        got = evicted(SimpleNamespace(true=true, tier_ids=ids), SimpleNamespace(keep=keep, n_layer=n_layer))
        assert len(got) == n_layer
        for l, (cells, heads) in enumerate(got):
            assert np.all(np.diff(heads) >= 0)
            for h in range(hkv):
                kept = set(keep[l, h][keep[l, h] >= 0].tolist())
                want = [c for c in range(n) if true[l, h, c] >= 0 and c not in kept and (ids is None or ids[l, h, c] < 0)]
                mine = cells[heads == h]
                assert sorted(mine.tolist()) == want
                assert np.all(np.diff(true[l, h, mine]) > 0)
