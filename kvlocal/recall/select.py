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
        for h, s in enumerate(layer):
            if s.n == 0 or s.on_device[:s.n].all():
                per_head.append(np.zeros(0, np.int64))
                continue
            bounds = s.page_bounds(ql[h * group:(h + 1) * group].reshape(-1, ql.shape[-1]))
            off = np.add.reduceat((~s.on_device[:s.n]).astype(np.int64), np.arange(0, s.n, PAGE))  # [n_pages]
            pages = np.flatnonzero(off > 0)  # a page whose rows are all on the device has nothing to offer
            order = pages[np.argsort(-bounds[pages], kind="stable")]
            enough = int(np.searchsorted(np.cumsum(off[order]), n_rows)) + 1
            rows = s.page_rows(order[:enough])
            per_head.append(rows)
        ids.append(per_head)
    return Candidates(ids, max((len(i) for layer in ids for i in layer), default=0))


def with_candidates(read, tier: HostTier, cands: Candidates, span: str = "row"):
    """``read`` (a state-backend :class:`~kvlocal.runtime.CacheRead`) with the candidates appended as
    ``cands.width`` more cells: per layer, head ``h``'s ``j``-th candidate sits in cell ``n + j``, rows a
    head has no candidate for are empty (position -1, count 0). The blob of the real cells is kept (a
    failed write loads it back). ``span="page"``: a tier page's rows rank together (its best row's score),
    so a fact comes back whole or not at all; ``"row"``: each row on its own score."""
    n_layer, hkv = read.true.shape[:2]
    for l in range(n_layer):  # a row the device holds is never a candidate (its flag is set right here)
        for h, ids in enumerate(cands.ids[l]):
            here = np.isin(tier.heads[l][h].pos[ids], read.true[l, h])
            if here.any():
                tier.heads[l][h].on_device[ids[here]] = True
                cands.ids[l][h] = ids[~here]
    cands.width = max((len(i) for layer in cands.ids for i in layer), default=0)
    kv, n, m = read.kv, read.n, cands.width
    k_out, v_out = [], []
    true = np.full((n_layer, hkv, n + m), -1, np.int64)
    vnorm = np.full((n_layer, hkv, n + m), np.nan, np.float32)
    count = np.zeros((n_layer, hkv, n + m), np.int64)
    groups = np.full((n_layer, hkv, n + m), -1, np.int64) if span == "page" else None
    true[:, :, :n], vnorm[:, :, :n], count[:, :, :n] = read.true, read.vnorm, read.count
    for l in range(n_layer):
        k = np.zeros((n + m, *kv.k[l].shape[1:]), dtype=kv.k[l].dtype)
        v = np.zeros((n + m, *kv.v[l].shape[1:]), dtype=kv.v[l].dtype)
        k[:n], v[:n] = kv.k[l], kv.v[l]
        for h, ids in enumerate(cands.ids[l]):
            if not len(ids):
                continue
            s = tier.heads[l][h]
            rk, rv = s.rows(ids)
            k[n:n + len(ids), h], v[n:n + len(ids), h] = rk, rv
            true[l, h, n:n + len(ids)] = s.pos[ids]
            vnorm[l, h, n:n + len(ids)] = s.vnorm[ids]
            count[l, h, n:n + len(ids)] = 1
            if groups is not None:
                groups[l, h, n:n + len(ids)] = ids // PAGE
        k_out.append(k)
        v_out.append(v)
    pos = np.concatenate([read.pos, np.full(m, -1, np.int64)])
    union_kv = dataclasses.replace(kv, k=k_out, v=v_out, pos=pos.astype(np.int32))
    return dataclasses.replace(read, pos=pos, true=true, vnorm=vnorm, count=count, kv=union_kv, groups=groups)


def evicted_counts(read, plan, n_device: int) -> np.ndarray:
    """``[n_layer, Hkv]`` device rows (of the first ``n_device`` cells) that ``plan`` does not keep."""
    live = read.true[:, :, :n_device] >= 0
    kept = (plan.keep >= 0) & (plan.keep < n_device)
    return live.sum(axis=2) - kept.sum(axis=2)


def store_evicted(tier: HostTier, read, plan, basis, n_device: int, cands: Candidates | None = None) -> None:
    """After ``plan`` was applied to ``read`` (a state-backend read, perhaps :func:`with_candidates`'s): the
    device rows it dropped go to the tier (raw rows, their keys for the page bounds, their norms), the
    candidates it kept are flagged as on the device."""
    kv = read.kv
    for l in range(plan.n_layer):
        for h in range(plan.n_kv):
            keep = plan.keep[l, h]
            keep = keep[keep >= 0]
            kept = np.zeros(read.n, bool)
            kept[keep] = True
            gone = np.flatnonzero((read.true[l, h, :n_device] >= 0) & ~kept[:n_device])
            if len(gone):
                gone = gone[np.argsort(read.true[l, h, gone], kind="stable")]
                rows_k = kv.k[l][gone, h]
                tier.add(l, h, read.true[l, h, gone], rows_k, kv.v[l][gone, h], basis.keys(rows_k), read.vnorm[l, h, gone])
            if cands is not None and len(cands.ids[l][h]):
                back = keep[keep >= n_device] - n_device
                tier.mark(l, h, cands.ids[l][h][back])
