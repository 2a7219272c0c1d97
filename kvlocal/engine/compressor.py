"""One compression event, step by step (kvlocal.engine.engine's module docstring):

    observe  the probe's queries (:class:`~kvlocal.engine.observer.Observer`)
    read     the cells' K/V rows and positions, or their positions alone (the backend)
    score    per layer and KV head, by the method's scorer
    plan     which source rows fill which cell (:class:`~kvlocal.compress.Plan`)
    apply    the cells rewritten by the backend; with a recall tier the rows dropped go there

The compressor owns the backend, the scorer, the latest plan and the cells it left (``settled``)."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from kvlocal.backends import CacheRead
from kvlocal.compress import Plan, observation_window, plan_layers
from kvlocal.engine.config import PLAN_WORKERS
from kvlocal.engine.interrupts import interrupts_deferred
from kvlocal.recall import evicted, store_evicted
from kvlocal.runtime import CacheLost


class Compressor:
    """Events on ``cells`` through the backend ``kv``, scored by ``scorer`` on the queries ``observer`` gives (scaled by
    ``q_scale``: the scorers compute q·k/√d, the model q·k·attn_scale), each head keeping ``head_budget`` rows; the
    rows dropped go to ``tier`` (None: none). ``before_apply(read, plan)`` and ``after_apply(rewrite, rows)``: what an
    open turn needs to undo an event (:mod:`kvlocal.engine.undo`). ``wo``: CriticalKV's W_O cache (its bytes
    counted)."""

    def __init__(self, cells, observer, kv, scorer, tier, stats, cfg, *, basis, q_scale: np.float32, head_budget: int,
                 budget_cells: int, wo, before_apply: Callable, after_apply: Callable):
        self.cells, self.observer, self.kv, self.scorer, self.tier, self.stats, self.cfg = (
            cells, observer, kv, scorer, tier, stats, cfg)
        self.basis, self.q_scale, self.wo = basis, q_scale, wo
        self.head_budget, self.budget_cells = head_budget, budget_cells
        self.before_apply, self.after_apply = before_apply, after_apply
        self.settled = budget_cells  # cells right after the latest compression (the budget before any)
        self.last_plan: Plan | None = None  # the latest compression event's plan

    def compress(self, probe: Sequence[int], observed=None, decoding: bool = False, head_budget: int | None = None,
                 reply: list[int] = ()) -> None:
        """One compression event back to the budget (``head_budget``: to fewer rows per head); ``observed``: the
        probe's queries if the last decode captured them over this cache, else the observer's (``decoding``: an
        event while generating ``reply``, observed by the queries its probe's tokens had, if kept)."""
        clock = time.perf_counter
        t0 = clock()
        q, q_pos = observed if observed is not None else self.observer.observation(probe, decoding, list(reply))
        t1 = clock()
        read = self.read()
        t2 = clock()
        plan = self.plan(read, q, q_pos, head_budget)
        t3 = clock()
        self.apply(read, plan)
        t4 = clock()
        s = self.stats
        s.compression_events += 1
        s.compression_seconds += t4 - t0
        for name, dt in (("observe", t1 - t0), ("read", t2 - t1), ("score", t3 - t2), ("apply", t4 - t3)):
            s.compression_breakdown[name] = s.compression_breakdown.get(name, 0.0) + dt

    def read(self) -> CacheRead:
        """The cells as one event reads them (a seam for tests that record what was scored)."""
        return self.kv.read()

    def plan(self, read: CacheRead, q: list[np.ndarray], q_pos: np.ndarray, head_budget: int | None = None) -> Plan:
        """The scorer's plan for the cells of ``read``, observed by the queries ``q`` at ``q_pos`` (each head keeps
        ``head_budget`` rows, the budget's by default)."""
        inputs = self.kv.layer_inputs(read, [qi * self.q_scale for qi in q], q_pos,
                                      n_sink=max(self.cfg.n_sink, self.stats.kv_cells_pinned),
                                      recent=self.cfg.recent, window_size=observation_window(self.scorer))
        plan = plan_layers(self.scorer, inputs, head_budget or self.head_budget,
                           workers=min(self.cells.ctx.n_threads, PLAN_WORKERS))
        self.last_plan = plan
        return plan

    def apply(self, read: CacheRead, plan: Plan) -> None:
        """Write ``plan`` into the cache; with a tier, the device rows it drops go there (room for them is made
        and the rows are copied before the cache changes: a full disk fails here, the cache as it was)."""
        rewrite = self.before_apply(read, plan)  # what an open turn needs to undo this event
        tier = self.tier
        if tier is not None:
            gone = evicted(read, plan)
            tier.reserve(np.stack([np.bincount(heads, minlength=plan.n_kv) for _, heads in gone]))
            rows = [self.kv.take_rows(read, l, cells, heads) for l, (cells, heads) in enumerate(gone)]
        # the cells, the engine's record of them and the tier change together: a Ctrl-C waits for all
        with interrupts_deferred():
            try:
                self.kv.apply(read, plan)
            except CacheLost as e:
                self.cells.broken = str(e)
                raise
            finally:
                self.cells.note_live()
            self.settled = max(self.budget_cells, plan.n_slots)
            dropped = tier.dropped_rows if tier is not None else 0
            if tier is not None:
                store_evicted(tier, read, plan, self.basis, gone, rows)
            self.after_apply(rewrite, rows if tier is not None and tier.dropped_rows > dropped else None)
        s = self.stats
        s.host_kv_bytes, s.host_bytes_peak = self.kv.host_kv_bytes, self.kv.host_bytes_peak
        s.device_transfers = self.cells.ctx.counters()["transfers"]
        s.wo_cache_bytes = self.wo.nbytes if self.wo is not None else 0
        if tier is not None:
            s.host_tier_bytes, s.recall_rows_out, s.recall_rows_in = tier.nbytes, tier.rows_out, tier.rows_in
            s.recall_dropped_rows = tier.dropped_rows
