"""Span-coherent recall: the text around what a question attends to most comes back in every head.

A question's re-selection (:mod:`kvlocal.recall.select`) chooses rows per layer and KV head, each head by its own
attention. A fact the question asks for then comes back in the heads whose question queries look at it — mostly
at its key, the words the question repeats — and not whole in the heads whose queries will copy its value while
the answer is written: there the answer reads the value of another fact of the same shape that is on the device
(docs/recall.md § Where the binding is lost). So before the heads choose, the question's attention over the
device's cells and the tier's candidates is summed per position over the candidates (the rows some head lacks) of
every compressed layer and KV head; around the :data:`SPANS` positions it gives the most (apart from each other), :data:`SPAN_RADIUS` positions either side
are brought back in every head of every compressed layer and protected there until the answer's first compression
returns the cache to its budget.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kvlocal.compress.base import LayerInputs, window_votes
from kvlocal.recall.select import Candidates
from kvlocal.recall.tier import HostTier

SPANS = 4  # the places a question's spans are taken around
SPAN_RADIUS = 12  # positions either side of each: a sentence of a fact ("The office extension of … is 4080.")


def attention_by_position(layers: Iterable[LayerInputs], window_size: int | None, n_pos: int,
                          only: np.ndarray | None = None) -> np.ndarray:
    """``[n_pos]``: per position, the observation's attention summed over the layers and KV heads (each head's the
    mean over its query heads and the window's queries: what an attention scorer reads); ``only``: ``[n_layer,
    Hkv, n]``, the rows that count (the tier's candidates: what the question asks back, not what every query looks at
    — the system prompt, the chat template's tokens)."""
    total = np.zeros(n_pos)
    for i, layer in enumerate(layers):
        if layer.votes is not None:
            votes = layer.votes
        else:
            w = window_size or len(layer.q_pos)
            votes = window_votes(layer.q[:, -w:], layer.q_pos[-w:], layer.k, layer.pos, layer.bias)
        per_head = votes.reshape(layer.n_kv, -1, layer.n).mean(axis=1)  # [Hkv, n]
        pos = layer.pos_h
        counted = (pos >= 0) & (pos < n_pos) & (True if only is None else only[i])
        np.add.at(total, pos[counted], per_head[counted])
    return total


def span_positions(attention: np.ndarray, skip: int, n_spans: int = SPANS, radius: int = SPAN_RADIUS,
                   limit: int | None = None) -> np.ndarray:
    """The positions within ``radius`` of the ``n_spans`` positions ``attention`` gives the most, each at least
    ``2 * radius + 1`` from the others (so the spans do not overlap), none of them below ``skip`` (the sinks and
    pinned tokens: always kept, and where every head's attention pools). At most ``limit`` positions."""
    a = attention.copy()
    a[:skip] = 0
    out: list[np.ndarray] = []
    room = limit if limit is not None else n_spans * (2 * radius + 1)
    for _ in range(n_spans):
        p = int(np.argmax(a))
        if a[p] <= 0:
            break
        lo, hi = max(skip, p - radius), min(len(a), p + radius + 1)
        if hi - lo > room:
            break
        out.append(np.arange(lo, hi))
        room -= hi - lo
        a[max(0, p - 2 * radius):p + 2 * radius + 1] = 0
    return np.unique(np.concatenate(out)) if out else np.zeros(0, np.int64)


def with_span_rows(tier: HostTier, cands: Candidates, positions: np.ndarray) -> Candidates:
    """``cands`` with, in every head, the tier's rows at ``positions`` that are off the device."""
    ids = []
    for layer, chosen in zip(tier.heads, cands.ids):
        per_head = []
        for s, own in zip(layer, chosen):
            extra = np.flatnonzero(np.isin(s.pos[:s.n], positions) & ~s.on_device[:s.n]) if s.n else own[:0]
            per_head.append(np.union1d(own, extra).astype(np.int64))
        ids.append(per_head)
    return Candidates(ids, max((len(i) for layer in ids for i in layer), default=0))


def keeping(layers: Iterable[LayerInputs], positions: np.ndarray | None) -> Iterable[LayerInputs]:
    """``layers`` with the rows at ``positions`` protected (:attr:`LayerInputs.keep`)."""
    for layer in layers:
        if positions is not None and len(positions):
            layer.keep = np.isin(layer.pos_h, positions)
        yield layer
