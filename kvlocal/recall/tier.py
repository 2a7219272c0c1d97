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

Memory. Rows live in chunks of ``CHUNK`` rows taken from a :class:`Pool`: host RAM up to ``mem_limit``
bytes, then (with ``spill_dir``) a file in that folder, memory-mapped and grown by preallocated extents
(a full disk fails the allocation, before any row is moved, instead of a SIGBUS on a sparse page). With
a RAM limit and no folder, rows that no longer fit are dropped and counted (``dropped_rows``).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np

from kvlocal.compress.kernels import gather_rows, page_boxes
from kvlocal.errors import UsageError

PAGE = 16  # rows per page (Quest uses 16)
CHUNK = 16 * PAGE  # rows per storage chunk: the unit of allocation (an event stores hundreds of rows a head)
EXTENT = 64 << 20  # bytes the spill file grows by
SLAB = 8 << 20  # bytes of RAM allocated at once, then cut into chunks (Pool._from_slab)


class TierFull(Exception):
    """The pool cannot take a chunk (RAM limit without a spill folder)."""


class Pool:
    """Byte buffers for the tier's chunks: RAM up to ``mem_limit`` (None: no limit), then extents of a
    file in ``spill_dir``. ``ram_bytes`` and ``file_bytes`` say what is in use."""

    def __init__(self, mem_limit: int | None = None, spill_dir: str | os.PathLike | None = None):
        self.mem_limit, self.spill_dir = mem_limit, spill_dir
        self.ram_bytes = self.file_bytes = 0
        self._file = None  # (fd, path)
        self._extents: list[mmap.mmap] = []
        self._free = 0  # bytes left in the last extent
        self._slab, self._slab_used = np.empty(0, dtype=np.uint8), 0  # RAM chunks are cut from the last slab
        if spill_dir is not None:
            self._open_file()

    def _open_file(self) -> None:
        d = check_spill_dir(self.spill_dir)
        try:
            fd, path = tempfile.mkstemp(prefix="kvlocal-recall-", suffix=".tier", dir=d)
        except OSError as e:
            raise UsageError(f"--recall-dir {d} is not writable ({e.strerror}): give a folder you can write to") from None
        os.unlink(path)  # the file lives as long as this process holds it: nothing is left behind
        self._file = (fd, path)

    def alloc(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes``; TierFull when neither RAM nor the file may take it; UsageError
        when the disk is full."""
        if self.mem_limit is None or self.ram_bytes + nbytes <= self.mem_limit:
            self.ram_bytes += nbytes
            return self._from_slab(nbytes)
        if self._file is None:
            raise TierFull
        if nbytes > self._free:
            self._grow(max(EXTENT, nbytes))
        m = self._extents[-1]
        off = len(m) - self._free
        self._free -= nbytes
        self.file_bytes += nbytes
        return np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=off)

    def _from_slab(self, nbytes: int) -> np.ndarray:
        """RAM for a chunk (counted in ``ram_bytes`` already), cut from a slab of up to ``SLAB`` bytes
        (:func:`_slab`). A slab is never larger than what ``mem_limit`` leaves: ``ram_bytes`` counts the chunks
        handed out, the rest of the last slab waits for the next ones."""
        if nbytes > len(self._slab) - self._slab_used:
            room = SLAB if self.mem_limit is None else min(SLAB, nbytes + self.mem_limit - self.ram_bytes)
            self._slab, self._slab_used = _slab(max(room, nbytes)), 0
        out = self._slab[self._slab_used:self._slab_used + nbytes]
        self._slab_used += nbytes
        return out

    def _grow(self, nbytes: int) -> None:
        fd, path = self._file
        start = os.fstat(fd).st_size
        try:
            os.posix_fallocate(fd, start, nbytes)  # real blocks now: a full disk fails here, not on a page fault
        except OSError as e:
            raise UsageError(f"the recall tier cannot grow in {self.spill_dir} ({e.strerror}): free disk space, "
                             f"give another --recall-dir, or a smaller document") from None
        self._extents.append(mmap.mmap(fd, nbytes, offset=start))
        self._free = nbytes

    @property
    def nbytes(self) -> int:
        return self.ram_bytes + self.file_bytes

    def close(self) -> None:
        self._extents.clear()  # views into them may outlive this (numpy keeps the mmap alive)
        if self._file is not None:
            os.close(self._file[0])
            self._file = None


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
    for an F16 cache, uint8 ``(bytes,)`` for a quantized one). ``mem_limit`` bytes of RAM (None: no limit),
    then ``spill_dir`` (None: drop what does not fit)."""

    def __init__(self, n_layer: int, n_head_kv: int, row_k: tuple, row_v: tuple, key_dim: int,
                 mem_limit: int | None = None, spill_dir: str | os.PathLike | None = None):
        row_k = (np.dtype(row_k[0]), tuple(row_k[1]))
        row_v = (np.dtype(row_v[0]), tuple(row_v[1]))
        self.row_bytes = row_k[0].itemsize * int(np.prod(row_k[1])) + row_v[0].itemsize * int(np.prod(row_v[1]))
        if mem_limit is not None and mem_limit < CHUNK * self.row_bytes:
            raise UsageError(f"--recall-mem {mem_limit:,} bytes is below one block of the tier ({CHUNK} rows of "
                             f"{self.row_bytes} bytes): give at least {CHUNK * self.row_bytes:,}, or leave it out")
        self.pool = Pool(mem_limit, spill_dir)
        self.heads = [[HeadStore(row_k, row_v, key_dim) for _ in range(n_head_kv)] for _ in range(n_layer)]
        self.dropped_rows = 0
        self.rows_out = 0  # rows that crossed from the device into the tier
        self.rows_in = 0  # rows brought back to the device

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

    def close(self) -> None:
        self.pool.close()

    # -- rows out ------------------------------------------------------------------------------------
    def reserve(self, counts: np.ndarray) -> None:
        """Make room for ``counts[l, h]`` more rows of each head before any row moves: the chunks they
        need are allocated now, so that running out of disk fails before the cache changes (UsageError).
        Heads the pool cannot take (RAM limit, no folder) are left short; :meth:`add` then drops rows."""
        for l, layer in enumerate(self.heads):
            for h, s in enumerate(layer):
                need = -(-(s.n + int(counts[l, h])) // CHUNK)
                while len(s.chunks) < need:
                    try:
                        s.chunks.append(self._chunk(s))
                    except TierFull:
                        break

    def _chunk(self, s: HeadStore):
        kb = s.row_k[0].itemsize * int(np.prod(s.row_k[1])) * CHUNK
        buf = self.pool.alloc(CHUNK * self.row_bytes)  # K's rows, then V's
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
        if len(pos) > room:
            self.dropped_rows += len(pos) - room
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
        max); the page begun before keeps its old rows' bound too (:func:`~kvlocal.compress.kernels.page_boxes`)."""
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
        """The tier as named arrays (a saved session's): rows per head ``tier_n`` ``[n_layer, Hkv]``, then
        every head's rows, positions, norms, flags and page bounds concatenated in (layer, head) order."""
        stores = [s for layer in self.heads for s in layer]
        rows = [s.rows(np.arange(s.n)) for s in stores]
        first = stores[0] if stores else None
        return {
            "tier_n": self.mark_of(),
            "tier_pos": np.concatenate([s.pos[:s.n] for s in stores] or [np.zeros(0, np.int64)]),
            "tier_vnorm": np.concatenate([s.vnorm[:s.n] for s in stores] or [np.zeros(0, np.float32)]),
            "tier_on_device": np.concatenate([s.on_device[:s.n] for s in stores] or [np.zeros(0, bool)]),
            "tier_k": np.concatenate([r[0] for r in rows]) if rows else np.zeros(0, np.uint8),
            "tier_v": np.concatenate([r[1] for r in rows]) if rows else np.zeros(0, np.uint8),
            "tier_kmin": np.concatenate([s.kmin[:s.n_pages] for s in stores] or [np.zeros((0, first.key_dim))]),
            "tier_kmax": np.concatenate([s.kmax[:s.n_pages] for s in stores] or [np.zeros((0, first.key_dim))]),
        }

    def load_arrays(self, a: dict[str, np.ndarray]) -> None:
        """Fill this (empty) tier from :meth:`to_arrays`; UsageError if they do not fit its shape."""
        n = np.asarray(a["tier_n"], dtype=np.int64)
        stores = [s for layer in self.heads for s in layer]
        first = stores[0]
        if n.shape != (len(self.heads), len(self.heads[0])) or a["tier_k"].shape[1:] != first.row_k[1] \
                or a["tier_k"].dtype != first.row_k[0] or a["tier_v"].dtype != first.row_v[0]:
            raise UsageError("the saved recall tier does not fit this model and cache type")
        self.reserve(n)
        row, page = 0, 0
        for s, m in zip(stores, n.reshape(-1)):
            m = int(m)
            pages = -(-m // PAGE)
            self._grow_meta(s, m)
            ids = np.arange(m)
            for ci in range(-(-m // CHUNK)):
                sel = ids[ci * CHUNK:(ci + 1) * CHUNK]
                if len(sel) and ci >= len(s.chunks):
                    raise UsageError("the saved recall tier does not fit under --recall-mem: raise it or give --recall-dir")
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
        """``[n_layer, Hkv]`` rows per head now: a mark to :meth:`truncate` back to."""
        return np.array([[s.n for s in layer] for layer in self.heads], dtype=np.int64)

    def truncate(self, mark: np.ndarray) -> None:
        """Forget the rows stored after :meth:`mark_of` gave ``mark`` (an engine restored to a snapshot: the
        tokens of the undone turn are gone; older rows moved since are back on the device)."""
        for l, layer in enumerate(self.heads):
            for h, s in enumerate(layer):
                if int(mark[l, h]) < s.n:
                    s.n = int(mark[l, h])
                    s.forget_index()

    def renumber(self, layer: int, head: int, ids: np.ndarray, pos: np.ndarray, turn_keys) -> None:
        """Positions moved back (an endless chat, :func:`kvlocal.engine.positions.reposition`): a head keeps
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


def _slab(nbytes: int) -> np.ndarray:
    """``nbytes`` of RAM the tier's rows are about to be written to, its pages mapped in one system call
    (``MAP_POPULATE``) where the platform has it: the first writes to fresh memory otherwise fault once per 4 KiB
    page, or stall while the kernel assembles a huge page (numpy advises huge pages for arrays of 4 MiB and more).
    Over SmolLM2's 8K prefill the tier's ``add`` gained more than its ``reserve`` (now the mapping) lost
    (``python -m tools.profile_prefill smollm2-135m``; docs/engine.md § the tier's memory, mapped at once)."""
    flags = getattr(mmap, "MAP_POPULATE", None)
    if flags is None:
        return np.empty(nbytes, dtype=np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    return np.frombuffer(m, dtype=np.uint8)  # the array keeps the map alive; its views, the array


def _grown(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` with room for ``n`` entries along its first axis (the old ones kept)."""
    if len(a) >= n:
        return a
    out = np.zeros((n, *a.shape[1:]), dtype=a.dtype)
    out[:len(a)] = a
    return out


def check_spill_dir(path) -> str:
    """``--recall-dir``: the folder, or UsageError naming the fix."""
    d = os.fspath(path)
    if not os.path.isdir(d):
        raise UsageError(f"--recall-dir {d}: no such folder: create it, or leave --recall-dir out to keep the tier in RAM")
    return d


def parse_size(text: str, flag: str = "--recall-mem") -> int:
    """A size flag (``--recall-mem``, ``--session-max``): a byte count with an optional unit (``512M``, ``2G``,
    ``1.5GiB``, ``800MB``); UsageError naming ``flag``."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = str(text).strip().lower().removesuffix("b").removesuffix("i")
    unit = s[-1] if s and s[-1] in units else ""
    try:
        value = float(s[:-1] if unit else s)
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a size: give bytes or a number with K, M or G (e.g. 512M)") from None
    if not np.isfinite(value) or value <= 0:
        raise UsageError(f"{flag} {text} must be > 0 (e.g. 512M)")
    return int(value * units[unit])
