"""One probe decode, several compression events: the probe's queries moved to new positions by RoPE.

Every compression event is scored by the queries of the probe (docs/engine.md, "Where the observation
window comes from"), and decoding the probe after every prefill chunk is the largest part of what
compression costs (docs/engine.md, "Measured"). A captured query is its pre-RoPE vector turned by
its position: ``q(p) = R(p)·q̃``. The same probe decoded ``Δ`` positions later would give ``R(p+Δ)·q̃'``,
where ``q̃'`` differs from ``q̃`` only through what the cache now holds (the probe's hidden states attend
to it). :class:`Observations` keeps the latest decoded queries and serves the next events with
``R(Δ)·q(p)`` — exact in position, stale by the chunks read since — and decodes the probe again every
``observe_every`` events and for the event that ends a prompt (the cache generation starts from).

:class:`Rope` is the rotation of the compressed (full-attention) layers as llama.cpp applies it: pair
``i`` of the first ``n_rot`` dimensions — adjacent ``(x[2i], x[2i+1])`` for ``norm``, ``(x[i],
x[i+n_rot/2])`` for ``neox`` — turns by ``p · freq_scale · base^(-2i/n_rot)``. Where llama.cpp does more
than that (YaRN's ramp, LongRoPE, per-dimension frequency factors), :meth:`Rope.of` returns None and
every event decodes its probe. ``tests/engine/test_observation.py`` checks the rotation against llama.cpp's own
queries of the same tokens decoded at two positions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

ROPE_NORM, ROPE_NEOX = 0, 2  # llama_rope_type


@dataclass(frozen=True)
class Rope:
    kind: str  # "norm" (adjacent pairs) or "neox" (halves)
    n_rot: int  # rotated dimensions per head (the rest pass through)
    base: float
    freq_scale: float

    @classmethod
    def of(cls, model) -> "Rope | None":
        """The rotation of ``model``'s full-attention layers, or None where kvlocal cannot reproduce it."""
        arch = model.arch.arch
        kind = {ROPE_NORM: "norm", ROPE_NEOX: "neox"}.get(model.rope_type)
        scaling = model.meta(f"{arch}.rope.scaling.type") or "linear"
        if kind is None or scaling not in ("none", "linear") or model.has_tensor("rope_freqs.weight"):
            return None
        n_rot = int(model.meta(f"{arch}.rope.dimension_count") or model.arch.head_dim_k)
        base = float(model.meta(f"{arch}.rope.freq_base") or 10000.0)
        return cls(kind, n_rot, base, model.rope_freq_scale)

    def _angles(self, delta) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of the turn by ``delta`` positions (a number, or an array: one more axis)."""
        theta = (np.asarray(delta, np.float64)[..., None] * self.freq_scale
                 * self.base ** (-np.arange(self.n_rot // 2, dtype=np.float64) * 2 / self.n_rot))
        return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)

    @functools.lru_cache(maxsize=4)  # an event moves every layer's queries by the same delta
    def _turn(self, delta: int) -> tuple[np.ndarray, np.ndarray]:
        return self._angles(delta)

    def rotate(self, x: np.ndarray, delta) -> np.ndarray:
        """``x [..., d]`` (post-RoPE vectors) turned ``delta`` positions further: one delta for all, or one
        per row (``delta [...]``, the shape of ``x`` without its last axis)."""
        half = self.n_rot // 2
        cos, sin = self._turn(int(delta)) if np.ndim(delta) == 0 else self._angles(delta)
        out = np.array(x, dtype=np.float32, copy=True)
        if self.kind == "norm":
            x0, x1 = x[..., 0:self.n_rot:2], x[..., 1:self.n_rot:2]
            out[..., 0:self.n_rot:2], out[..., 1:self.n_rot:2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        else:
            x0, x1 = x[..., :half], x[..., half:self.n_rot]
            out[..., :half], out[..., half:self.n_rot] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        return out


class Observations:
    """The latest decoded probe's queries, served to later events at their positions (module docstring).

    ``every``: events one decode serves (1: decode the probe for each, the exact observation)."""

    def __init__(self, rope: Rope | None, every: int = 1):
        self.rope, self.every = rope, max(1, int(every)) if rope is not None else 1
        self.decoded = 0  # decodes kept (the engine counts the moved ones: EngineStats.observations_moved)
        self.forget()

    def forget(self) -> None:
        """Drop the kept queries (positions moved, the cache restored, a new question)."""
        self._probe: tuple[int, ...] | None = None
        self._q: list[np.ndarray] | None = None
        self._pos0 = 0
        self._served = 0
        self._prompt: tuple[tuple[int, ...], list[np.ndarray], np.ndarray] | None = None
        self._tokens: list[tuple[list[np.ndarray], int]] = []  # decoded tokens' own queries, oldest first

    def keep(self, probe, q: list[np.ndarray], q_pos: np.ndarray) -> None:
        """A fresh decode of ``probe``: queries ``q`` (per compressed layer ``[Hq, w, d]``) at ``q_pos``."""
        self._probe, self._q, self._pos0, self._served = tuple(probe), q, int(q_pos[0]), 1
        self.decoded += 1

    def needs_decode(self, probe) -> bool:
        """Whether the next event with ``probe`` must decode it (nothing kept for it, or it served its share)."""
        return self._q is None or self._probe != tuple(probe) or self._served >= self.every

    def moved(self, p0: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The kept queries moved to positions ``p0, p0+1, ...`` (call only when not :meth:`needs_decode`)."""
        delta = p0 - self._pos0
        q = [self.rope.rotate(qi, delta) for qi in self._q]
        self._served += 1
        return q, np.arange(p0, p0 + q[0].shape[1])

    # -- decode-time events: the queries the probe's tokens already had (Engine(decode_observe="kept")) --------
    def keep_prompt(self, probe, q: list[np.ndarray], q_pos: np.ndarray) -> None:
        """The latest decode of a prompt's probe (the reading's last event, a question's re-selection)."""
        self._prompt = tuple(probe), q, np.asarray(q_pos)

    def keep_token(self, q: list[np.ndarray], pos: int, n: int) -> None:
        """A generated token's own queries (per layer ``[Hq, 1, d]``) from its decode at ``pos``; the last ``n``
        are kept."""
        self._tokens = (self._tokens + [(q, int(pos))])[-n:]

    def drop_tokens(self) -> None:
        self._tokens = []

    def kept(self, prompt_part, n_reply: int, p0: int) -> tuple[list[np.ndarray], np.ndarray] | None:
        """A decode-time event's observation without a decode: the queries the prompt probe's tokens
        ``prompt_part`` (its end) had when it was decoded, then those of the last ``n_reply`` generated tokens
        (their own decodes, ending at ``p0 - 1``), each turned by RoPE to the position a probe decoded now
        would give it (``p0, p0 + 1, ...``). Exact in position; in content each query is what its token
        computed over the cache of its time (as :meth:`moved`'s are). None where something is missing: then
        the probe is decoded."""
        k = len(prompt_part)
        tokens = self._tokens[-n_reply:] if n_reply else []  # (fewer than n_reply: the positions cannot match)
        if (self.rope is None or k + n_reply == 0 or [p for _, p in tokens] != list(range(p0 - n_reply, p0))
                or (k and (self._prompt is None or self._prompt[0][-k:] != tuple(prompt_part)))):
            return None
        parts = ([[qi[:, -k:] for qi in self._prompt[1]]] if k else []) + [q for q, _ in tokens]
        pos = np.concatenate([self._prompt[2][-k:] if k else np.zeros(0, np.int64), [p for _, p in tokens]])
        q = [np.concatenate(layer, axis=1) for layer in zip(*parts)]
        target = np.arange(p0, p0 + len(pos))
        return [self.rope.rotate(qi, np.broadcast_to(target - pos, qi.shape[:2])) for qi in q], target
