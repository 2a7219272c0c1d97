"""The plan of one compression event: which source cell fills which slot, per layer and KV head.

A plan is plain data (numbers only, no llama.cpp): the scorers produce it, the engine writes it into
the cache, ``--dump-plan`` saves it as JSON. It is shaped for what comes next (merges, per-slot
counts and biases) without any of it being required now.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

FORMAT = "kvlocal-plan"
VERSION = 1


@dataclass
class Plan:
    """Per layer, the source cells that fill the ``B`` slots of every KV head.

    Slot ``j`` of KV head ``h`` in layer ``l`` receives the K/V rows of source cell ``keep[l, h, j]``,
    whose (source) position is ``positions[l, h, j]``. Every layer has the same ``B`` slots (llama.cpp's
    cells are shared by all layers) and each head's slots are in increasing position order. Different
    heads and layers may keep different tokens in the same slot: attention is computed per head, so a
    slot is just a row.

    Parameters
    ----------
    keep : np.ndarray
        ``[n_layer, Hkv, B]`` int64 source cell indices (cell order of the cache being compressed);
        a list of per-layer ``[Hkv, B]`` arrays is stacked.
    positions : np.ndarray
        ``[n_layer, Hkv, B]`` int64 source positions of the kept entries, strictly increasing per head.
    counts : np.ndarray, optional
        ``[n_layer, Hkv, B]`` int64: how many source tokens each slot stands for (merges; its attention
        bias is ``log(count)``). ``None``: all 1, pure eviction (the only case so far).
    merges : list, optional
        Per layer, per KV head, a dict ``{"pairs": [[m, m2], ...], "weights": [[w_m, w_m2], ...]}`` of
        source cells merged into the slot of ``m`` and their key weights (KVSlimmer). ``None``: no merges.
    """

    keep: np.ndarray
    positions: np.ndarray
    counts: np.ndarray | None = None
    merges: list | None = None

    def __post_init__(self) -> None:
        self.keep = _stack(self.keep, "keep")
        self.positions = _stack(self.positions, "positions")
        if self.keep.shape != self.positions.shape:
            raise ValueError(f"keep {self.keep.shape} and positions {self.positions.shape} differ")
        if self.n_slots > 1 and not np.all(np.diff(self.positions, axis=2) > 0):
            il = int(np.flatnonzero(~np.all(np.diff(self.positions, axis=2) > 0, axis=(1, 2)))[0])
            raise ValueError(f"layer {il}: kept positions must be strictly increasing per head")
        if self.counts is not None:
            self.counts = _stack(self.counts, "counts")
            if self.counts.shape != self.keep.shape:
                raise ValueError(f"counts {self.counts.shape} and keep {self.keep.shape} differ")

    @classmethod
    def from_keep(cls, keep, pos) -> "Plan":
        """Plan from the kept cells of every layer (``[Hkv, B]`` each) and the source positions of the cells:
        one ``[n]`` array for all layers, or one entry per layer (``[n]`` or ``[Hkv, n]``)."""
        if np.ndim(pos) > 1 and len(pos) != len(keep):
            raise ValueError(f"positions given for {len(pos)} layers, keep for {len(keep)}")
        positions = []
        for il, k in enumerate(keep):
            p = np.asarray(pos if np.ndim(pos) == 1 else pos[il], dtype=np.int64)
            p = np.broadcast_to(p, (np.shape(k)[0], p.shape[-1]))
            positions.append(np.take_along_axis(p, np.asarray(k, dtype=np.int64), axis=1))
        return cls(keep=list(keep), positions=positions)

    @property
    def n_layer(self) -> int:
        return self.keep.shape[0]

    @property
    def n_kv(self) -> int:
        return self.keep.shape[1]

    @property
    def n_slots(self) -> int:
        return self.keep.shape[2]

    def slot_positions(self) -> np.ndarray:
        """``[B]`` int64: the position llama.cpp gets for each slot (cell) after the plan is applied.

        A llama.cpp cell has one position, shared by every layer and head, and it serves two purposes
        only: the causal mask (a query at ``p`` sees cells with ``pos <= p``) and "the next token goes
        at max stored position + 1" (keys are already rotated, so it plays no part in RoPE). Slot ``j``
        therefore gets the largest source position among the entries it holds, over all layers and
        heads: every later query sees every kept entry exactly when it would have seen the source
        token, and the next token lands after all of them. Since each head's positions increase along
        its slots, the maximum over heads increases strictly too (for ``j < j'``, every head has
        ``p[j] < p[j'] <= max p[j']``), so the cells keep distinct, sorted positions.
        """
        if self.n_layer == 0 or self.n_kv == 0:
            return np.zeros(self.n_slots, dtype=np.int64)
        return self.positions.max(axis=(0, 1))

    # -- the --dump-plan format ----------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready dict: kept source cells and positions for every layer and KV head."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "n_layer": self.n_layer,
            "n_kv_head": self.n_kv,
            "n_slots": self.n_slots,
            "slot_positions": self.slot_positions().tolist(),
            "layers": [
                {
                    "keep": k.tolist(),
                    "positions": p.tolist(),
                    "counts": None if self.counts is None else self.counts[il].tolist(),
                    "merges": None if self.merges is None else _merges_json(self.merges[il]),
                }
                for il, (k, p) in enumerate(zip(self.keep, self.positions))
            ],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} document "
                             f"(format={d.get('format')!r}, version={d.get('version')!r})")
        layers = d["layers"]
        shape = (len(layers), int(d["n_kv_head"]), int(d["n_slots"]))

        def arr(key):
            return np.asarray([layer[key] for layer in layers], dtype=np.int64).reshape(shape)

        counts = arr("counts") if layers and layers[0]["counts"] is not None else None
        merges = [layer["merges"] for layer in layers] if layers and layers[0]["merges"] is not None else None
        return cls(keep=arr("keep"), positions=arr("positions"), counts=counts, merges=merges)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def _stack(x, what: str) -> np.ndarray:
    if isinstance(x, (list, tuple)):
        x = np.stack(x) if len(x) else np.zeros((0, 0, 0))
    a = np.asarray(x, dtype=np.int64)
    if a.ndim != 3:
        raise ValueError(f"{what} must be [n_layer, Hkv, B] (or a list of [Hkv, B]), got shape {a.shape}")
    return a


def _merges_json(per_head: list) -> list:
    return [{key: np.asarray(val).tolist() for key, val in head.items()} for head in per_head]
