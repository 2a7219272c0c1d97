"""Readable numpy versions of the native scoring kernels.

Each function here is the definition that the C kernel of the same name in :mod:`kvlocal.kernels`
is tested against (``tests/kernels/test_kernels_scoring.py``; ``greedy_pairs``: ``tests/compress/test_compress_merge.py``)
and the baseline of ``python -m tools.bench_kernels``. The scorers call the C scoring kernels where
those have wide vectors (AVX2, AVX-512) and these functions elsewhere, where numpy's BLAS is faster
(:func:`kvlocal.compress.base.native_scoring`); ``greedy_pairs`` is a plain loop and always runs in C.
"""

from __future__ import annotations

import numpy as np


def window_attention(q: np.ndarray, q_pos: np.ndarray, k: np.ndarray, pos: np.ndarray,
                     bias: np.ndarray | None = None) -> np.ndarray:
    """Softmax attention of every window query over every cell, per query head: ``[Hq, w, n]`` float32.

    Logits ``q·k/sqrt(d) + bias`` in float32, a query at ``p`` sees the cells with ``0 <= pos <= p`` (a
    query that sees none gets zeros), query head ``h`` reads KV head ``h // G``. ``pos``: [n] or
    [Hkv, n]; result in cell order. :func:`window_votes` is its mean over the window; DefensiveKV takes
    a maximum.
    """
    hq, w, d = q.shape
    hkv, n, _ = k.shape
    group = hq // hkv
    pos = np.broadcast_to(pos, (hkv, n))
    logits = np.matmul(q.reshape(hkv, group * w, d).astype(np.float32),
                       k.astype(np.float32).transpose(0, 2, 1))  # [Hkv, G*w, n]
    logits = logits.reshape(hkv, group, w, n) / np.float32(np.sqrt(d))
    if bias is not None:
        logits = logits + np.broadcast_to(bias, (hkv, n))[:, None, None, :].astype(np.float32)
    visible = (pos[:, None, None, :] >= 0) & (pos[:, None, None, :] <= np.asarray(q_pos)[None, None, :, None])
    logits = np.where(visible, logits, -np.inf)
    top = logits.max(axis=-1, keepdims=True)
    e = np.exp(logits - np.where(np.isfinite(top), top, 0))  # a query that sees nothing: all zeros
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0).reshape(hq, w, n)


def window_votes(q: np.ndarray, q_pos: np.ndarray, k: np.ndarray, pos: np.ndarray,
                 bias: np.ndarray | None = None) -> np.ndarray:
    """Mean over the window of the softmax attention of each query head over the keys: ``[Hq, n]``.

    Same contract as :func:`kvlocal.kernels.window_votes`. Materialises ``[Hq, w, n]``.
    """
    return window_attention(q, q_pos, k, pos, bias).mean(axis=1).astype(np.float32)


def vnorm(v: np.ndarray, wo: np.ndarray, first_head: int, n_group: int,
          rows: np.ndarray | None = None, p: int = 1) -> np.ndarray:
    """``mean_h ||v[r] · W_O^h||_p``: ``[m]``. Same contract as :func:`kvlocal.kernels.vnorm`."""
    d = v.shape[1]
    v = np.asarray(v if rows is None else v[np.asarray(rows)], dtype=np.float32)
    heads = range(first_head, first_head + n_group)
    return np.mean([np.linalg.norm(v @ wo[:, h * d : (h + 1) * d].T, ord=p, axis=-1) for h in heads],
                   axis=0).astype(np.float32)


def greedy_pairs(mass: np.ndarray, n_pairs: int) -> np.ndarray:
    """Greedy non-overlapping adjacent pairs: ``[P]``. Same contract as :func:`kvlocal.kernels.greedy_pairs`."""
    mass = np.asarray(mass, dtype=np.float32)
    taken = np.zeros(len(mass), dtype=bool)
    chosen: list[int] = []
    for i in np.argsort(mass[:-1] + mass[1:], kind="stable"):
        if len(chosen) >= n_pairs:
            break
        if not taken[i] and not taken[i + 1]:
            taken[i] = taken[i + 1] = True
            chosen.append(int(i))
    return np.array(sorted(chosen), dtype=np.int64)
