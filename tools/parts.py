"""Named parts of the engine timed by a wall clock, with the page faults each took, for the profiling tools
(``tools.profile_recall``, ``tools.profile_prefill``). A part is wrapped where it is looked up: a method on its
class, a module function in the module that calls it. Parts nest (an outer part's figures include its inner
ones'), and the fault count is the process's, so work on other threads during a part counts in it; a part that runs
on several threads at once adds up their times."""

from __future__ import annotations

import collections
import functools
import threading
import time

try:
    import resource
except ImportError:  # (no resource module on Windows: faults count 0 there)
    resource = None


def minor_faults() -> int:
    """The process's minor page faults so far (memory given by the kernel on first touch, or found in its caches)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


class Parts:
    def __init__(self):
        self.seconds: dict = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.faults: collections.Counter = collections.Counter()
        self._lock = threading.Lock()  # parts may run on several threads at once (the layers' planning)

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        """Replace ``owner.name`` (a plain method or function) by a wrapper that adds its wall time, a call and its
        minor page faults to ``label`` (default: ``name``)."""
        label = label or name
        f = getattr(owner, name)

        @functools.wraps(f)
        def wrapper(*a, **kw):
            t0, f0 = time.perf_counter(), minor_faults()
            try:
                return f(*a, **kw)
            finally:
                with self._lock:
                    self.seconds[label] += time.perf_counter() - t0
                    self.calls[label] += 1
                    self.faults[label] += minor_faults() - f0

        setattr(owner, name, wrapper)

    def wrap_each(self, owner, names, prefix: str = "") -> None:
        """:meth:`wrap` each of ``names`` on ``owner``, labelled ``prefix + name``."""
        for name in names:
            self.wrap(owner, name, prefix + name)

    def by_time(self) -> list[str]:
        """The parts that ran, the longest first."""
        return sorted(self.seconds, key=lambda k: -self.seconds[k])
