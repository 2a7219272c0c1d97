"""The context's cells as an engine fills them: where the next token goes (``n_past``), the last logits, decodes under
Ctrl-C control that take back what they added when cut short, and the live-cell figures. The engine's parts that
decode or move cells (the observer, the compressor, positions) are each handed this one object."""

from __future__ import annotations

import contextlib

import numpy as np

from kvlocal.engine.interrupts import interrupts_deferred


class Cells:
    """Sequence 0 of ``ctx`` (its eval callback: ``capture``), read through the backend ``kv``; the live-cell figures
    go to ``stats``."""

    def __init__(self, ctx, capture, kv, stats):
        self.ctx, self.capture, self.kv, self.stats = ctx, capture, kv, stats
        self.n_past = 0  # next position
        self.logits: np.ndarray | None = None
        self.broken: str | None = None  # set when a failed rewrite lost the cache: nothing more may run

    def check_usable(self) -> None:
        if self.broken:
            raise RuntimeError(f"this engine lost its cache ({self.broken}): start a new one")

    @contextlib.contextmanager
    def rollback(self):
        """Run a decode; if it fails or is interrupted (Ctrl-C), remove every cell past ``n_past`` so the
        cache is what it was before, and re-raise."""
        try:
            yield
        except BaseException:
            self.capture.disarm()
            self.ctx.remove(self.n_past, -1)
            self.note_live()
            raise

    def decode(self, tokens, positions, logits) -> np.ndarray:
        """``ctx.decode`` under Ctrl-C control: a SIGINT while llama.cpp computes (and calls our eval
        callback, where a KeyboardInterrupt would be swallowed by ctypes) stops the graph at its next
        node and is raised when llama.cpp returns (inside :meth:`rollback`, which drops the cells)."""
        try:
            with interrupts_deferred(self.capture.request_stop):
                return self.ctx.decode(tokens, positions, logits)
        finally:
            self.capture.clear_stop()

    def note_live(self) -> None:
        self.stats.kv_cells_live = len(self.kv.positions())
        self.stats.kv_cells_live_peak = max(self.stats.kv_cells_live_peak, self.stats.kv_cells_live)

    def live(self) -> int:
        return self.stats.kv_cells_live
