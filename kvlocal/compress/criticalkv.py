"""CriticalKV: two-stage selection, attention first, then attention x projected value norm."""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from threadpoolctl import threadpool_limits

from kvlocal.compress.base import LayerInputs, Scorer, top_cells, vnorm
from kvlocal.compress.methods import Method, own
from kvlocal.compress.snapkv import SnapKV, fused_keep


VALUE_NORMS = {"l1": 1, "l2": 2}  # CriticalKV's value_norm → p: the norm over D of v · W_O^h


def projected_value_norms(v: np.ndarray, wo: np.ndarray, n_head: int, rows: Sequence[np.ndarray] | None = None,
                          p: int = 1) -> list[np.ndarray]:
    """``||v · W_O^h||_p`` per cell (p = 1: L1, the paper's and the default; 2: L2), averaged over the query
    heads of each GQA group.

    v: [Hkv, n, d] values; wo: [D, Hq*d] (``o_proj.weight``, HF layout) — or, for ``p=2``, its factor
    (:func:`l2_factor`). Query head ``h`` reads KV head ``h // G`` and its slice is ``W_O^h = wo[:, h*d:(h+1)*d].T``
    ([d, D]); the norm over D, then the mean over the G query heads (:func:`kvlocal.kernels.vnorm`).
    ``rows[g]``: the cells of KV head ``g`` to compute (default all). Returns one float32 array per KV head,
    ``[len(rows[g])]`` (or ``[n]``).
    """
    hkv = v.shape[0]
    group = n_head // hkv
    wo = np.ascontiguousarray(wo, dtype=np.float32)
    return [vnorm(v[g], wo, g * group, group, None if rows is None else rows[g], p) for g in range(hkv)]


def l2_factor(wo: np.ndarray, n_head: int) -> np.ndarray:
    """``[min(d, D), Hq*d]``: per query head ``h``, the triangular ``R_h`` of ``wo[:, h*d:(h+1)*d] = Q_h R_h`` (Q's
    columns orthonormal), in ``wo``'s layout. Then ``||v · W_O^h||_2 = ||v · R_h^T||_2`` for every ``v``, so
    :func:`projected_value_norms` with ``p=2`` reads d columns per head instead of D (D/d times less work:
    9× on SmolLM2, 14× on Qwen2.5-0.5B, 32× on an 8B Llama). ``R_h`` is the Cholesky factor of the float64 Gram
    matrix ``W_h^T W_h`` (QR's R up to the signs of its rows, which no norm sees; cheaper than the QR, which ran as
    BLAS-2 and, with BLAS threads, took a core from the event's scoring: docs/engine.md § the kernels' memory
    traffic); a layer whose Gram matrices are not all positive definite (D < d, a head of zeros) takes the QR.
    float32 result."""
    big_d, ld = wo.shape
    d = ld // n_head
    heads = np.asarray(wo, dtype=np.float64).reshape(big_d, n_head, d).transpose(1, 0, 2)  # [Hq, D, d]
    with one_blas_thread():
        try:
            if big_d < d:
                raise np.linalg.LinAlgError("fewer rows than columns")
            r = np.linalg.cholesky(heads.transpose(0, 2, 1) @ heads).transpose(0, 2, 1)  # [Hq, d, d], R^T R = W^T W
        except np.linalg.LinAlgError:
            r = np.linalg.qr(heads, mode="r")  # [Hq, min(d, D), d]
    return np.ascontiguousarray(r.transpose(1, 0, 2).reshape(r.shape[1], ld), dtype=np.float32)


_FACTORS: dict[tuple[int, int], tuple[weakref.ref, np.ndarray]] = {}  # (id(wo), Hq) -> (wo, its factor)
_FACTORS_LOCK = threading.Lock()


_BLAS_LOCK = threading.Lock()


@contextlib.contextmanager
def one_blas_thread():
    """numpy's BLAS on the calling thread alone while inside (threadpoolctl), one caller at a time (the limit is the
    process's). An event's layers are planned on worker threads; BLAS's own threads, woken by a product this small,
    then spin for a while after it and take a core from them (docs/engine.md § the tier's storing, BLAS's threads
    and half-float keys)."""
    with _BLAS_LOCK, threadpool_limits(1, user_api="blas"):
        yield


def shared_l2_factor(wo: np.ndarray, n_head: int) -> np.ndarray:
    """:func:`l2_factor`, computed once per ``wo`` array in the process and dropped with it. The engines of one
    model share their W_O arrays (:mod:`kvlocal.backends.weights`), so a server's chats, or a benchmark's engines, do
    not each pay the QR of every layer again (a float64 QR of ``Hq`` matrices ``[D, d]`` a layer)."""
    key = (id(wo), n_head)
    with _FACTORS_LOCK:
        held = _FACTORS.get(key)
    if held is not None and held[0]() is wo:
        return held[1]
    factor = l2_factor(wo, n_head)
    ref = weakref.ref(wo, lambda _, key=key: _FACTORS.pop(key, None))
    with _FACTORS_LOCK:
        _FACTORS[key] = (ref, factor)
    return factor


def norm_p(scorer: Scorer) -> int:
    """The p of the value norms ``scorer`` ranks by: its CriticalKV's (wrapped or not) ``value_norm``, else 1 (L1)."""
    while scorer is not None:
        if isinstance(scorer, CriticalKV):
            return VALUE_NORMS[scorer.value_norm]
        scorer = getattr(scorer, "press", None)
    return 1


@dataclass
class CriticalKV(Scorer):
    """Wraps an attention scorer; keeps part of the budget by attention, the rest by attention x ``||v W_O||``.

    Based on https://arxiv.org/abs/2502.03805 (CriticalKV), as kvpress's ``CriticalKVPress``. Per KV head
    with budget ``b``: stage 1 keeps the top ``int(first_stage_ratio * b)`` cells by the wrapped scorer's
    score ``A`` (ties to the later position); stage 2 fills the rest by ``(A + epsilon) * ||v W_O^h||``
    (L1 or L2 over D, mean over the G query heads, :func:`projected_value_norms`). Written, as in kvpress, as a
    ranking (:meth:`rerank`): the critical score with the stage-1 cells set to ``+inf``, whose ordinary
    top-b is stage 1 ∪ stage 2. Protected cells (``A = +inf``) stay ``+inf`` and count toward stage 1, as
    in kvpress. The budget-free :meth:`score` is the wrapped scorer's (budget allocation uses the base
    scores, as kvpress's ``CriticalAdaKVPress``). Nothing is normalised. Norms are computed only for the
    cells stage 2 ranks (not protected, not taken by stage 1) and not already in ``layer.vnorm``.

    Parameters
    ----------
    press : Scorer
        The attention scorer (SnapKV by default).
    epsilon : float
        Added to the attention score before multiplying by the norm (paper footnote, kvpress default).
    first_stage_ratio : float
        Fraction ``alpha`` of each head's budget chosen by attention alone; ``int(alpha*b)`` cells.
        kvpress floors the stage-1 count at 1; here ``b = 1`` gives a pure stage 2.
    value_norm : str
        ``"l1"`` (this class's default: the paper's and kvpress's) or ``"l2"``: the paper's bound on the output's
        change holds in any norm, and its ablation reports L2's gains as similar. L2 through ``W_O^h`` equals L2
        through a ``d × d`` factor of it (:func:`l2_factor`, computed once per layer): D/d times less work per
        row. Measured against L1 at equal memory in docs/engine.md § value norms, and the engine's default
        (``kvlocal.engine.VALUE_NORM``); a bare ``CriticalKV()`` stays the paper's.
    """

    press: Scorer = field(default_factory=SnapKV)
    needs_wo = True  # not a field: the value-norm stage reads W_O
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5
    value_norm: str = "l1"

    def __post_init__(self):
        if self.value_norm not in VALUE_NORMS:
            raise ValueError(f"value_norm must be one of {', '.join(VALUE_NORMS)}, got {self.value_norm!r}")

    def norm_weights(self, layer: LayerInputs) -> tuple[np.ndarray | None, int]:
        """The matrix the value norms are computed through, and p: ``layer.wo`` for L1, its :func:`l2_factor`
        for L2 (``layer.wo_l2`` where given, else :func:`shared_l2_factor`); None where the inputs have neither."""
        p = VALUE_NORMS[self.value_norm]
        if p == 2 and layer.wo_l2 is not None:
            return layer.wo_l2, p
        return (layer.wo if p == 1 or layer.wo is None else shared_l2_factor(layer.wo, layer.n_head)), p

    def has_norm_weights(self, layer: LayerInputs) -> bool:
        """Whether ``layer`` brings what :meth:`norm_weights` reads (without computing a factor)."""
        return layer.wo is not None or (self.value_norm == "l2" and layer.wo_l2 is not None)

    def score(self, layer: LayerInputs) -> np.ndarray:
        return self.press.score(layer)

    def rerank(self, layer: LayerInputs, scores: np.ndarray, budgets: np.ndarray) -> np.ndarray:
        if (not self.has_norm_weights(layer) and layer.v is not None) or layer.q is None:
            raise ValueError(f"layer {layer.layer}: CriticalKV needs wo (o_proj weight [D, Hq*d]) and q (for Hq)")
        scores = np.asarray(self.press.rerank(layer, scores, budgets), dtype=np.float32)
        crit = scores.copy()  # +inf / -inf cells keep their score whatever their norm
        first = np.zeros(scores.shape, dtype=bool)  # stage 1: top int(alpha * b) by the score alone
        n_first = np.array([int(self.first_stage_ratio * int(b)) for b in budgets])
        for k in np.unique(n_first):  # one top-k for all heads that share a budget
            heads = np.flatnonzero(n_first == k)
            pos = layer.pos if layer.pos.ndim == 1 else layer.pos[heads]
            taken = np.zeros((len(heads), scores.shape[1]), dtype=bool)
            np.put_along_axis(taken, top_cells(scores[heads], int(k), pos), True, axis=1)
            first[heads] = taken
        ranked = ~first & np.isfinite(scores)  # the cells stage 2 ranks: the only norms needed
        vnorm = layer.vnorm if layer.vnorm is not None else np.full(scores.shape, np.nan, dtype=np.float32)
        todo = [np.flatnonzero(ranked[g] & np.isnan(vnorm[g])) for g in range(layer.n_kv)]
        if any(len(t) for t in todo):
            if layer.v is None:
                raise ValueError(f"layer {layer.layer}: CriticalKV without v needs the norms of every cell it ranks")
            matrix, p = self.norm_weights(layer)
            for g, norms in enumerate(projected_value_norms(layer.v, matrix, layer.n_head, todo, p)):
                vnorm[g, todo[g]] = norms
        crit[ranked] = (scores[ranked] + np.float32(self.epsilon)) * vnorm[ranked]
        crit[first] = np.inf
        return crit

    def keep(self, layer: LayerInputs, budget: int) -> np.ndarray:
        fused = fused_keep(self.press, layer, budget, critical=self) if type(self.press) is SnapKV else None
        return super().keep(layer, budget) if fused is None else fused


def criticalkv(**kw) -> CriticalKV:
    """``CriticalKV(SnapKV(...))``: CriticalKV's own parameters go to it, the others to SnapKV."""
    mine = own(kw, CriticalKV)
    return CriticalKV(press=SnapKV(**kw), **mine)


METHODS = {"criticalkv": Method(criticalkv, parts=(CriticalKV, SnapKV), rank=3)}
