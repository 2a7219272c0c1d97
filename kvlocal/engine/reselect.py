"""Re-selection per question (the recall tier's side of :class:`~kvlocal.engine.Engine`): a question, and each
of its answer's first tokens, scores the device cells and the tier's best pages together and swaps rows in and
out (docs/recall.md). A mixin: the methods use the engine's context, scorer, tier, observation and plan steps."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from kvlocal.compress import observation_window
from kvlocal.engine.config import step_keeps
from kvlocal.engine.observation import joined
from kvlocal.recall import choose_candidates, with_candidates


class Reselection:
    def recall(self, probe: Sequence[int] | None, pending: int | None = None) -> int:
        """Re-select the cache for a new question (the recall tier, :mod:`kvlocal.recall`): decode the
        probe with query capture (then remove it), rank the tier's pages by their key bounds, score the
        device cells and the best pages' rows together with the method, and swap — the best rows of each
        head come in, the rows they displace go out to the tier. ``pending``: the tokens that come next (the
        question; the probe's by default), whose cells the re-selection leaves free. Returns the rows brought back
        (0 without a tier, or when it holds nothing off the device)."""
        if self.tier is None or self.tier.n_rows == 0:
            return 0
        self._check_usable()
        t0 = time.perf_counter()
        pending = len(probe or ()) if pending is None else pending
        probe = self._probe_tokens(probe)
        q, q_pos = self._observe(probe)[:2]
        self.observations.keep_prompt(probe, q, q_pos)  # the question's queries: for its answer's decode-time events
        moved = self._reselect(q, q_pos, self.recall_candidates, pending)
        self.stats.recall_events += 1
        self.stats.recall_seconds += time.perf_counter() - t0
        return moved

    def _recall_step(self, tok: int) -> bool:
        """Before an answer's token ``tok`` is decoded: re-select with its own query, the one that predicts the
        next token (Quest's per-step selection, as a swap). The question's queries choose what the answer starts
        from; a fact's later tokens (a code's next digit) are found by the query that copies them. ``tok`` is
        decoded with its query captured; if that decode predicts the next token with a probability above
        ``recall_step_confidence``, or comes fewer than ``recall_step_every`` steps after the last swap, it is kept
        (no swap: returns True) and its query held for the next swap (a swap serves the tokens after it: " pass",
        " key" find the key " is" goes on to), else it is removed, the cache re-selected by its query and the held
        ones, and the caller decodes ``tok`` again. Counted in ``recall_steps`` (``recall_steps_confident``: the
        kept ones); ``recall_step_seconds``: the steps that swapped."""
        if self.tier.n_rows == 0:
            return False
        t0 = time.perf_counter()
        self.stats.recall_steps += 1
        sure = step_keeps(0 if self._held is None else len(self._held[1]), self.recall_step_every,
                          self.recall_step_confidence)  # None: no logits to compute, the step swaps
        q, q_pos, kept = self._observe([tok], keep_if=sure)
        if self._held is not None:
            q, q_pos = joined(self._held, (q, q_pos))
        self._held = (q, q_pos) if kept else None
        if kept:  # the token's own decode: no time of recall's
            self.stats.recall_steps_confident += 1
            return True
        self._reselect(q, q_pos, self.recall_step_candidates)
        self.stats.recall_step_seconds += time.perf_counter() - t0
        return False

    def _reselect(self, q: list[np.ndarray], q_pos: np.ndarray, candidates: float, pending: int = 0) -> int:
        """Score the device cells and the tier's best candidates (``candidates`` × the head budget of rows) for
        the observation ``q`` at ``q_pos`` together, and swap; returns the rows brought back. Each head keeps the
        rows the context has room for while the answer is written (:meth:`_recall_width`), ``pending``: tokens
        of the turn still to come."""
        w = observation_window(self.scorer) or len(q_pos)
        cands = choose_candidates(self.tier, [self.basis.queries(qi[:, -w:] * self._q_scale) for qi in q],
                                  max(1, int(candidates * self.head_budget)))
        if cands.width == 0:
            return 0
        before = self.tier.rows_in
        union, values = with_candidates(self._read(), self.tier, cands, self.kv, self.recall_span)
        width = self._recall_width(pending)
        plan = self._plan(union, q, q_pos, width)
        values(plan)  # the values of the tier rows it keeps
        self._apply(union, plan)
        if width > self.head_budget:  # the turn's tokens go in with no compression: its answer reads these rows
            self._settled = self.last_plan.n_slots + pending
        self.stats.recall_candidates += cands.n_rows
        return self.tier.rows_in - before

    def _recall_width(self, pending: int) -> int:
        """A re-selection's head budget. The context holds the budget plus the headroom that prefill chunks fill;
        while a question is answered that headroom holds recalled rows — no device byte more — less the cells the
        turn's ``pending`` tokens, ``recall_room`` answer tokens and a probe (the reserve) need. Never below the
        budget; the first compression during the answer returns to it."""
        if not self.recall_room:
            return self.head_budget
        cells = self.ctx.n_ctx - self._reserve() - pending - self.recall_room
        return max(self.head_budget, self.scorer.budget_for_cells(cells))
