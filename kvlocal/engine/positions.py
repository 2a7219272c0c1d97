"""Endless chats: positions moved back under the trained context (StreamingLLM's "positions within the
cache"), with the engine's record of its rows and its recall tier kept consistent."""

from __future__ import annotations

import time

import numpy as np

from kvlocal.engine.interrupts import interrupts_deferred
from kvlocal.backends import RowRecord

# After a move, the positions the session may still take before the next one: at least this share of the
# trained context (a tier's history gives up the rest)
FREE_SHARE = 0.25


class Positions:
    """An endless session's positions: ``limit`` (the trained context) is what they stay under, ``recent_span`` the
    newest positions that move as one block (``recent``, or a sliding-window model's window: ``sliding``). A move
    renumbers ``cells`` and their record, ``tier``'s rows (None: no tier; their keys turned by ``basis``) and forgets
    ``observer``'s kept queries; its figures go to ``stats``."""

    def __init__(self, cells, observer, tier, basis, stats, *, limit: int, recent_span: int, sliding: bool):
        self.cells, self.observer, self.tier, self.basis, self.stats = cells, observer, tier, basis, stats
        self.limit, self.recent_span, self.sliding = limit, recent_span, sliding

    def move(self, need: int = 1) -> None:
        """Move the cache's positions back into the trained range, as StreamingLLM does ("positions within
        the cache"): the cells older than the recent span (``recent``; a sliding-window model's window)
        take consecutive positions 0, 1, ... in their order, and the recent span follows them shifted as one
        block, so recent tokens keep their exact distances and old ones keep their order. llama.cpp
        re-rotates the keys (K-shift) at the next decode. The rows' recorded positions (the scorers' order
        and recency) become their cell's new position in the old part and shift with the block in the
        recent one — kept strictly increasing per head, which the plans require.

        With a recall tier the old part also keeps the tier's history from a cut-off position on — the
        latest rows that fit, leaving at least ``max(need, FREE_SHARE × the trained context)`` positions free
        (:func:`_history`). The kept positions are numbered together with the cells, every head's tier
        rows and device rows stay distinct and in order, and the tier's keys are turned by RoPE to their new
        positions (:meth:`~kvlocal.runtime.CacheBasis.turn_keys`, as llama.cpp's K-shift turns the cells').
        Older tier rows, and tier copies of rows now on the device, are forgotten (``recall_dropped_rows``).
        Where kvlocal cannot reproduce the model's RoPE (:meth:`Rope.of` is None) the tier is cleared."""
        t0 = time.perf_counter()
        c, tier = self.cells, self.tier
        ctx = c.ctx
        cells = np.unique(c.kv.positions()).astype(np.int64)
        true, vnorm, count = c.kv.record.rows(cells)  # every live cell's rows, those added since the last plan too
        span = self.recent_span
        recent = c.n_past - span
        old = cells[cells < recent]
        rope = self.observer.observations.rope
        follow = tier is not None and rope is not None
        free = max(need, int(FREE_SHARE * self.limit))
        room = self.limit - span - free  # positions the old part may take
        history = _history(tier, old, recent) if follow else np.zeros(0, np.int64)
        keep = max(0, min(len(history), room - len(old)))
        while True:  # ties between a head's rows move later ones up: keep less history until the numbering fits
            cut = int(history[len(history) - keep]) if keep else recent
            kept = _tier_rows(tier, cut, recent) if follow else {}
            frame = np.union1d(old, history[len(history) - keep:])
            labels, kept_pos, offset = _numbered(true, cells, frame, recent, kept, tier)
            if offset <= room or keep == 0:
                break
            keep = max(0, keep - (offset - room))

        def moved(p: np.ndarray) -> np.ndarray:
            return np.where(p < recent, np.searchsorted(frame, p), p - recent + offset)

        with interrupts_deferred():
            if self.sliding:  # sliding-window cells between full-cache cells (outside the window)
                prev = -1
                for p in [*old.tolist(), recent]:
                    if p > prev + 1:
                        ctx.remove(prev + 1, p)
                    prev = p
            for p, i in zip(old.tolist(), moved(old).tolist()):
                if p != i:
                    ctx.shift(p, p + 1, i - p)
            if recent != offset:
                ctx.shift(recent, -1, offset - recent)
            c.kv.record = RowRecord(moved(cells), labels, vnorm, count)
            c.n_past = int(moved(np.array([c.n_past]))[0])
            self.stats.repositions += 1
            self.observer.observations.forget()  # the kept probe queries' positions mean nothing now
            if tier is not None:
                if follow:  # rows older than the cut, and tier copies of device rows, are forgotten
                    for (l, h), ids in kept.items():
                        tier.renumber(l, h, ids, kept_pos[(l, h)],
                                      lambda k, d: self.basis.turn_keys(k, lambda x: rope.rotate(x, d)))
                else:  # the keys cannot be turned: an endless chat starts a new tier here
                    tier.clear()
                self.stats.recall_dropped_rows = tier.dropped_rows
                self.stats.host_tier_bytes = tier.nbytes
            self.stats.reposition_seconds += time.perf_counter() - t0


def _tier_rows(tier, cut: int, recent: int) -> dict:
    """Per (layer, head): the ids of the tier rows a move keeps — off the device, at positions in
    ``[cut, recent)``, in position order."""
    kept = {}
    for l, layer in enumerate(tier.heads):
        for h, s in enumerate(layer):
            p = s.pos[:s.n]
            ids = np.flatnonzero(~s.on_device[:s.n] & (p >= cut) & (p < recent))
            kept[(l, h)] = ids[np.argsort(p[ids], kind="stable")]
    return kept


def _numbered(true: np.ndarray, cells: np.ndarray, frame: np.ndarray, recent: int, kept: dict, tier):
    """The new true positions: ``(labels [n_layer, Hkv, n], kept_pos {(l, h): tier rows' new positions},
    offset)``. Old position ``frame[i]`` becomes ``i``. A head's rows in old cells take their cell's new
    position, its kept tier rows their own; the two are made strictly increasing together (a tie moves
    the later row up one, in old order), and the recent block starts at ``offset``, past the highest.
    Rows in the recent cells follow their cell, or their own position where it is recent, again strictly
    increasing."""
    cell_rank = np.searchsorted(frame, cells)  # an old cell's new position
    in_old = (true >= 0) & (cells < recent)[None, None, :]
    labels = np.full(true.shape, -1, np.int64)
    kept_pos = {}
    top = len(frame)
    for l in range(true.shape[0]):
        for h in range(true.shape[1]):
            on = np.flatnonzero(in_old[l, h])
            off = tier.heads[l][h].pos[kept[(l, h)]] if (l, h) in kept else np.zeros(0, np.int64)
            rank = np.concatenate([cell_rank[on], np.searchsorted(frame, off)])
            order = np.lexsort((np.concatenate([true[l, h, on], off]), rank))  # by new position, then old
            new = np.empty_like(rank)
            new[order] = _increasing(rank[order])
            labels[l, h, on] = new[:len(on)]
            if (l, h) in kept:
                kept_pos[(l, h)] = new[len(on):]
            if len(new):
                top = max(top, int(new.max()) + 1)
    offset = top
    cell_new = np.where(cells < recent, cell_rank, cells - recent + offset)
    rest = (true >= 0) & ~in_old
    labels = np.where(rest, np.where(true >= recent, true - recent + offset, cell_new[None, None, :]), labels)
    n_old = int(np.searchsorted(cells, recent))  # the recent cells are the last ones
    labels[..., n_old:] = _increasing(labels[..., n_old:], valid=rest[..., n_old:])
    return labels, kept_pos, offset


def _increasing(x: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    """``x`` made strictly increasing along its last axis (where ``valid``): each entry raised, if need be,
    to one more than the entry before it (by index: skipped entries count); entries not valid become -1."""
    idx = np.arange(x.shape[-1])
    if valid is None:
        return np.maximum.accumulate(x - idx, axis=-1) + idx
    out = np.maximum.accumulate(np.where(valid, x - idx, np.iinfo(np.int64).min // 2), axis=-1) + idx
    return np.where(valid, out, -1)


def _history(tier, old: np.ndarray, recent: int) -> np.ndarray:
    """The positions the tier's history may add to the old cells' (any head's rows off the device, older
    than ``recent``, not a cell's position), in order: a move keeps the latest that fit."""
    pos = np.unique(np.concatenate([s.pos[:s.n][~s.on_device[:s.n]] for layer in tier.heads for s in layer]))
    return pos[(pos < recent) & ~np.isin(pos, old)]
