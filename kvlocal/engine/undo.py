"""Undoing a turn by what it changed (:meth:`Engine.mark <kvlocal.engine.Engine.mark>`, :meth:`Engine.undo
<kvlocal.engine.Engine.undo>`): a chat turn that is cancelled or fails, or a reply taken back (``/regen``), puts the
engine back exactly where the turn began — without a host copy of the cache taken before every turn.

A :class:`TurnMark` holds what the engine's next step depends on, by reference: ``n_past`` (every cell a turn adds
sits at a position from there on), kvlocal's row record (an event replaces it, never changes it in place), the
logits, the probe and the reply so far, the kept observation, the statistics, the recall tier's rows per head.
Undone, the cells at ``n_past`` and past are removed (``llama_memory_seq_rm``) and the rest is put back.

A compression event — a turn's own end, a re-selection, an answer step's swap, a merge — rewrites cells. Each event
while a mark is open leaves a :class:`Rewrite`: the cells' positions and record before it, the plan's ``keep`` (where
each kept row went) and the rows it did not keep as they were (dropped, or overwritten by a merge). Undone, each
event is reversed, latest first, as a plan of its own: the cells added after it removed, its kept rows moved back on
the device (``llama_kv_compact``) and the others written back (``llama_kv_rows_set``; the state backend writes the
cells it reads). The rows it dropped are the ones the recall tier took anyway — they are read back from the tier by
position, so a turn copies no K/V at all; without a tier (or where the tier could not keep them) they are copied to
the host before the event, counted in ``EngineStats.rollback_bytes``. Once a turn's log would hold more than a copy
of the cells it began with, or before positions move (every key re-rotated) or on a sliding-window model (whose cache
drops cells as it decodes), the cells are copied whole instead — llama.cpp's sequence state, once, for every open mark — and undone,
loaded back before the earlier events are reversed. The tier only gains rows in a turn (undone: forgotten past the
mark's count); what an event changes in its older rows — a head's last page's key bounds, value norms learnt — is
noted as it happens, and before positions move, which renumbers the tier, its rows are copied.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import numpy as np

from kvlocal.compress import Plan
from kvlocal.engine.interrupts import interrupts_deferred
from kvlocal.errors import KvlocalError, UsageError
from kvlocal.recall import PAGE, evicted
from kvlocal.backends import RowRecord


@dataclass(eq=False)
class Rewrite:
    """One event's undo: ``n_past`` then (the cells added after it start there), the cells' positions ``pos`` ``[n]``
    before it, the plan's ``keep`` ``[n_layer, Hkv, B]`` and ``merged`` slots (None: none) and the cell positions it
    left (``after`` ``[B]``); per compressed layer the rows it did not keep as they were — ``gone`` ``(cells, heads)``
    and their record ``(true positions, counts)`` — and their K and V (``rows``; None: read back from the recall tier
    by position). The rows it kept carry their record in the one after it. (Value norms are not kept: only the mark's
    own record is the engine's again.)"""

    n_past: int
    pos: np.ndarray
    keep: np.ndarray
    merged: np.ndarray | None
    after: np.ndarray
    gone: list[tuple[np.ndarray, np.ndarray]]
    record: list[tuple[np.ndarray, np.ndarray]]
    rows: list[tuple[np.ndarray, np.ndarray]] | None = None

    @property
    def nbytes(self) -> int:
        """The host memory it keeps alive: the plan's arrays it refers to, the rows and records it holds."""
        arrays = [self.pos, self.keep, self.after, *([] if self.merged is None else [self.merged]),
                  *(a for group in (*self.gone, *self.record, *(self.rows or ())) for a in group)]
        return sum(a.nbytes for a in arrays)


@dataclass(eq=False)
class TierMark:
    """The recall tier when a turn began: rows per head ``n`` ``[n_layer, Hkv]`` and its counters; what events changed
    in those rows since — per (layer, head) its last page's key bounds before (``(page, kmin, kmax)``), the ids of rows
    whose value norm was unknown before (``unknown``) — and, once positions move, all its rows
    (:meth:`~kvlocal.recall.HostTier.to_arrays`; then nothing more is noted)."""

    n: np.ndarray
    counters: tuple[int, int, int]  # rows_out, rows_in, dropped_rows
    pages: dict = field(default_factory=dict)
    unknown: list = field(default_factory=list)  # (layer, head, ids)
    arrays: dict | None = None


@dataclass(eq=False)
class TurnMark:
    """An engine where a turn began (module docstring): ``log`` the events since, up to ``cells`` (llama.cpp's
    sequence state, copied before an event when the log could not do; empty: the turn began with none; None: not
    copied) with their record, and ``held`` the host memory the log keeps alive."""

    n_past: int
    last_token: int
    logits: np.ndarray | None
    record: object  # the backend's RowRecord
    settled: int
    probe: list[int] | None
    reply: list[int]
    answering: bool
    held_queries: tuple | None
    plans: tuple  # last_plan, prompt_plan, last_probe
    observations: object  # a shallow copy of the engine's Observations (whose fields are replaced, not changed)
    stats: object  # a copy of the engine's EngineStats
    kv_counters: tuple[int, int]  # the backend's host_kv_bytes and host_bytes_peak
    tier: TierMark | None
    log: list[Rewrite] = field(default_factory=list)
    cells: np.ndarray | None = None
    cells_record: object = None  # the record of the cells copied
    limit: int = 0  # what a copy of its cells takes: the most its log may hold
    held: int = 0


@dataclass
class _Restore(Plan):
    """A plan that puts cells back: its cells take the positions they had (``cell_pos``), whatever their rows'."""

    cell_pos: np.ndarray | None = None

    def slot_positions(self) -> np.ndarray:
        return self.cell_pos


def open_mark(engine) -> TurnMark:
    """A mark of ``engine`` as it is now, open until undone or released."""
    s, t, kv, c, r, o = engine.stats, engine.tier, engine.kv, engine.compressor, engine.reselection, engine.observer
    m = TurnMark(engine.n_past, engine.last_token, engine.logits, kv.record, c.settled, engine._probe,
                 list(engine._reply), r.answering, r.held, (c.last_plan, engine.prompt_plan, o.last_probe),
                 copy.copy(o.observations),
                 dataclasses.replace(s, compression_breakdown=dict(s.compression_breakdown)),
                 (kv.host_kv_bytes, kv.host_bytes_peak),
                 None if t is None else TierMark(t.mark_of(), (t.rows_out, t.rows_in, t.dropped_rows)))
    m.limit = engine.live_cells() * _cell_bytes(engine)
    if not m.limit:  # no cells to keep: undone, every cell goes
        m.cells, m.cells_record = np.zeros(0, np.uint8), kv.record
    engine._marks.append(m)
    _hold_tier(engine)
    if engine.model.arch.has_swa:  # the sliding cache loses cells to every decode
        copy_cells(engine)
    return m


def before_apply(engine, read, plan) -> Rewrite | None:
    """Before ``plan`` is applied to ``read``: what the open marks need to undo it — the tier's older rows it may
    change noted, and the event's :class:`Rewrite` (the rows it does not keep copied where the tier will not hold
    them), or the cells copied whole. Returns the rewrite for :func:`after_apply` (None: no mark needs one)."""
    if not engine._marks:
        return None
    n = int((read.pos >= 0).sum())  # the device's cells (a re-selection's tier rows follow them, at position -1)
    gone = evicted(read, plan)
    merged = plan.merged() if plan.merges is not None else None
    if merged is not None:  # a merge overwrites its latest member's row
        for l, (cells, heads) in enumerate(gone):
            h, j = np.nonzero(merged[l])
            gone[l] = (np.concatenate([cells, plan.keep[l][h, j]]), np.concatenate([heads, h]))
    if engine.tier is not None:
        _note_tier(engine, read, gone)
    bare = [m for m in engine._marks if m.cells is None]
    if not bare:
        return None
    pos = read.pos[:n].copy()
    gone = [(cells.astype(np.int32), heads.astype(np.int32)) for cells, heads in gone]  # (half the memory)
    record = [(read.true[l][heads, cells].astype(np.int32), read.count[l][heads, cells].astype(np.int32))
              for l, (cells, heads) in enumerate(gone)]
    keep = plan.keep.astype(np.int16 if read.n < 2**15 else np.int32)  # (a quarter of the plan's memory, or half)
    rewrite = Rewrite(engine.n_past, pos, keep, merged, plan.slot_positions(), gone, record)
    rows = 0 if engine.tier is not None else sum(len(c) for c, _ in gone) * _cell_bytes(engine) // (
        len(engine.layers) * engine.model.n_head_kv)
    # a log holds no more than the copy of the cells the turn began with: past it, or for cells no plan could have
    # left, a copy of the cells now
    if not _reversible(pos, read.true[:, :, :n]) or any(m.held + rewrite.nbytes + rows > m.limit for m in bare):
        copy_cells(engine)
        return None
    if engine.tier is None:
        rewrite.rows = _take(engine, read, gone)
    return rewrite


def after_apply(engine, rewrite: Rewrite | None, rows=None) -> None:
    """The event ``rewrite`` was made for is applied: it joins the log of every open mark without a copy of the
    cells. ``rows``: the rows the event evicted (the tier's, in ``evicted`` order), held where the tier dropped some."""
    if rewrite is None:
        return
    if rewrite.rows is None and rows is not None:
        rewrite.rows = rows
    for m in engine._marks:
        if m.cells is None:
            m.log.append(rewrite)
            m.held += rewrite.nbytes


def copy_cells(engine, cells: np.ndarray | None = None) -> None:
    """Copy the cells whole for the open marks that hold no copy (from here on their events need no log); ``cells``:
    the copy, where the caller has just made one (``engine.kv.save()``)."""
    bare = [m for m in engine._marks if m.cells is None]
    if bare:
        cells = engine.kv.save() if cells is None else cells
        _count(engine, cells.nbytes)
        for m in bare:
            m.cells, m.cells_record = cells, engine.kv.record


def before_reposition(engine) -> None:
    """Positions are about to move (every key re-rotated, the tier renumbered): the cells and the tier's rows are
    copied for the open marks without them."""
    copy_cells(engine)
    if engine.tier is not None:
        bare = [m for m in engine._marks if m.tier.arrays is None]
        if bare:
            arrays = engine.tier.to_arrays()
            _count(engine, arrays["tier_k"].nbytes + arrays["tier_v"].nbytes)
            for m in bare:
                m.tier.arrays = arrays


def undo(engine, m: TurnMark) -> None:
    """Put ``engine`` back to the open mark ``m`` (module docstring); ``m`` and the marks opened after it are closed.
    If llama.cpp refuses the copied cells, the cells held before stay and UsageError is raised; a reversal that
    fails leaves the engine unusable (RuntimeError)."""
    engine._check_usable()
    if not any(m is x for x in engine._marks):
        raise UsageError("this turn can no longer be undone (a later one was, or the session was replaced)")
    if m.tier is not None and not engine.tier.intact(m.tier.n):  # another conversation's room took its rows
        raise KvlocalError("this turn can no longer be undone: the recall tier's RAM cap ({recall_mem}) dropped rows "
                           "it evicted", "recall_mem")
    with interrupts_deferred():
        if m.tier is not None and m.tier.arrays is not None:  # positions moved: the tier's rows as they were before
            engine.tier.truncate(np.zeros_like(m.tier.n))
            engine.tier.load_arrays(m.tier.arrays)
        if m.cells is not None and not len(m.cells):
            engine.ctx.remove(0, -1)
        elif m.cells is not None:
            try:
                engine.kv.load(m.cells)
            except RuntimeError:
                engine.cells.note_live()
                raise UsageError("llama.cpp refused the cells copied during the turn; the session is as it was") from None
            engine.kv.record = m.cells_record
        try:
            for rewrite in reversed(m.log):
                _reverse(engine, rewrite)
        except Exception as e:
            engine.cells.broken = f"a turn could not be undone: {e}"
            raise RuntimeError(engine.cells.broken) from e
        engine.ctx.remove(m.n_past, -1)
        engine.n_past, engine.last_token, engine.logits = m.n_past, m.last_token, m.logits
        c, r, o = engine.compressor, engine.reselection, engine.observer
        engine.kv.record, c.settled = m.record, m.settled
        engine._probe, engine._reply, r.answering = m.probe, list(m.reply), m.answering
        r.held = m.held_queries
        c.last_plan, engine.prompt_plan, o.last_probe = m.plans
        o.observations = copy.copy(m.observations)
        engine.kv.host_kv_bytes, engine.kv.host_bytes_peak = m.kv_counters
        if m.tier is not None:
            _restore_tier(engine, m.tier)
        s = engine.stats  # the copies' counts stay: they were made
        s.load(dataclasses.replace(m.stats, compression_breakdown=dict(m.stats.compression_breakdown),
                                   rollback_bytes=s.rollback_bytes, rollback_copies=s.rollback_copies))
        engine.cells.note_live()
        release(engine, m, later=True)


def release(engine, m: TurnMark, later: bool = False) -> None:
    """Close the mark ``m`` (``later``: and the marks opened after it); nothing more is kept for it."""
    i = next((i for i, x in enumerate(engine._marks) if x is m), None)
    if i is not None:
        del engine._marks[i:len(engine._marks) if later else i + 1]
        _hold_tier(engine)


def _hold_tier(engine) -> None:
    """The recall tier keeps from its RAM cap the rows undoing the open marks reads back (``HostTier.hold``)."""
    if engine.tier is not None:
        engine.tier.hold([m.tier.n for m in engine._marks])


# -- reversing an event ------------------------------------------------------------------------------
def _reverse(engine, e: Rewrite) -> None:
    """Undo the event ``e``: the cells added after it removed, its cells put back as they were before it, with their
    record (the rows it kept: as the record after it has them; the others: as ``e`` noted them)."""
    kv, tier = engine.kv, engine.tier
    engine.ctx.remove(e.n_past, -1)
    read = kv.read()
    if not np.array_equal(read.pos, e.after):
        raise RuntimeError("the cells are not the ones the event left")
    n_layer, hkv, _ = e.keep.shape
    n = len(e.pos)
    src = np.full((n_layer, hkv, n), -1, np.int64)  # where each row before the event is now
    before = [np.full(src.shape, fill, a.dtype) for fill, a in ((-1, read.true), (np.nan, read.vnorm), (0, read.count))]
    kept = (e.keep >= 0) & (e.keep < n)  # (a re-selection's tier rows were not cells before it)
    if e.merged is not None:
        kept &= ~e.merged
    layer, head, slot = np.nonzero(kept)
    cell = e.keep[layer, head, slot]
    src[layer, head, cell] = slot
    for x, a in zip(before, (read.true, read.vnorm, read.count)):
        x[layer, head, cell] = a[layer, head, slot]
    ranks = [_ranks(heads) for _, heads in e.gone]
    width = max((int(r.max()) + 1 for r in ranks if len(r)), default=0)
    union, k_new, v_new = kv.extend(read, width)
    extra = [np.full((n_layer, hkv, width), fill, a.dtype) for fill, a in zip((-1, np.nan, 0), before)]
    for l, ((cells, heads), rank, (pos, count)) in enumerate(zip(e.gone, ranks, e.record)):
        if not len(cells):
            continue
        k, v = e.rows[l] if e.rows is not None else _tier_rows(tier, l, heads, pos)
        k_new[l][rank, heads], v_new[l][rank, heads] = k, v
        src[l, heads, cells] = read.n + rank
        for i, value in ((0, pos), (2, count)):
            extra[i][l, heads, rank] = before[i][l, heads, cells] = value
    join = lambda a, b: np.concatenate([a, b], axis=2)
    union = dataclasses.replace(union, true=join(union.true, extra[0]), vnorm=join(union.vnorm, extra[1]),
                                count=join(union.count, extra[2]))
    true, vnorm, count = before
    kv.apply(union, _Restore(keep=src, positions=true, counts=count, cell_pos=e.pos))
    kv.record = RowRecord(e.pos.astype(np.int64), true, vnorm, count)


def _reversible(pos: np.ndarray, true: np.ndarray) -> bool:
    """Whether cells at positions ``pos`` whose rows have the positions ``true`` ``[n_layer, Hkv, n]`` can be a plan's
    result (rising cell positions; each head's empty rows first, then rising positions): the layout every event and
    decode leaves."""
    if np.any(np.diff(pos) <= 0):
        return False
    try:
        Plan(np.where(true >= 0, 0, -1), true)
    except ValueError:
        return False
    return True


def _ranks(heads: np.ndarray) -> np.ndarray:
    """For each row, how many rows of its head come before it: its place among the rows a reversal writes back."""
    order = np.argsort(heads, kind="stable")
    first = np.searchsorted(heads[order], heads[order])
    out = np.empty(len(heads), np.int64)
    out[order] = np.arange(len(heads)) - first
    return out


def _take(engine, read, gone) -> list[tuple[np.ndarray, np.ndarray]]:
    """The rows ``gone`` of ``read``, copied to the host before the event (not counted as the event's)."""
    kv = engine.kv
    before = kv.host_kv_bytes
    rows = [kv.take_rows(read, l, cells, heads) for l, (cells, heads) in enumerate(gone)]
    kv.host_kv_bytes = before
    _count(engine, sum(k.nbytes + v.nbytes for k, v in rows))
    return rows


def _tier_rows(tier, l: int, heads: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K and V of layer ``l``'s rows of KV heads ``heads`` at positions ``pos``, from the recall tier."""
    k = v = None
    for h in np.unique(heads):
        s = tier.heads[l][h]
        sel = heads == h
        ids = s.index_of(pos[sel])
        if (ids < 0).any():
            raise RuntimeError("rows the turn evicted are not in the recall tier")
        kh, vh = s.rows(ids)
        if k is None:
            k, v = np.empty((len(heads), *kh.shape[1:]), kh.dtype), np.empty((len(heads), *vh.shape[1:]), vh.dtype)
        k[sel], v[sel] = kh, vh
    return k, v


# -- the recall tier ---------------------------------------------------------------------------------
def _note_tier(engine, read, gone) -> None:
    """Before an event stores rows ``gone`` of ``read`` in the tier: for every open mark, the key bounds of each
    head's last page the first time rows join it, and the tier rows whose unknown value norm the event may learn
    (rows back on the device, evicted again)."""
    tier = engine.tier
    marks = [m for m in engine._marks if m.tier.arrays is None]
    if not marks:
        return
    for l, (cells, heads) in enumerate(gone):
        for h in np.unique(heads):
            s = tier.heads[l][h]
            if s.n % PAGE:
                for m in marks:
                    if (l, h) not in m.tier.pages and s.base + s.n == m.tier.n[l, h]:
                        p = s.n // PAGE  # (noted by number, base + id: the oldest rows may be dropped before undo)
                        m.tier.pages[(l, h)] = ((s.base + s.n) // PAGE, s.kmin[p].copy(), s.kmax[p].copy())
            if s.on_device[:s.n].any():
                ids = s.index_of(read.true[l][h, cells[heads == h]])
                ids = ids[ids >= 0]
                ids = ids[np.isnan(s.vnorm[ids])]
                if len(ids):
                    for m in marks:
                        m.tier.unknown.append((l, h, ids + s.base))


def _restore_tier(engine, t: TierMark) -> None:
    """The recall tier as it was at the mark ``t``; its flags of rows on the device follow the cells."""
    tier = engine.tier
    tier.truncate(t.n)
    for (l, h), (p, lo, hi) in t.pages.items():
        s = tier.heads[l][h]
        if p >= s.base // PAGE:  # (else dropped since, for the RAM cap)
            s.kmin[p - s.base // PAGE], s.kmax[p - s.base // PAGE] = lo, hi
    for l, h, ids in t.unknown:
        s = tier.heads[l][h]
        ids = ids - s.base
        s.vnorm[ids[(ids >= 0) & (ids < s.n)]] = np.nan
    tier.rows_out, tier.rows_in, tier.dropped_rows = t.counters
    tier.sync(engine.kv.record.rows(engine.kv.positions().astype(np.int64))[0])


def _cell_bytes(engine) -> int:
    """One cell's K and V, every layer and KV head."""
    return engine.stats.kv_bytes_allocated // engine.ctx.n_ctx


def _count(engine, nbytes: int) -> None:
    engine.stats.rollback_bytes += int(nbytes)
    engine.stats.rollback_copies += 1
