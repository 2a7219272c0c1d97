"""Re-selection for a new question: the device cells and the host tier's rows, scored together.

When a question arrives its tokens are the observation the earlier evictions never had. Per compressed
layer and KV head:

1. **candidates** — the tier's pages are ranked by Quest's bound on ``q·k`` over the question's queries
   (:meth:`~kvlocal.recall.tier.HeadStore.page_bounds`, no row read), and the best pages are taken until
   they hold ``n_rows`` rows not on the device now;
2. **union** — those rows join the device cells as extra rows of the cache being compressed
   (:func:`with_candidates`): the configured method then scores device and candidate rows with one
   softmax and one pooling along positions (a fact's neighbouring tokens rank together), and keeps each
   head's budget of the union — AdaKV's head budgets apply to the union;
3. **swap** — the plan is applied as any event's: rows it keeps from the tier come in, device rows it
   drops go out to the tier (:func:`store_evicted`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kvlocal.kernels import page_candidates
from kvlocal.recall.tier import PAGE, HostTier


@dataclass
class Candidates:
    """Tier rows that join the union: ``ids[l][h]`` row ids of layer ``l``, KV head ``h`` (they become the
    union's cells ``n_device + j``); ``width``: the most any head has."""

    ids: list[list[np.ndarray]]
    width: int

    @property
    def n_rows(self) -> int:
        return sum(len(i) for layer in self.ids for i in layer)


def choose_candidates(tier: HostTier, q: list[np.ndarray], n_rows: int) -> Candidates:
    """Per layer and KV head, the tier rows of the best pages by bound, until ``n_rows`` rows off the
    device. ``q``: per compressed layer the observation queries ``[Hq, w, d]``, scaled and in the keys'
    basis (query head ``h`` reads KV head ``h // G``)."""
    ids = []
    for layer, ql in zip(tier.heads, q):
        group = ql.shape[0] // len(layer)
        per_head = []
        for h, s in enumerate(layer):  # (HeadStore.page_bounds is the bound in numpy)
            q_head = ql[h * group:(h + 1) * group].reshape(-1, ql.shape[-1])
            per_head.append(page_candidates(q_head, s.kmin, s.kmax, s.on_device[:s.n], PAGE, n_rows) if s.n
                            else np.zeros(0, np.int64))
        ids.append(per_head)
    return Candidates(ids, max((len(i) for layer in ids for i in layer), default=0))


def with_candidates(read, tier: HostTier, cands: Candidates, backend, span: str = "row"):
    """``read`` extended by ``backend`` (:meth:`~kvlocal.backends.KVBackend.extend`) with the candidates as
    ``cands.width`` more cells: per layer, head ``h``'s ``j``-th candidate sits in new cell ``j``, rows a
    head has no candidate for are empty (position -1, count 0). ``tier_ids`` says which rows came from
    the tier, by their numbers (``HeadStore.base + id``: a row keeps its number while older ones are dropped to
    make room for the rows this plan evicts). ``span="page"``: a tier page's rows rank together (its best row's
    score), so a fact comes back whole or not at all; ``"row"``: each row on its own score.

    Returns ``(union, values)``. The candidates' keys are all copied (the scorers read every one), their values
    only where the tier knows no value norm (a scorer computes it from them): call ``values(plan)`` before the plan
    is applied, and it copies in the values of the candidates ``plan`` keeps — an answer step scores four budgets
    of candidates and keeps about a tenth of them."""
    n_layer, hkv = read.true.shape[:2]
    held = device_table(read.true)  # a row the device holds is never a candidate (its flag is set right here)
    for l in range(n_layer):
        for h, ids in enumerate(cands.ids[l]):
            here = held(l, h, tier.heads[l][h].pos[ids])
            if here.any():
                tier.heads[l][h].on_device[ids[here]] = True
                cands.ids[l][h] = ids[~here]
    cands.width = m = max((len(i) for layer in cands.ids for i in layer), default=0)
    true = np.full((n_layer, hkv, m), -1, np.int64)
    vnorm = np.full((n_layer, hkv, m), np.nan, np.float32)
    count = np.zeros((n_layer, hkv, m), np.int64)
    tier_ids = np.full((n_layer, hkv, m), -1, np.int64)
    union, k_new, v_new = backend.extend(read, m)  # new rows uninitialized: each is written below
    for v in v_new:  # the scorers read an F16 cache's values only where a norm is computed, any other format's whole
        if v.dtype != np.float16:  # (converted, or decoded: CacheBasis.values): there the rows not copied are zero
            v[...] = 0  # (zero bytes are a zero row in every format)
    for l in range(n_layer):
        for h, ids in enumerate(cands.ids[l]):
            s, c = tier.heads[l][h], len(ids)
            s.rows_into(ids, k_new[l][:c, h], None)
            k_new[l][c:, h] = 0  # the empty rows' keys (the scorers read every key; their values are never read)
            norms = vnorm[l, h, :c] = s.vnorm[ids]
            true[l, h, :c], count[l, h, :c], tier_ids[l, h, :c] = s.pos[ids], 1, ids + s.base
            unknown = np.flatnonzero(np.isnan(norms))
            if len(unknown):
                v_new[l][unknown, h] = s.values(ids[unknown])

    def values(plan) -> None:
        for l in range(n_layer):
            for h, ids in enumerate(cands.ids[l]):
                keep = plan.keep[l, h]
                j = keep[keep >= read.n] - read.n
                j = j[~np.isnan(vnorm[l, h, j])]  # (the others' values were copied above)
                if len(j):
                    v_new[l][j, h] = tier.heads[l][h].values(ids[j])

    def join(device, new):
        return np.concatenate([device, new], axis=2)

    device_ids = np.full(read.true.shape, -1, np.int64)
    groups = None
    if span == "page":
        groups = join(device_ids, np.where(tier_ids >= 0, tier_ids // PAGE, -1))
    return dataclasses.replace(union, true=join(read.true, true), vnorm=join(read.vnorm, vnorm),
                               count=join(read.count, count), groups=groups,
                               tier_ids=join(device_ids, tier_ids)), values


def device_table(true: np.ndarray):
    """``held(l, h, pos)``: which of the positions ``pos`` layer ``l``'s KV head ``h`` holds, for the rows' true
    positions ``true`` ``[n_layer, Hkv, n]`` (-1: empty) — a table of (layer, head, position) flags built at
    once (a lookup is one index; ``np.isin`` per head sorted both sides, every head, every swap)."""
    n_layer, hkv = true.shape[:2]
    top = int(true.max(initial=-1)) + 1
    table = np.zeros(n_layer * hkv * top + 1, bool)  # the last entry: any position past the device's, never held
    live = true >= 0
    table[(np.arange(n_layer * hkv).reshape(n_layer, hkv, 1) * top + true)[live]] = True

    def held(l: int, h: int, pos: np.ndarray) -> np.ndarray:
        return table[np.where(pos < top, (l * hkv + h) * top + pos, len(table) - 1)]

    return held


def _from_tier(read) -> np.ndarray:
    return read.tier_ids >= 0 if read.tier_ids is not None else np.zeros(read.true.shape, bool)


def evicted(read, plan) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per compressed layer, the device rows ``plan`` drops from the cells of ``read`` (tier rows it does
    not keep are not evicted: they never left the tier): ``(cells, heads)``, each head's in position order."""
    true = read.true
    n_layer, hkv, n = true.shape
    gone = ((true >= 0) & ~_from_tier(read)).reshape(-1)  # the device's rows, less those the plan keeps: flat
    keep = plan.keep.reshape(n_layer * hkv, -1)
    gone[(np.arange(n_layer * hkv)[:, None] * n + keep)[keep >= 0]] = False
    rows = np.flatnonzero(gone)  # in (layer, head, cell) order
    head_of, pos = rows // n, true.reshape(-1)[rows]
    # a head's cells hold rising positions after any compaction and prefill chunk: sort only where they do not
    # (a recall union's candidates follow the device cells)
    if len(rows) > 1 and not np.all((np.diff(pos) > 0) | (np.diff(head_of) > 0)):
        order = np.lexsort((pos, head_of))
        rows, head_of = rows[order], head_of[order]
    cells, heads, layers = rows % n, head_of % hkv, head_of // hkv
    ends = np.searchsorted(layers, np.arange(plan.n_layer + 1))
    return [(cells[a:b], heads[a:b]) for a, b in zip(ends[:-1], ends[1:])]


def store_evicted(tier: HostTier, read, plan, basis, gone, rows) -> None:
    """After ``plan`` was applied to ``read`` (perhaps :func:`with_candidates`'s): the device rows it
    dropped (``gone``, :func:`evicted`; their K/V ``rows`` per layer, taken before the plan was applied)
    go to the tier with their keys (for the page bounds) and norms; the tier rows it kept are flagged as
    on the device."""
    for l, ((cells, heads), (k, v)) in enumerate(zip(gone, rows)):
        ends = np.searchsorted(heads, np.arange(plan.n_kv + 1))  # each head's rows, together (evicted's order)
        # a layer's rows at once (one conversion, two gathers), then sliced per head
        pos, keys, norms = read.true[l][heads, cells], basis.keys(k), read.vnorm[l][heads, cells]
        for h in range(plan.n_kv):
            a, b = ends[h], ends[h + 1]
            if b > a:
                tier.add(l, h, pos[a:b], k[a:b], v[a:b], keys[a:b], norms[a:b])
    if read.tier_ids is None:  # no row came from the tier: none to flag as on the device
        return
    from_tier = _from_tier(read)
    for l in range(plan.n_layer):
        for h in range(plan.n_kv):
            keep = plan.keep[l, h]
            keep = keep[keep >= 0]
            back = keep[from_tier[l, h, keep]]
            if len(back):
                ids = read.tier_ids[l, h, back] - tier.heads[l][h].base  # (below 0: dropped since, on the device now)
                tier.mark(l, h, ids[ids >= 0])
