"""Explicit KV cache of the reference model.

The cache mirrors llama.cpp's layout: a layer holds ``S`` slots (llama.cpp's cells) and each KV head
has its own row in every slot. Rows of different heads in one slot may hold different tokens, so a
compression plan can keep a different set per head without any padding logic in the attention.

A slot row carries:

- ``pos``   — the source position of the token it holds (for a merged slot, that of its last member);
  ``-1`` for an empty row,
- ``k``     — the key after RoPE (rotated at ``pos``, or the merged key),
- ``v``     — the value; for a slot that stands for several tokens, the *mean* of their values,
- ``count`` — how many source tokens the row stands for (0 for an empty row),
- ``bias``  — an additive attention-logit bias: 0 for a plain token, ``log(count)`` for a merged
  slot, ``-inf`` for an empty row.

Mean values with a ``log(count)`` bias are the same thing as AsymKV's summed values with
count-weighted softmax (docs/algorithms.md): ``exp(s + log l) · v̄ = l·exp(s) · v_sum / l``.
A full, uncompressed cache is the special case ``count == 1``, ``bias == 0`` everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class LayerKV:
    k: torch.Tensor  # [Hkv, S, d]   keys after RoPE
    v: torch.Tensor  # [Hkv, S, d]   values (mean over members)
    pos: torch.Tensor  # [Hkv, S]    int64 source position, -1 = empty
    count: torch.Tensor  # [Hkv, S]  int64 members, 0 = empty
    bias: torch.Tensor  # [Hkv, S]   float32 additive logit bias

    @classmethod
    def empty(cls, n_kv_head: int, head_dim: int, dtype=torch.float32) -> "LayerKV":
        return cls(
            k=torch.zeros(n_kv_head, 0, head_dim, dtype=dtype),
            v=torch.zeros(n_kv_head, 0, head_dim, dtype=dtype),
            pos=torch.zeros(n_kv_head, 0, dtype=torch.int64),
            count=torch.zeros(n_kv_head, 0, dtype=torch.int64),
            bias=torch.zeros(n_kv_head, 0, dtype=torch.float32),
        )

    @property
    def n_slots(self) -> int:
        return self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append T plain tokens to every head. k, v: [Hkv, T, d]; pos: [T]."""
        hkv, t = k.shape[0], k.shape[1]
        pos = pos.to(torch.int64).expand(hkv, t)
        self.k = torch.cat([self.k, k.to(self.k.dtype)], dim=1)
        self.v = torch.cat([self.v, v.to(self.v.dtype)], dim=1)
        self.pos = torch.cat([self.pos, pos], dim=1)
        self.count = torch.cat([self.count, torch.ones(hkv, t, dtype=torch.int64)], dim=1)
        self.bias = torch.cat([self.bias, torch.zeros(hkv, t, dtype=torch.float32)], dim=1)

    def gather(self, idx: torch.Tensor) -> None:
        """Keep, per head, the slots ``idx[h]`` in that order. idx: [Hkv, S'] (same S' for all heads;
        heads that keep fewer entries point the surplus at a row and then call :meth:`clear`)."""
        idx = idx.to(torch.int64)
        d = self.k.shape[-1]
        self.k = torch.gather(self.k, 1, idx[..., None].expand(-1, -1, d))
        self.v = torch.gather(self.v, 1, idx[..., None].expand(-1, -1, d))
        self.pos = torch.gather(self.pos, 1, idx)
        self.count = torch.gather(self.count, 1, idx)
        self.bias = torch.gather(self.bias, 1, idx)

    def clear(self, mask: torch.Tensor) -> None:
        """Empty the rows where mask [Hkv, S] is True (the ``-inf`` bias removes them from attention)."""
        self.pos = torch.where(mask, -1, self.pos)
        self.count = torch.where(mask, 0, self.count)
        self.bias = torch.where(mask, -math.inf, self.bias)

    def set_counts(self, count: torch.Tensor) -> None:
        """Set member counts [Hkv, S] and the matching ``log(count)`` bias (``-inf`` where 0)."""
        self.count = count.to(torch.int64)
        self.bias = torch.log(self.count.to(torch.float32))


class KVCache:
    """Per-layer :class:`LayerKV` list; the reference model reads and appends through it."""

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, dtype=torch.float32):
        self.layers = [LayerKV.empty(n_kv_head, head_dim, dtype) for _ in range(n_layer)]

    def __getitem__(self, il: int) -> LayerKV:
        return self.layers[il]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def n_slots(self) -> int:
        return self.layers[0].n_slots if self.layers else 0

    def next_pos(self) -> int:
        """Position for the next token: one past the largest position held anywhere."""
        return int(max(int(layer.pos.max()) if layer.n_slots else -1 for layer in self.layers)) + 1


def attend(q: torch.Tensor, q_pos: torch.Tensor, kv: LayerKV) -> torch.Tensor:
    """Attention of queries over the slots of one layer.

    q: [Hq, T, d] (after RoPE); q_pos: [T] positions of the queries. Returns [Hq, T, d].
    A query sees a row when the row is not empty and its position is not after the query's.
    Query head h reads KV head h // (Hq / Hkv) (GQA, llama.cpp and HF agree).
    """
    hq, _, d = q.shape
    group = hq // kv.k.shape[0]
    k = kv.k.repeat_interleave(group, dim=0).to(torch.float32)  # [Hq, S, d]
    v = kv.v.repeat_interleave(group, dim=0).to(torch.float32)  # [Hq, S, d]
    bias = kv.bias.repeat_interleave(group, dim=0)  # [Hq, S]
    pos = kv.pos.repeat_interleave(group, dim=0)  # [Hq, S]
    logits = q.to(torch.float32) @ k.transpose(-1, -2) / math.sqrt(d)  # [Hq, T, S]
    logits = logits + bias[:, None, :]
    visible = (pos[:, None, :] <= q_pos[None, :, None]) & (pos[:, None, :] >= 0)  # [Hq, T, S]
    logits = logits.masked_fill(~visible, -math.inf)
    return torch.softmax(logits, dim=-1) @ v  # [Hq, T, d]
