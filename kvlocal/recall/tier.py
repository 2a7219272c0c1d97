"""The host tier: every row that leaves the device cache, kept in host memory (or a memory-mapped file),
per compressed layer and KV head, in pages with a key summary.

A row is what one KV head of one layer attends to for one token: its K and V exactly as the cache stores
them (F16/F32 values, or the raw blocks of a q8_0/q4_0 cache, copied byte for byte), its true source
position and, when known, its projected value norm (CriticalKV's ``||v W_O||``, which depends only on
the row). Rows are identified by (layer, KV head, position): a token's row is stored once, the first
time it leaves; when a later question brings it back it stays here, flagged as on the device, so that
leaving again costs nothing.

Pages. A head's rows are stored in the order they leave (an event's rows in position order), ``PAGE``
rows a page; every page keeps the element-wise minimum and maximum of its keys (Quest), in the basis the
keys are stored in (Walsh–Hadamard-rotated for a quantized cache, where queries are rotated to match).
For a query ``q``, ``Σ_d max(q_d·min_d, q_d·max_d)`` bounds ``q·k`` for every key of the page, so pages
can be ranked without reading their rows (:meth:`HeadStore.page_bounds`).

Memory. Rows live in chunks of ``CHUNK`` rows taken from a :class:`Pool`: host RAM from a :class:`TierMemory`
(at most its ``limit`` bytes, shared by every tier given the same one: a server's conversations), then (with
``spill_dir``) a file in that folder, memory-mapped and grown by preallocated extents (a full disk fails the
allocation, before any row is moved, instead of a SIGBUS on a sparse page). With a limit and no folder, the
oldest rows go to make room: the chunks taken first, of all the tiers sharing the memory, are given to the
heads that need them, and their rows off the device are counted (``cap_dropped_rows``). A head's rows are
then numbered from its oldest left (``HeadStore.base`` counts the ids passed: ``base + id`` numbers a row
for as long as it is stored).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import numpy as np

from kvlocal.kernels import gather_rows, page_boxes
from kvlocal.errors import SettingError, UsageError
from kvlocal.recall.memory import Pool, TierFull, TierMemory

PAGE = 16  # rows per page (Quest uses 16)
CHUNK = 16 * PAGE  # rows per storage chunk: the unit of allocation (an event stores hundreds of rows a head)


@dataclass
class HeadStore:
    """The rows of one (layer, KV head): see the module docstring. ``k``/``v`` chunks hold rows as the
    cache stores them (``row_k``/``row_v``: dtype and shape of one row)."""

    row_k: tuple  # (dtype, shape)
    row_v: tuple
    key_dim: int
    n: int = 0
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    vnorm: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    on_device: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    kmin: np.ndarray = None  # [n_pages, key_dim] float32
    kmax: np.ndarray = None
    chunks: list = field(default_factory=list)  # [(k [CHUNK, ...], v [CHUNK, ...])]
    _addr: tuple = (np.zeros(0, np.uintp), np.zeros(0, np.uintp))  # the chunks' K and V addresses
    _row_of: np.ndarray | None = None  # row id by position (-1: none), built when first asked, kept as rows come
    base: int = 0  # ids passed by the oldest rows dropped: ``base + id`` numbers a row while it is stored

    def __post_init__(self) -> None:
        if self.kmin is None:
            self.kmin = np.zeros((0, self.key_dim), np.float32)
            self.kmax = np.zeros((0, self.key_dim), np.float32)

    @property
    def n_pages(self) -> int:
        return -(-self.n // PAGE)

    def index_of(self, pos: np.ndarray) -> np.ndarray:
        """Row ids of the positions ``pos`` in this store, -1 where absent (a head stores a position once)."""
        pos = np.asarray(pos, dtype=np.int64)
        if self._row_of is None:
            self._row_of = np.full(int(self.pos[:self.n].max(initial=-1)) + 1, -1, np.int32)
            self._row_of[self.pos[:self.n]] = np.arange(self.n)
        inside = pos < len(self._row_of)
        ids = np.full(len(pos), -1, np.int64)
        ids[inside] = self._row_of[pos[inside]]
        return ids

    def _indexed(self, pos: np.ndarray, ids: np.ndarray) -> None:
        """Rows ``ids`` were stored at positions ``pos``: the position index follows (if it was built)."""
        if self._row_of is None or len(pos) == 0:
            return
        top = int(pos.max()) + 1
        if top > len(self._row_of):
            grown = np.full(max(top, 5 * len(self._row_of) // 4), -1, np.int32)
            grown[:len(self._row_of)] = self._row_of
            self._row_of = grown
        self._row_of[pos] = ids

    def forget_index(self) -> None:
        """Rows were dropped or renumbered: the position index is built again when next asked."""
        self._row_of = None

    def drop_first_chunk(self) -> tuple[np.ndarray, int]:
        """Its oldest chunk goes, and the rows it held: rows ``CHUNK ..`` become rows ``0 ..`` (views of the same
        arrays: nothing is copied) and ``base`` grows by ``CHUNK``. Returns the chunk's K rows (the start of its
        buffer) and how many of its rows were off the device."""
        gone = min(CHUNK, self.n)
        lost = int((~self.on_device[:gone]).sum())
        k, _ = self.chunks.pop(0)
        self.n -= gone
        self.base += CHUNK
        self.pos, self.vnorm, self.on_device = self.pos[CHUNK:], self.vnorm[CHUNK:], self.on_device[CHUNK:]
        self.kmin, self.kmax = self.kmin[CHUNK // PAGE:], self.kmax[CHUNK // PAGE:]
        self._addr = (self._addr[0][1:], self._addr[1][1:])
        self.forget_index()
        return k, lost

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V of the rows ``ids``: ``[m, ...]`` each, copies."""
        k = np.empty((len(ids), *self.row_k[1]), dtype=self.row_k[0])
        v = np.empty((len(ids), *self.row_v[1]), dtype=self.row_v[0])
        self.rows_into(ids, k, v)
        return k, v

    def rows_into(self, ids: np.ndarray, k: np.ndarray | None, v: np.ndarray | None) -> None:
        """Copy K and V of the rows ``ids`` into ``k``/``v`` ``[len(ids), ...]`` (views: rows any stride apart;
        None: not that one)."""
        have = len(self._addr[0])
        if have != len(self.chunks):  # chunks are only ever added: so are their addresses
            new = [np.array([c[i].ctypes.data for c in self.chunks[have:]], np.uintp) for i in (0, 1)]
            self._addr = (np.append(self._addr[0], new[0]), np.append(self._addr[1], new[1]))
        for addr, out in zip(self._addr, (k, v)):
            if out is not None:
                gather_rows(addr, CHUNK, ids, out)

    def values(self, ids: np.ndarray) -> np.ndarray:
        """V of the rows ``ids``: ``[m, ...]``, a copy."""
        v = np.empty((len(ids), *self.row_v[1]), dtype=self.row_v[0])
        self.rows_into(ids, None, v)
        return v

    def page_bounds(self, q: np.ndarray) -> np.ndarray:
        """``[n_pages]``: for each page the largest ``q·k`` any of its keys can reach, over the queries
        ``q`` ``[m, key_dim]`` (Quest's bound)."""
        if self.n == 0:
            return np.zeros(0, np.float32)
        n = self.n_pages
        hi = np.maximum(q, 0) @ self.kmax[:n].T + np.minimum(q, 0) @ self.kmin[:n].T  # [m, n_pages]
        return hi.max(axis=0)


class HostTier:
    """The evicted rows of every compressed layer and KV head; see the module docstring.

    ``row_k``/``row_v``: ``(dtype, shape)`` of one cached row (the state backend's arrays: float16 ``(d,)``
    for an F16 cache, uint8 ``(bytes,)`` for a quantized one). ``mem_limit``: bytes of RAM (None: no limit), or
    a :class:`TierMemory` shared with other tiers; then ``spill_dir``, or (None) the oldest rows are dropped."""

    def __init__(self, n_layer: int, n_head_kv: int, row_k: tuple, row_v: tuple, key_dim: int,
                 mem_limit: "int | TierMemory | None" = None, spill_dir: str | os.PathLike | None = None):
        row_k = (np.dtype(row_k[0]), tuple(row_k[1]))
        row_v = (np.dtype(row_v[0]), tuple(row_v[1]))
        self.row_bytes = row_k[0].itemsize * int(np.prod(row_k[1])) + row_v[0].itemsize * int(np.prod(row_v[1]))
        self.chunk_bytes = CHUNK * self.row_bytes
        memory = mem_limit if isinstance(mem_limit, TierMemory) else TierMemory(mem_limit)
        if memory.limit is not None and memory.limit < self.chunk_bytes:
            raise SettingError(f"{{recall_mem}} {memory.limit:,} bytes is below one block of the tier ({CHUNK} rows "
                               f"of {self.row_bytes} bytes): give at least {self.chunk_bytes:,}, or leave it out",
                               "recall_mem")
        self.pool = Pool(memory, spill_dir)
        # past the limit without a folder the oldest rows go (their chunks registered with the memory)
        self.drops_oldest = memory.limit is not None and spill_dir is None
        self.heads = [[HeadStore(row_k, row_v, key_dim) for _ in range(n_head_kv)] for _ in range(n_layer)]
        self.dropped_rows = 0  # rows off the device forgotten: positions moved back, or an event's own past the cap
        self.cap_dropped_rows = 0  # rows off the device dropped for the RAM limit: the oldest, or an event's own
        self.rows_out = 0  # rows that crossed from the device into the tier
        self.rows_in = 0  # rows brought back to the device
        # what the open turns need kept (hold): their marks by id, (sequence, mark); the stored rows they saw leave the
        # device again, per (layer, head) [(sequence of the newest turn then, row numbers)]
        self._turns: dict[int, tuple[int, np.ndarray]] = {}
        self._touched: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}
        self._seq = 0
        self._lost: set[int] = set()  # the open turns (ids of their marks) whose held rows were dropped after all
        self._closed = weakref.finalize(self, self.pool.close)  # a tier never closed gives its RAM back when collected

    # -- figures ------------------------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        return sum(s.n for layer in self.heads for s in layer)

    @property
    def nbytes(self) -> int:
        """Host bytes of the tier: its rows (RAM and file) and its bookkeeping (positions, norms, page bounds)."""
        meta = sum(s.pos.nbytes + s.vnorm.nbytes + s.on_device.nbytes + s.kmin.nbytes + s.kmax.nbytes
                   + (0 if s._row_of is None else s._row_of.nbytes) for layer in self.heads for s in layer)
        return self.pool.nbytes + meta

    def figures(self) -> dict:
        """The tier's memory under the names the front doors print (:func:`tier_figures`)."""
        m = self.pool.memory
        return dict(host_tier_bytes=self.nbytes, host_tier_cap=m.limit, host_tier_cap_used=m.used,
                    host_tier_past_cap=None if m.limit is None else "drop_oldest" if self.drops_oldest else "spill",
                    host_tier_file_bytes=self.pool.file_bytes, host_tier_dropped_rows=self.cap_dropped_rows)

    @property
    def is_open(self) -> bool:
        return self._closed.alive

    def close(self) -> None:
        """Its RAM goes back to its memory (to the other tiers sharing it); nothing may be stored after."""
        self._closed()
        for layer in self.heads:
            for s in layer:
                s.chunks, s.n, s._addr = [], 0, (np.zeros(0, np.uintp), np.zeros(0, np.uintp))

    # -- rows out ------------------------------------------------------------------------------------
    def reserve(self, counts: np.ndarray) -> None:
        """Make room for ``counts[l, h]`` more rows of each head before any row moves: the chunks they
        need are allocated now, so that running out of disk fails before the cache changes (UsageError).
        Past the RAM limit without a folder the oldest chunks of the tiers sharing it are dropped first
        (:meth:`_make_room`); heads still short (an event larger than the limit) are left so, and :meth:`add`
        drops their rows."""
        lack = {}  # chunks each head lacks
        for l, layer in enumerate(self.heads):
            for h, s in enumerate(layer):
                short = self._lack(s, int(counts[l, h]))
                if short > 0:
                    lack[l, h] = short
        if self.drops_oldest:
            self._make_room(lack, counts)
        for (l, h), short in lack.items():
            s = self.heads[l][h]
            for _ in range(short):
                try:
                    s.chunks.append(self._chunk(l, h))
                except TierFull:
                    break

    @staticmethod
    def _lack(s: HeadStore, count: int) -> int:
        """Chunks head ``s`` lacks for ``count`` more rows (0 or less: none)."""
        return -(-(s.n + count) // CHUNK) - len(s.chunks)

    def _make_room(self, lack: dict, counts: np.ndarray) -> None:
        """Drop the oldest chunks (:meth:`TierMemory.reclaim`) until the memory has room for the chunks ``lack``
        says the heads lack; a chunk dropped from one of this tier's heads changes what that head lacks."""
        memory, total = self.pool.memory, sum(lack.values())
        while total > memory.room(self.chunk_bytes):
            got = memory.reclaim(self)
            if got is None:
                return
            tier, (l, h) = got
            if tier is self:
                short = max(self._lack(self.heads[l][h], int(counts[l, h])), 0)
                total += short - lack.get((l, h), 0)
                lack[l, h] = short

    def hold(self, marks: list[np.ndarray]) -> None:
        """Keep from the RAM cap what undoing the open turns reads back from here (:mod:`kvlocal.engine.undo`): the
        rows their events evicted — those stored since ``marks`` (:meth:`mark_of` when each began, oldest first), and
        those stored before that left the device again since (a row brought back and evicted is not stored twice).
        The cap drops other rows first; where a head's oldest block holds such rows, the head keeps its rows for the
        turn (an event's own rows that find no room are dropped then: ``dropped_rows``). Empty: none held."""
        turns = {}
        for m in marks:
            if id(m) not in self._turns:
                self._seq += 1
            turns[id(m)] = self._turns.get(id(m)) or (self._seq, np.array(m, dtype=np.int64))
        self._turns = turns
        self._lost &= set(turns)
        first = min((seq for seq, _ in turns.values()), default=self._seq + 1)
        self._touched = {key: kept for key, rows in self._touched.items()
                         if (kept := [(seq, r) for seq, r in rows if seq >= first])}

    def _touch(self, s: HeadStore, layer: int, head: int, ids: np.ndarray) -> None:
        """Stored rows ``ids`` of a head left the device again: the open turns need them (:meth:`hold`)."""
        if self._turns:
            self._touched.setdefault((layer, head), []).append((self._seq, s.base + np.asarray(ids, dtype=np.int64)))

    def _held(self, s: HeadStore, layer: int, head: int) -> bool:
        """Whether the head's oldest chunk holds rows an open turn needs (:meth:`hold`)."""
        end = s.base + min(s.n, CHUNK)
        if not self._turns or end == s.base:
            return False
        if any(end > m[layer, head] for _, m in self._turns.values()):
            return True
        return any(((r >= s.base) & (r < end)).any() for _, r in self._touched.get((layer, head), ()))

    def intact(self, mark: np.ndarray) -> bool:
        """Whether the rows an undo to the open turn that began at ``mark`` reads back are all here (:meth:`hold`)."""
        return id(mark) not in self._lost

    def drop_oldest(self, layer: int, head: int, force: bool = False) -> bool | None:
        """The memory takes back this head's oldest chunk (:meth:`TierMemory.reclaim`): its rows go, those off the
        device counted in ``cap_dropped_rows``. True: done; None: not now (it holds rows :meth:`hold` keeps, and not
        ``force``: else the open turns can no longer be undone, :meth:`intact`); False: never (the tier is closed or
        the head holds no chunk)."""
        s = self.heads[layer][head]
        if not self.is_open or not s.chunks:
            return False
        if self._held(s, layer, head):
            if not force:
                return None
            self._lost |= set(self._turns)
        k, lost = s.drop_first_chunk()
        self.cap_dropped_rows += lost
        self.pool.free(k)
        return True

    def _chunk(self, layer: int, head: int):
        s = self.heads[layer][head]
        kb = s.row_k[0].itemsize * int(np.prod(s.row_k[1])) * CHUNK
        buf = self.pool.alloc(self.chunk_bytes)  # K's rows, then V's
        if self.drops_oldest:
            self.pool.memory.own(self, (layer, head))
        buf_k, buf_v = buf[:kb], buf[kb:]
        return (buf_k.view(s.row_k[0]).reshape(CHUNK, *s.row_k[1]), buf_v.view(s.row_v[0]).reshape(CHUNK, *s.row_v[1]))

    def add(self, layer: int, head: int, pos: np.ndarray, k: np.ndarray, v: np.ndarray, keys: np.ndarray,
            vnorm: np.ndarray) -> None:
        """Rows of one head leave the device: ``pos`` ``[m]`` (sorted), their raw ``k``/``v`` rows, their
        keys as float32 in the stored basis ``[m, key_dim]`` (for the page bounds) and value norms (NaN:
        unknown). Rows already stored (recalled before) are flagged off the device instead: only a head with rows
        on the device can have any (a stored row on the device is flagged so), so the others skip the lookup."""
        s = self.heads[layer][head]
        pos = np.asarray(pos, dtype=np.int64)
        if len(pos) == 0:
            return
        have = s.index_of(pos) if s.on_device[:s.n].any() else np.full(len(pos), -1)
        back = have >= 0
        if back.any():
            self._touch(s, layer, head, have[back])
            s.on_device[have[back]] = False
            known = ~np.isnan(vnorm[back])
            s.vnorm[have[back][known]] = vnorm[back][known]
            new = np.flatnonzero(~back)
            pos, k, v, keys, vnorm = pos[new], k[new], v[new], keys[new], vnorm[new]
        self.rows_out += len(pos)
        self._store(s, pos, k, v, keys, vnorm)

    def _store(self, s: HeadStore, pos: np.ndarray, k: np.ndarray, v: np.ndarray, keys: np.ndarray,
               vnorm: np.ndarray) -> None:
        """Append rows to a head's store, off the device (what its chunks cannot take is dropped and counted)."""
        room = len(s.chunks) * CHUNK - s.n
        if len(pos) > room:  # (the RAM cap holds fewer than one event stores)
            self.dropped_rows += len(pos) - room
            self.cap_dropped_rows += len(pos) - room
            pos, k, v, keys, vnorm = pos[:room], k[:room], v[:room], keys[:room], vnorm[:room]
        m = len(pos)
        if m == 0:
            return
        n0 = s.n
        self._grow_meta(s, n0 + m)
        for c in range(n0 // CHUNK, (n0 + m - 1) // CHUNK + 1):  # the chunks the rows n0 .. n0+m-1 fall in
            lo, hi = max(c * CHUNK, n0), min((c + 1) * CHUNK, n0 + m)
            ck, cv = s.chunks[c]
            ck[lo % CHUNK:lo % CHUNK + hi - lo] = k[lo - n0:hi - n0]
            cv[lo % CHUNK:lo % CHUNK + hi - lo] = v[lo - n0:hi - n0]
        s.pos[n0:n0 + m], s.vnorm[n0:n0 + m], s.on_device[n0:n0 + m] = pos, vnorm, False
        self._bound_pages(s, n0, np.asarray(keys, dtype=np.float32))
        s._indexed(pos, np.arange(n0, n0 + m))
        s.n += m

    @staticmethod
    def _bound_pages(s: HeadStore, n0: int, keys: np.ndarray) -> None:
        """Rows ``n0 ..`` with these keys joined the store: each page they fall in bounds them (element-wise min and
        max); the page begun before keeps its old rows' bound too (:func:`~kvlocal.kernels.page_boxes`)."""
        page_boxes(keys, n0, PAGE, s.kmin, s.kmax)

    @staticmethod
    def _grow_meta(s: HeadStore, n: int) -> None:
        if n <= len(s.pos):
            pages = -(-n // PAGE)
            if pages > len(s.kmin):
                s.kmin = _grown(s.kmin, pages)
                s.kmax = _grown(s.kmax, pages)
            return
        cap = max(n, 2 * len(s.pos), CHUNK)
        s.pos = _grown(s.pos, cap)
        s.vnorm = _grown(s.vnorm, cap)
        s.on_device = _grown(s.on_device, cap)
        pages = -(-cap // PAGE)
        s.kmin = _grown(s.kmin, pages)
        s.kmax = _grown(s.kmax, pages)

    # -- saved sessions ------------------------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        """The tier as named arrays (a saved session's): per head ``[n_layer, Hkv]`` the mark ``tier_n``
        (:meth:`mark_of`) and the ids its oldest rows dropped passed ``tier_base`` (rows held: their difference), then
        every head's rows, positions, norms, flags and page bounds concatenated in (layer, head) order."""
        stores = [s for layer in self.heads for s in layer]
        rows = [s.rows(np.arange(s.n)) for s in stores]
        first = stores[0] if stores else None
        return {
            "tier_n": self.mark_of(),
            "tier_base": np.array([[s.base for s in layer] for layer in self.heads], dtype=np.int64),
            "tier_pos": np.concatenate([s.pos[:s.n] for s in stores] or [np.zeros(0, np.int64)]),
            "tier_vnorm": np.concatenate([s.vnorm[:s.n] for s in stores] or [np.zeros(0, np.float32)]),
            "tier_on_device": np.concatenate([s.on_device[:s.n] for s in stores] or [np.zeros(0, bool)]),
            "tier_k": np.concatenate([r[0] for r in rows]) if rows else np.zeros(0, np.uint8),
            "tier_v": np.concatenate([r[1] for r in rows]) if rows else np.zeros(0, np.uint8),
            "tier_kmin": np.concatenate([s.kmin[:s.n_pages] for s in stores] or [np.zeros((0, first.key_dim))]),
            "tier_kmax": np.concatenate([s.kmax[:s.n_pages] for s in stores] or [np.zeros((0, first.key_dim))]),
        }

    def load_arrays(self, a: dict[str, np.ndarray]) -> None:
        """Fill this (empty) tier from :meth:`to_arrays` (``tier_base`` absent: none dropped); UsageError if they do
        not fit its shape or its memory."""
        base = np.asarray(a.get("tier_base", np.zeros_like(a["tier_n"])), dtype=np.int64)
        n = np.asarray(a["tier_n"], dtype=np.int64) - base
        stores = [s for layer in self.heads for s in layer]
        first = stores[0]
        if n.shape != (len(self.heads), len(self.heads[0])) or a["tier_k"].shape[1:] != first.row_k[1] \
                or a["tier_k"].dtype != first.row_k[0] or a["tier_v"].dtype != first.row_v[0]:
            raise UsageError("the saved recall tier does not fit this model and cache type")
        self.reserve(n)
        row, page = 0, 0
        for s, m, b in zip(stores, n.reshape(-1), base.reshape(-1)):
            m = int(m)
            s.base = int(b)
            pages = -(-m // PAGE)
            self._grow_meta(s, m)
            ids = np.arange(m)
            for ci in range(-(-m // CHUNK)):
                sel = ids[ci * CHUNK:(ci + 1) * CHUNK]
                if len(sel) and ci >= len(s.chunks):
                    raise SettingError("the saved recall tier does not fit under {recall_mem}: raise it or give "
                                       "{recall_dir}", "recall_mem")
                if len(sel):
                    s.chunks[ci][0][:len(sel)] = a["tier_k"][row + sel]
                    s.chunks[ci][1][:len(sel)] = a["tier_v"][row + sel]
            s.pos[:m], s.vnorm[:m] = a["tier_pos"][row:row + m], a["tier_vnorm"][row:row + m]
            s.on_device[:m] = a["tier_on_device"][row:row + m]
            s.kmin[:pages], s.kmax[:pages] = a["tier_kmin"][page:page + pages], a["tier_kmax"][page:page + pages]
            s.n = m
            s.forget_index()
            row, page = row + m, page + pages

    def mark_of(self) -> np.ndarray:
        """``[n_layer, Hkv]`` a mark to :meth:`truncate` back to: rows per head stored so far, the oldest dropped
        included (``base + n``)."""
        return np.array([[s.base + s.n for s in layer] for layer in self.heads], dtype=np.int64)

    def truncate(self, mark: np.ndarray) -> None:
        """Forget the rows stored after :meth:`mark_of` gave ``mark`` (an engine restored to a snapshot: the
        tokens of the undone turn are gone; older rows moved since are back on the device)."""
        for l, layer in enumerate(self.heads):
            for h, s in enumerate(layer):
                keep = int(mark[l, h]) - s.base
                if keep < s.n:
                    s.n = max(keep, 0)
                    s.forget_index()

    def renumber(self, layer: int, head: int, ids: np.ndarray, pos: np.ndarray, turn_keys) -> None:
        """Positions moved back (an endless chat, :meth:`kvlocal.engine.positions.Positions.move`): a head keeps
        only its rows ``ids``, now at positions ``pos`` (increasing), each key turned by its move
        (``turn_keys(k rows, delta)`` → ``(k rows, float32 keys in the stored basis)``), stored again in
        position order with fresh page bounds. The others are forgotten; those off the device count as dropped."""
        s = self.heads[layer][head]
        ids, pos = np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64)
        self.dropped_rows += int((~s.on_device[:s.n]).sum() - (~s.on_device[ids]).sum())
        k, v = s.rows(ids)
        k, keys = turn_keys(k, pos - s.pos[ids])
        vnorm, flags = s.vnorm[ids].copy(), s.on_device[ids].copy()
        s.n = 0
        s.forget_index()
        self._store(s, pos, k, v, keys, vnorm)
        s.on_device[:len(ids)] = flags

    def clear(self) -> int:
        """Forget every row (their chunks are kept for reuse); returns how many were off the device."""
        gone = sum(int((~s.on_device[:s.n]).sum()) for layer in self.heads for s in layer)
        self.truncate(np.zeros((len(self.heads), len(self.heads[0])), np.int64))
        self.dropped_rows += gone
        return gone

    def sync(self, device_true: np.ndarray) -> None:
        """Flag as on the device exactly the rows whose (layer, head, position) the device holds:
        ``device_true`` ``[n_layer, Hkv, n]`` the true positions of its rows (-1: empty)."""
        for l, layer in enumerate(self.heads):
            for h, s in enumerate(layer):
                s.on_device[:s.n] = np.isin(s.pos[:s.n], device_true[l, h])

    def mark(self, layer: int, head: int, ids: np.ndarray, on_device: bool = True) -> None:
        """Rows ``ids`` of a head came back to the device (or left it again)."""
        ids = np.asarray(ids, dtype=np.int64)
        self.heads[layer][head].on_device[ids] = on_device
        if on_device:
            self.rows_in += len(ids)


def _grown(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` with room for ``n`` entries along its first axis (the old ones kept)."""
    if len(a) >= n:
        return a
    out = np.zeros((n, *a.shape[1:]), dtype=a.dtype)
    out[:len(a)] = a
    return out


def tier_figures(tier: HostTier | None) -> dict:
    """The recall tier's memory under the names every front door prints (``Engine.kv_figures``: the chat's
    ``/stats``, the server's ``kv`` object, ``kvlocal run --json``): ``host_tier_bytes`` (its host memory: rows in
    RAM and in the file, bookkeeping), ``host_tier_cap`` (the RAM cap, one for all a server's conversations; None:
    none), ``host_tier_cap_used`` (RAM held under it, by every tier sharing it), ``host_tier_past_cap`` (what
    happens past it: ``drop_oldest`` or ``spill``; None: no cap), ``host_tier_file_bytes`` (rows in the
    ``--recall-dir`` file), ``host_tier_dropped_rows`` (rows dropped for the cap). Recall off: zeros, None."""
    if tier is not None:
        return tier.figures()
    return dict(host_tier_bytes=0, host_tier_cap=None, host_tier_cap_used=0, host_tier_past_cap=None,
                host_tier_file_bytes=0, host_tier_dropped_rows=0)
