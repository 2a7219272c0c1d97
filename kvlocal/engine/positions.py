"""Endless chats: positions moved back under the trained context (StreamingLLM's "positions within the
cache"), with the engine's record of its rows and its recall tier kept consistent."""

from __future__ import annotations

import numpy as np

from kvlocal.engine.interrupts import interrupts_deferred


def reposition(engine) -> None:
    """Move the cache's positions back into the trained range, as StreamingLLM does ("positions within
    the cache"): the cells older than the recent span (``recent``; a sliding-window model's window)
    take consecutive positions 0, 1, ... in their order, and the recent span follows them shifted as one
    block, so recent tokens keep their exact distances and old ones keep their order. llama.cpp
    re-rotates the keys (K-shift) at the next decode. The rows' recorded positions (the scorers' order
    and recency) become their cell's new position in the old part and shift with the block in the
    recent one — kept strictly increasing per head, which the plans require."""
    ctx = engine.ctx
    cells = np.unique(engine.kv.positions()).astype(np.int64)
    recent = engine.n_past - engine._recent_span
    old = cells[cells < recent]

    def moved(p: np.ndarray) -> np.ndarray:
        return np.where(p < recent, np.searchsorted(old, p), p - recent + len(old))

    with interrupts_deferred():
        if engine.model.arch.has_swa:  # sliding-window cells between full-cache cells (outside the window)
            prev = -1
            for p in [*old.tolist(), recent]:
                if p > prev + 1:
                    ctx.remove(prev + 1, p)
                prev = p
        for i, p in enumerate(old.tolist()):
            if p != i:
                ctx.shift(p, p + 1, i - p)
        if recent != len(old):
            ctx.shift(recent, -1, len(old) - recent)
        record = engine.kv.record
        cell_new = moved(record.pos)
        t = record.true
        label = np.where(t >= recent, t - recent + len(old), cell_new)
        idx = np.arange(t.shape[-1])
        label = np.maximum.accumulate(np.where(t >= 0, label - idx, np.iinfo(np.int64).min // 2), axis=-1) + idx
        record.true = np.where(t >= 0, label, -1)
        record.pos = cell_new
        engine.n_past = int(moved(np.array([engine.n_past]))[0])
        engine.stats.repositions += 1
        engine.observations.forget()  # the kept probe queries' positions mean nothing now
        if engine.tier is not None:
            # the tier's rows cannot follow: their keys carry the old rotation and the new range has no
            # positions between the renumbered cells for them; an endless chat starts a new tier here
            engine.tier.clear()
            engine.stats.recall_dropped_rows = engine.tier.dropped_rows
