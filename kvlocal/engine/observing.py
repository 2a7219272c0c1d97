"""How a compression event's observation is decoded (a mixin of :class:`~kvlocal.engine.Engine`): the probe after a
prompt chunk, or the chunk's own last tokens (``prefill_observe``); a probe alone (a question, a step); and a decode-time
event's, from the queries its tokens had (``decode_observe``). The methods use the engine's context, capture,
observations and figures; docs/engine.md § Where the observation window comes from."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np


class Observing:
    def _decode_token(self, tok: int) -> None:
        """Decode a generated token. With ``decode_observe="kept"``, the last half-window of tokens before a
        decode-time event keep the queries of their decode, so that the event needs no probe decode."""
        w = self.cfg.recent
        keep = self.cfg.decode_observe == "kept" and self.cfg.method != "full" and self._free_cells() <= w // 2
        with self._rollback():
            if keep:
                self.capture.arm(1)
            self.logits = self._decode([tok], [self.n_past], "last")
            if keep:
                self.observations.keep_token(self.capture.take(), self.n_past, w // 2)
            self.n_past += 1

    def _kept_observation(self, probe: list[int]):
        """The observation of a decode-time event with ``probe`` (:meth:`decode_probe`) from the queries its
        tokens already had (:meth:`Observations.kept`), or None: the probe is decoded."""
        if self.cfg.decode_observe != "kept":
            return None
        n_reply = len(self._reply[-(self.cfg.recent // 2):]) if self.cfg.recent > 1 else 0
        if list(probe[len(probe) - n_reply:]) != self._reply[len(self._reply) - n_reply:]:
            return None  # not decode_probe's layout (a subclass's own probe): decode it
        observed = self.observations.kept(probe[:len(probe) - n_reply], n_reply, self.n_past)
        if observed is not None:
            self.stats.observations_kept += 1
            self.last_probe = list(probe)
        return observed

    def decode_probe(self) -> list[int]:
        """The probe of a decode-time event: the last half-window of the prompt's probe followed by the
        last half-window of the reply so far (the whole window for whichever is short)."""
        probe = self._probe or self._probe_tokens(None)
        w = self.cfg.recent
        reply = self._reply[-(w // 2):] if w > 1 else []
        return (probe[-(w - len(reply)):] + reply)[-w:]

    def _decode_chunk(self, chunk: list[int], probe: list[int], observe: bool = True, window: bool = False):
        """Decode a prompt chunk; when compression may follow and ``observe``, decode the probe in the same
        call as the chunk's tail (one graph, better matmul shapes than a separate small batch, and one
        ubatch, so that a sliding-window cache only reuses cells relative to a real token), capture its
        queries, and remove it; with ``window`` instead, capture the queries of the chunk's own last ``recent``
        tokens (``prefill_observe="window"``). Returns the observation (queries, positions) or None."""
        p0 = self.n_past
        with_probe = observe and self.cfg.method != "full" and self.live_cells() + len(chunk) > self._settled
        with self._rollback():
            if not with_probe:
                self.logits = self._decode(chunk, range(p0, p0 + len(chunk)), "last")
                self.n_past += len(chunk)
                self._note_live()
                return None
            if window:
                return self._decode_window(chunk)
            head = max(0, len(chunk) + len(probe) - min(self.ctx.n_batch, self.ctx.n_ubatch))
            if head:
                self._decode(chunk[:head], range(p0, p0 + head), "none")
            t0 = time.perf_counter()
            seq = chunk[head:] + probe
            self.capture.arm(len(probe))
            try:
                self.logits = self._decode(seq, range(p0 + head, p0 + len(chunk) + len(probe)), len(seq) - len(probe) - 1)
            finally:
                self.capture.disarm()
            self.n_past += len(chunk)
            self.ctx.remove(self.n_past, -1)
            queries = self.capture.take()
        self._note_live()
        self.last_probe = list(probe)
        q_pos = np.arange(self.n_past, self.n_past + len(probe))
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
        p0, w = self.n_past, min(len(chunk), self.cfg.recent)
        head = max(0, len(chunk) - min(self.ctx.n_batch, self.ctx.n_ubatch))
        if head:
            self._decode(chunk[:head], range(p0, p0 + head), "none")
        self.capture.arm(w)
        try:
            self.logits = self._decode(chunk[head:], range(p0 + head, p0 + len(chunk)), "last")
        finally:
            self.capture.disarm()
        queries = self.capture.take()
        self.n_past += len(chunk)
        self._note_live()
        self.last_probe = chunk[-w:]
        self.stats.observations_window += 1
        return queries, np.arange(self.n_past - w, self.n_past)

    def _observe(self, probe: Sequence[int], keep_if: Callable[[np.ndarray], bool] | None = None):
        """Decode the probe after the cache with query capture, then remove it. Returns per compressed
        layer post-RoPE queries [Hq, w, d], their positions [w], and whether the probe stayed: ``keep_if``
        tests the probe's last logits; where it holds the probe was the next text, decoded (``n_past`` and
        ``logits`` move past it)."""
        p0 = self.n_past
        q_pos = np.arange(p0, p0 + len(probe))
        with self._rollback():
            self.capture.arm(len(probe))
            try:
                logits = self._decode(list(probe), q_pos.tolist(), "none" if keep_if is None else "last")
            finally:
                self.capture.disarm()
            queries = self.capture.take()
            if keep_if is not None and keep_if(logits):
                self.logits, self.n_past = logits, p0 + len(probe)
                return queries, q_pos, True
            self.ctx.remove(p0, -1)
        self.last_probe = list(probe)
        self.observations.keep(probe, queries, q_pos)
        return queries, q_pos, False
