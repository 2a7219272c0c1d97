"""How a compression event's observation is decoded: the probe after a prompt chunk, or the chunk's own last tokens
(``prefill_observe``); a probe alone (a question, a step); and a decode-time event's, from the queries its tokens had
(``decode_observe``). The queries one decode leaves for later events are its :class:`~kvlocal.engine.observation.
Observations`; docs/engine.md § Where the observation window comes from."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np


class Observer:
    """Decodes observations into ``cells`` (with their query capture) as ``cfg`` says, keeps them in ``observations``
    and counts them in ``stats``; ``last_probe``: the tokens whose queries scored the latest event."""

    def __init__(self, cells, cfg, observations, stats):
        self.cells, self.cfg, self.observations, self.stats = cells, cfg, observations, stats
        self.last_probe: list[int] = []

    def observation(self, probe: list[int], decoding: bool, reply: list[int]):
        """An event's observation by ``probe``: while generating (``decoding``; ``reply``: the tokens so far) the
        queries its tokens had where kept, else the kept probe queries moved by RoPE where they may serve, else the
        probe decoded now."""
        observed = self.kept(probe, reply) if decoding else None
        if observed is None:
            o = self.observations
            if o.needs_decode(probe):
                observed = self.observe(probe)[:2]
            else:
                observed = o.moved(self.cells.n_past)
                self.stats.observations_moved += 1
        return observed

    def decode_token(self, tok: int, free_cells: int) -> None:
        """Decode a generated token. With ``decode_observe="kept"``, the last half-window of tokens before a
        decode-time event (``free_cells``: the cells left before it) keep the queries of their decode, so that the
        event needs no probe decode."""
        c, w = self.cells, self.cfg.recent
        keep = self.cfg.decode_observe == "kept" and self.cfg.method != "full" and free_cells <= w // 2
        with c.rollback():
            if keep:
                c.capture.arm(1)
            c.logits = c.decode([tok], [c.n_past], "last")
            if keep:
                self.observations.keep_token(c.capture.take(), c.n_past, w // 2)
            c.n_past += 1

    def kept(self, probe: list[int], reply: list[int]):
        """The observation of a decode-time event with ``probe`` (:meth:`~kvlocal.engine.Engine.decode_probe`, after
        ``reply``) from the queries its tokens already had (:meth:`Observations.kept`), or None: the probe is
        decoded."""
        if self.cfg.decode_observe != "kept":
            return None
        n_reply = len(reply[-(self.cfg.recent // 2):]) if self.cfg.recent > 1 else 0
        if list(probe[len(probe) - n_reply:]) != reply[len(reply) - n_reply:]:
            return None  # not decode_probe's layout (a subclass's own probe): decode it
        observed = self.observations.kept(probe[:len(probe) - n_reply], n_reply, self.cells.n_past)
        if observed is not None:
            self.stats.observations_kept += 1
            self.last_probe = list(probe)
        return observed

    def decode_chunk(self, chunk: list[int], probe: list[int], observe: bool = True, window: bool = False):
        """Decode a prompt chunk; with ``observe`` (a compression may follow), decode the probe in the same
        call as the chunk's tail (one graph, better matmul shapes than a separate small batch, and one
        ubatch, so that a sliding-window cache only reuses cells relative to a real token), capture its
        queries, and remove it; with ``window`` instead, capture the queries of the chunk's own last ``recent``
        tokens (``prefill_observe="window"``). Returns the observation (queries, positions) or None."""
        c = self.cells
        p0 = c.n_past
        with c.rollback():
            if not observe:
                c.logits = c.decode(chunk, range(p0, p0 + len(chunk)), "last")
                c.n_past += len(chunk)
                c.note_live()
                return None
            if window:
                return self._decode_window(chunk)
            head = max(0, len(chunk) + len(probe) - min(c.ctx.n_batch, c.ctx.n_ubatch))
            if head:
                c.decode(chunk[:head], range(p0, p0 + head), "none")
            t0 = time.perf_counter()
            seq = chunk[head:] + probe
            c.capture.arm(len(probe))
            try:
                c.logits = c.decode(seq, range(p0 + head, p0 + len(chunk) + len(probe)), len(seq) - len(probe) - 1)
            finally:
                c.capture.disarm()
            c.n_past += len(chunk)
            c.ctx.remove(c.n_past, -1)
            queries = c.capture.take()
        c.note_live()
        self.last_probe = list(probe)
        q_pos = np.arange(c.n_past, c.n_past + len(probe))
        self.observations.keep(probe, queries, q_pos)
        self.observations.keep_prompt(probe, queries, q_pos)
        # the probe's share of this decode counts as compression time (estimated by token share)
        dt = (time.perf_counter() - t0) * len(probe) / len(seq)
        self.stats.compression_seconds += dt
        self.stats.compression_breakdown["observe"] = self.stats.compression_breakdown.get("observe", 0.0) + dt
        return queries, q_pos

    def _decode_window(self, chunk: list[int]):
        """Decode a prompt chunk with the queries of its last ``recent`` tokens captured (its last ubatch armed):
        the observation of the event that follows, at no decode of ours. The window's own cells are the event's
        recent span, which every head keeps; a query sees the cells before it (SnapKV's window)."""
        c = self.cells
        p0, w = c.n_past, min(len(chunk), self.cfg.recent)
        head = max(0, len(chunk) - min(c.ctx.n_batch, c.ctx.n_ubatch))
        if head:
            c.decode(chunk[:head], range(p0, p0 + head), "none")
        c.capture.arm(w)
        try:
            c.logits = c.decode(chunk[head:], range(p0 + head, p0 + len(chunk)), "last")
        finally:
            c.capture.disarm()
        queries = c.capture.take()
        c.n_past += len(chunk)
        c.note_live()
        self.last_probe = chunk[-w:]
        self.stats.observations_window += 1
        return queries, np.arange(c.n_past - w, c.n_past)

    def observe(self, probe: Sequence[int], keep_if: Callable[[np.ndarray], bool] | None = None,
                question: bool = False):
        """Decode the probe after the cache with query capture, then remove it. Returns per compressed
        layer post-RoPE queries [Hq, w, d], their positions [w], and whether the probe stayed: ``keep_if``
        tests the probe's last logits; where it holds the probe was the next text, decoded (``n_past`` and
        ``logits`` move past it). ``question``: the probe is a question's, whose queries also observe its answer's
        decode-time events (:meth:`Observations.keep_prompt`)."""
        c = self.cells
        p0 = c.n_past
        q_pos = np.arange(p0, p0 + len(probe))
        with c.rollback():
            c.capture.arm(len(probe))
            try:
                logits = c.decode(list(probe), q_pos.tolist(), "none" if keep_if is None else "last")
            finally:
                c.capture.disarm()
            queries = c.capture.take()
            if keep_if is not None and keep_if(logits):
                c.logits, c.n_past = logits, p0 + len(probe)
                return queries, q_pos, True
            c.ctx.remove(p0, -1)
        self.last_probe = list(probe)
        self.observations.keep(probe, queries, q_pos)
        if question:
            self.observations.keep_prompt(probe, queries, q_pos)
        return queries, q_pos, False
