"""Re-selection per question, the recall tier's behaviour: a question, and each of its answer's first tokens, scores the
device cells and the tier's best pages together and swaps rows in and out (docs/recall.md).

:class:`Reselection` owns the tier, its settings and the answer's step state; the engine's observer and compressor
(:mod:`kvlocal.engine`, the layer above) are handed to it: it decodes a probe with the first and reads, plans and
applies a swap with the second."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from kvlocal.compress import observation_window
from kvlocal.recall.select import choose_candidates, with_candidates
from kvlocal.runtime import top_probability


class Reselection:
    """The re-selections of ``tier`` (:class:`~kvlocal.recall.HostTier`) on an engine's cells: ``observer`` decodes a
    probe with query capture (``observe(probe, keep_if=, question=)``), ``compressor`` reads the cells, plans a swap
    and applies it (``read``, ``plan``, ``apply``, its ``scorer``, ``basis``, ``q_scale``, ``head_budget``, ``kv``,
    ``settled``, ``last_plan``); figures go to ``stats``. ``cells``: the context's cells (``n_ctx``) less ``reserve``
    (a probe's) that a re-selection may fill. The settings are :class:`~kvlocal.engine.Engine`'s ``recall_*``."""

    def __init__(self, tier, observer, compressor, stats, *, n_ctx: int, reserve: int, candidates: float, steps: int,
                 step_candidates: float, step_confidence: float, step_every: int, room: int, span: str):
        self.tier, self.observer, self.compressor, self.stats = tier, observer, compressor, stats
        self.n_ctx, self.reserve = n_ctx, reserve
        self.candidates, self.steps, self.step_candidates = candidates, steps, step_candidates
        self.step_confidence, self.step_every, self.room, self.span = step_confidence, step_every, room, span
        self.answering = False  # the tokens generated now answer a question that re-selected the cache
        self.held: tuple[list[np.ndarray], np.ndarray] | None = None  # the queries of kept steps, for the next swap

    def question(self, probe: Sequence[int], pending: int) -> int:
        """Re-select the cache for a new question: decode ``probe`` with query capture (then remove it), rank the
        tier's pages by their key bounds, score the device cells and the best pages' rows together with the method,
        and swap — the best rows of each head come in, the rows they displace go out to the tier. ``pending``: the
        tokens that come next (the question), whose cells the re-selection leaves free. Returns the rows brought
        back (0 when the tier holds nothing off the device)."""
        t0 = time.perf_counter()
        q, q_pos = self.observer.observe(probe, question=True)[:2]  # its queries: for its answer's decode-time events
        moved = self.swap(q, q_pos, self.candidates, pending)
        self.stats.recall_events += 1
        self.stats.recall_seconds += time.perf_counter() - t0
        return moved

    def answers(self, n_reply: int, eog: bool) -> bool:
        """Whether the answer's next token (``n_reply`` generated before it; ``eog``: it ends the answer) re-selects
        first (:meth:`step`): the first ``steps`` tokens of an answer to a question that re-selected."""
        return self.answering and n_reply < self.steps and not eog

    def step(self, tok: int) -> bool:
        """Before an answer's token ``tok`` is decoded: re-select with its own query, the one that predicts the
        next token (Quest's per-step selection, as a swap). The question's queries choose what the answer starts
        from; a fact's later tokens (a code's next digit) are found by the query that copies them. ``tok`` is
        decoded with its query captured; if that decode predicts the next token with a probability above
        ``step_confidence``, or comes fewer than ``step_every`` steps after the last swap, it is kept
        (no swap: returns True) and its query held for the next swap (a swap serves the tokens after it: " pass",
        " key" find the key " is" goes on to), else it is removed, the cache re-selected by its query and the held
        ones, and the caller decodes ``tok`` again. Counted in ``recall_steps`` (``recall_steps_confident``: the
        kept ones); ``recall_step_seconds``: the steps that swapped."""
        if self.tier.n_rows == 0:
            return False
        t0 = time.perf_counter()
        self.stats.recall_steps += 1
        sure = step_keeps(0 if self.held is None else len(self.held[1]), self.step_every,
                          self.step_confidence)  # None: no logits to compute, the step swaps
        q, q_pos, kept = self.observer.observe([tok], keep_if=sure)
        if self.held is not None:
            q, q_pos = joined(self.held, (q, q_pos))
        self.held = (q, q_pos) if kept else None
        if kept:  # the token's own decode: no time of recall's
            self.stats.recall_steps_confident += 1
            return True
        self.swap(q, q_pos, self.step_candidates)
        self.stats.recall_step_seconds += time.perf_counter() - t0
        return False

    def swap(self, q: list[np.ndarray], q_pos: np.ndarray, candidates: float, pending: int = 0) -> int:
        """Score the device cells and the tier's best candidates (``candidates`` × the head budget of rows) for
        the observation ``q`` at ``q_pos`` together, and swap; returns the rows brought back. Each head keeps the
        rows the context has room for while the answer is written (:meth:`width`), ``pending``: tokens of the turn
        still to come."""
        c = self.compressor
        w = observation_window(c.scorer) or len(q_pos)
        cands = choose_candidates(self.tier, [c.basis.queries(qi[:, -w:] * c.q_scale) for qi in q],
                                  max(1, int(candidates * c.head_budget)))
        if cands.width == 0:
            return 0
        before = self.tier.rows_in
        union, values = with_candidates(c.read(), self.tier, cands, c.kv, self.span)
        width = self.width(pending)
        plan = c.plan(union, q, q_pos, width)
        values(plan)  # the values of the tier rows it keeps
        c.apply(union, plan)
        if width > c.head_budget:  # the turn's tokens go in with no compression: its answer reads these rows
            c.settled = c.last_plan.n_slots + pending
        self.stats.recall_candidates += cands.n_rows
        return self.tier.rows_in - before

    def width(self, pending: int) -> int:
        """A re-selection's head budget. The context holds the budget plus the headroom that prefill chunks fill;
        while a question is answered that headroom holds recalled rows — no device byte more — less the cells the
        turn's ``pending`` tokens, ``room`` answer tokens and a probe (the reserve) need. Never below the
        budget; the first compression during the answer returns to it."""
        c = self.compressor
        if not self.room:
            return c.head_budget
        cells = self.n_ctx - self.reserve - pending - self.room
        return max(c.head_budget, c.scorer.budget_for_cells(cells))


def step_keeps(held: int, every: int, confidence: float):
    """An answer step's ``keep_if`` (the observer's ``observe``): None where every step swaps; else a test of the
    step's logits that is true where it keeps its decode — fewer than ``every`` steps past the last swap with the
    ``held`` queries waiting, or a next token more probable than ``confidence``."""
    if held + 1 < every:
        return lambda logits: True
    return None if confidence >= 1 else lambda logits: top_probability(logits) > confidence


def joined(a, b):
    """Two observations (per compressed layer queries ``[Hq, w, d]``, and positions ``[w]``) as one, ``a`` first."""
    return [np.concatenate(x, axis=1) for x in zip(a[0], b[0])], np.concatenate([a[1], b[1]])
