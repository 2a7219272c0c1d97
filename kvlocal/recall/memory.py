"""The recall tier's memory: RAM in chunks under a cap (:class:`TierMemory`, one per engine or shared by a server's
conversations), a tier's chunks in RAM or past the cap in a memory-mapped spill file (:class:`Pool`), and the cap's
settings (``--recall-mem``, ``--recall-dir``). :mod:`kvlocal.recall.tier` stores rows in these chunks.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from collections import deque
from typing import Protocol

import numpy as np

from kvlocal.errors import SettingError, UsageError
from kvlocal.units import parse_size


class ChunkOwner(Protocol):
    """A tier as :class:`TierMemory` sees it (:class:`~kvlocal.recall.tier.HostTier`): it registers its chunks and
    gives back its oldest when asked."""

    chunk_bytes: int
    is_open: bool

    def drop_oldest(self, layer: int, head: int, force: bool = False) -> bool | None: ...

EXTENT = 64 << 20  # bytes the spill file grows by
SLAB = 8 << 20  # bytes of RAM allocated at once, then cut into chunks (TierMemory._from_slab)
RECALL_MEM_SHARE = 8  # the default RAM cap: this fraction (1/8) of the memory the process may use ...
RECALL_MEM_MAX = 4 << 30  # ... and at most this (docs/recall.md § Memory: why)

class TierFull(Exception):
    """The pool cannot take a chunk (RAM limit reached, no spill folder)."""


class TierMemory:
    """The RAM that the recall tiers given it may hold: at most ``limit`` bytes (None: no limit). A chat's engine
    has its own; ``kvlocal serve`` gives every conversation's tier the same one, so that one cap holds for all.

    RAM goes out in chunks (:meth:`take`), cut from slabs no larger than what the limit leaves; a chunk given back
    (:meth:`give`: its rows dropped, or its tier closed) waits for the next one asked for and stays counted in
    ``used``, which is the RAM held. The tiers that drop their oldest rows past the limit register each chunk they
    take (:meth:`own`), and :meth:`reclaim` takes the oldest of them all back. One thread at a time (a server's
    worker)."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.used = 0
        self._free: dict[int, list[np.ndarray]] = {}  # chunks given back, by size
        self._slab, self._slab_used = np.empty(0, dtype=np.uint8), 0  # RAM chunks are cut from the last slab
        self._order: deque = deque()  # (weak reference to a tier, (layer, head)) per droppable chunk, oldest first

    @classmethod
    def of(cls, recall_mem: "int | str | TierMemory | None") -> "TierMemory":
        """The memory ``recall_mem`` asks for (Engine's and Chat's keyword): a TierMemory itself (shared), bytes or
        a size (``"2G"``), ``"none"`` (no limit), or None: :func:`default_recall_mem`."""
        if isinstance(recall_mem, TierMemory):
            return recall_mem
        value = recall_mem_setting(recall_mem)
        return cls(default_recall_mem() if value is None else None if value == "none" else value)

    @property
    def setting(self) -> int | str:
        """The limit as a chat's settings keep it: bytes, or ``"none"``."""
        return "none" if self.limit is None else self.limit

    def room(self, nbytes: int) -> float:
        """How many chunks of ``nbytes`` may still be had without dropping rows."""
        spare = float("inf") if self.limit is None else (self.limit - self.used) // nbytes
        return len(self._free.get(nbytes, ())) + spare

    def take(self, nbytes: int) -> np.ndarray | None:
        """A uint8 chunk of ``nbytes`` of RAM (one given back first), or None when the limit has no room for it."""
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        if self.limit is not None and self.used + nbytes > self.limit:
            return None
        self.used += nbytes
        return self._from_slab(nbytes)

    def give(self, chunk: np.ndarray) -> None:
        """A chunk is no longer used: it waits for the next :meth:`take` of its size (still counted in ``used``)."""
        self._free.setdefault(chunk.nbytes, []).append(chunk)

    def own(self, tier: ChunkOwner, key: tuple[int, int]) -> None:
        """``tier`` took a chunk for its head ``key``: the newest :meth:`reclaim` may take back. Entries of closed
        tiers are dropped once they are the majority, so that the order stays as long as the chunks held."""
        if len(self._order) > 64 + 2 * (self.used // tier.chunk_bytes):
            self._order = deque(e for e in self._order if (t := e[0]()) is not None and t.is_open)
        self._order.append((weakref.ref(tier), key))

    def reclaim(self, asking: ChunkOwner) -> tuple[ChunkOwner, tuple[int, int]] | None:
        """Drop the oldest chunk of all the tiers that registered theirs (:meth:`HostTier.drop_oldest`; it is given
        back here) that none holds (:meth:`HostTier.hold`), else the oldest another tier than ``asking`` holds (a
        conversation waiting for its next turn: its last one can no longer be undone). Returns the tier and head it
        was taken from, or None when no tier has one to give. A held chunk waits at the end of the order."""
        for force in (False, True):
            for _ in range(len(self._order)):
                ref, key = self._order.popleft()
                tier = ref()
                if tier is None:
                    continue
                done = tier.drop_oldest(*key, force=force and tier is not asking)
                if done:
                    return tier, key
                if done is None:
                    self._order.append((ref, key))
        return None

    def _from_slab(self, nbytes: int) -> np.ndarray:
        """RAM for a chunk (counted in ``used`` already), cut from a slab of up to ``SLAB`` bytes (:func:`_slab`).
        A slab is never larger than what ``limit`` leaves: ``used`` counts the chunks handed out, the rest of the
        last slab waits for the next ones."""
        if nbytes > len(self._slab) - self._slab_used:
            room = SLAB if self.limit is None else min(SLAB, nbytes + self.limit - self.used)
            self._slab, self._slab_used = _slab(max(room, nbytes)), 0
        out = self._slab[self._slab_used:self._slab_used + nbytes]
        self._slab_used += nbytes
        return out


class Pool:
    """Byte buffers for one tier's chunks: RAM from ``memory`` (a :class:`TierMemory`; by default its own, without
    a limit), then extents of a file in ``spill_dir``. ``ram_bytes`` and ``file_bytes`` say what this tier holds."""

    def __init__(self, memory: TierMemory | None = None, spill_dir: str | os.PathLike | None = None):
        self.memory = TierMemory() if memory is None else memory
        self.spill_dir = spill_dir
        self.ram_bytes = self.file_bytes = 0
        self._ram: dict[int, np.ndarray] = {}  # its RAM chunks by address: given back by free() or close()
        self._file = None  # (fd, path)
        self._extents: list[mmap.mmap] = []
        self._free = 0  # bytes left in the last extent
        if spill_dir is not None:
            self._open_file()

    def _open_file(self) -> None:
        d = check_spill_dir(self.spill_dir)
        try:
            fd, path = tempfile.mkstemp(prefix="kvlocal-recall-", suffix=".tier", dir=d)
        except OSError as e:
            raise SettingError(f"{{recall_dir}} {d} is not writable ({e.strerror}): give a folder you can write to",
                               "recall_dir") from None
        os.unlink(path)  # the file lives as long as this process holds it: nothing is left behind
        self._file = (fd, path)

    def alloc(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes``; TierFull when neither RAM nor the file may take it; UsageError
        when the disk is full."""
        buf = self.memory.take(nbytes)
        if buf is not None:
            self.ram_bytes += nbytes
            self._ram[buf.ctypes.data] = buf
            return buf
        if self._file is None:
            raise TierFull
        if nbytes > self._free:
            self._grow(max(EXTENT, nbytes))
        m = self._extents[-1]
        off = len(m) - self._free
        self._free -= nbytes
        self.file_bytes += nbytes
        return np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=off)

    def free(self, chunk: np.ndarray) -> None:
        """The RAM chunk that begins where ``chunk`` (a view of it) does goes back to the memory."""
        buf = self._ram.pop(chunk.ctypes.data)
        self.ram_bytes -= buf.nbytes
        self.memory.give(buf)

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
        """Its RAM back to the memory (for the other tiers sharing it), its file closed."""
        for buf in self._ram.values():
            self.memory.give(buf)
        self._ram.clear()
        self.ram_bytes = 0
        self._extents.clear()  # views into them may outlive this (numpy keeps the mmap alive)
        if self._file is not None:
            os.close(self._file[0])
            self._file = None


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


def default_spill_dir() -> str:
    """The folder a bare ``--recall-dir`` names: ``recall`` in kvlocal's cache folder (~/.cache/kvlocal)."""
    from kvlocal.models import cache_dir

    return os.fspath(cache_dir() / "recall")


def check_spill_dir(path) -> str:
    """``--recall-dir``: the folder (:func:`default_spill_dir` is made if missing), or UsageError naming the fix."""
    d = os.fspath(path)
    if d == default_spill_dir():
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise SettingError(f"{{recall_dir}} {d} cannot be made ({e.strerror}): give a folder you can write to",
                               "recall_dir") from None
    if not os.path.isdir(d):
        raise SettingError(f"{{recall_dir}} {d}: no such folder: create it, or leave {{recall_dir}} out to keep the tier "
                           f"in RAM", "recall_dir")
    return d


def recall_mem_setting(value) -> int | str | None:
    """``--recall-mem`` (Engine's and Chat's ``recall_mem``) as a chat's settings keep it: bytes, ``"none"`` (no
    limit) or None (:func:`default_recall_mem`); a size text is parsed, a :class:`TierMemory` gives its limit.
    SettingError naming the field for anything else."""
    if value is None or isinstance(value, TierMemory):
        return None if value is None else value.setting
    if isinstance(value, str) and value.strip().lower() == "none":
        return "none"
    try:  # the setting named as {recall_mem}: each front door words it (kvlocal.errors)
        return parse_size(value, "{recall_mem}") if isinstance(value, str) else parse_size(str(int(value)), "{recall_mem}")
    except (UsageError, TypeError, ValueError) as e:
        why = e if isinstance(e, UsageError) else f"{{recall_mem}} {value!r} is not a size"
        raise SettingError(f"{why}; or none for no limit", "recall_mem") from None


def machine_memory() -> int | None:
    """Bytes of memory this process may use: the machine's physical memory, or its cgroup's limit where lower (a
    container); None where the platform tells neither."""
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = int(limit) if total is None else min(total, int(limit))
    return total


def default_recall_mem() -> int:
    """The tier's RAM cap when none is given: 1/``RECALL_MEM_SHARE`` of :func:`machine_memory`, at most
    ``RECALL_MEM_MAX`` (that too where the memory is unknown)."""
    ram = machine_memory()
    return RECALL_MEM_MAX if ram is None else min(ram // RECALL_MEM_SHARE, RECALL_MEM_MAX)
