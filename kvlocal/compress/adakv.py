"""AdaKV: share a layer's budget between its KV heads by a flattened top-k over their scores."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvlocal.compress.base import LayerInputs, Scorer, group_max, select, top_cells_per_head
from kvlocal.compress.criticalkv import CriticalKV, criticalkv
from kvlocal.compress.methods import Method, own
from kvlocal.compress.snapkv import SnapKV


def head_budgets(scores: np.ndarray, budget: int, pos: np.ndarray, live: np.ndarray,
                 alpha_safeguard: float = 0.2, max_share: float = 2.0) -> np.ndarray:
    """Per-head budgets ``[Hkv]`` int64 from the budget-free scores [Hkv, n] (kvpress's ``AdaKVPress``).

    With ``B = min(budget, n)``: each head's best ``max(1, int(alpha_safeguard * B))`` live rows are set
    to ``+inf`` (the safeguard: every head keeps something), then each head's best
    ``int(max_share * B)`` live rows are its candidates, and the budgets are the counts per head among
    the best ``Hkv * B`` candidates of the layer (ties to the later position, then the lower head).
    They sum to ``Hkv * B`` unless there are fewer live candidates. ``pos``: [n] or [Hkv, n]; ``live``:
    [Hkv, n]. Same numbers as the reference ``adakv_budgets(..., mode="safeguard")``.
    """
    hkv, n = scores.shape
    b = max(0, min(int(budget), n))
    pos = np.broadcast_to(np.asarray(pos, dtype=np.int64), (hkv, n))
    n_live = live.sum(axis=1)
    safe = np.where(live, scores, -np.inf).astype(np.float32)
    for h, cells in enumerate(top_cells_per_head(safe, np.minimum(max(1, int(alpha_safeguard * b)), n_live), pos)):
        safe[h, cells] = np.inf
    candidates = top_cells_per_head(safe, np.minimum(int(max_share * b), n_live), pos)
    head = np.repeat(np.arange(hkv), [len(c) for c in candidates])
    cell = np.concatenate(candidates)
    order = np.lexsort((head, -pos[head, cell], -safe[head, cell]))  # score, then position descending
    return np.bincount(head[order[: hkv * b]], minlength=hkv).astype(np.int64)


@dataclass
class AdaKV(Scorer):
    """Head-wise adaptive budgets for any scorer: heads with concentrated attention give entries to others.

    Based on https://arxiv.org/abs/2407.11550 (Ada-KV), as kvpress's ``AdaKVPress`` (the safeguard
    variant; ``AdaKV(CriticalKV(SnapKV()))`` is its ``CriticalAdaKVPress``). The layer keeps
    ``Hkv * budget`` entries in all, split between its KV heads from the wrapped scorer's budget-free
    :meth:`score` (:func:`head_budgets`); each head then keeps its top ``b_h`` by the wrapped scorer's
    :meth:`rerank` (two-stage for CriticalKV). Unlike kvpress, which only masks, heads with smaller
    budgets really drop entries: their slots stay empty (``-1`` in :meth:`keep`, in front).

    The cap ``max_share`` is ours: a head never takes more than ``int(max_share * budget)`` entries, so
    a plan has at most that many slots and the engine never allocates more cells than
    ``max_share * budget`` per sequence (kvpress and the original have no cap: one head could take
    ``Hkv * budget``).

    Parameters
    ----------
    press : Scorer
        The scorer whose scores decide both the budgets and, per head, the kept entries.
    alpha_safeguard : float
        Each head's best ``max(1, int(alpha_safeguard * budget))`` entries are always in (kvpress default 0.2).
    max_share : float
        Cap on a head's budget, as a multiple of the uniform ``budget`` (>= 1).
    """

    needs_bias = True  # not a field: a narrower head's surplus slots are masked by a -inf bias
    press: Scorer = field(default_factory=SnapKV)
    alpha_safeguard: float = 0.2
    max_share: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ValueError(f"alpha_safeguard must be in [0, 1], got {self.alpha_safeguard}")
        if not self.max_share >= 1.0:
            raise ValueError(f"max_share must be >= 1 (a head may take at least the uniform budget), got {self.max_share}")

    def score(self, layer: LayerInputs) -> np.ndarray:
        return self.press.score(layer)

    def rerank(self, layer: LayerInputs, scores: np.ndarray, budgets: np.ndarray) -> np.ndarray:
        return self.press.rerank(layer, scores, budgets)

    def max_slots(self, budget: int) -> int:
        return int(self.max_share * budget)

    def budget_for_cells(self, cells: int) -> int:
        return int(cells // self.max_share)

    def keep(self, layer: LayerInputs, budget: int) -> np.ndarray:
        scores = self.press.score(layer)
        budgets = head_budgets(scores, budget, layer.pos, layer.live, self.alpha_safeguard, self.max_share)
        return select(group_max(self.press.rerank(layer, scores, budgets), layer.groups), budgets, layer.pos, layer.live)


def adakv(**kw) -> AdaKV:
    """``AdaKV(SnapKV(...))``."""
    mine = own(kw, AdaKV)
    return AdaKV(press=SnapKV(**kw), **mine)


def criticalkv_adakv(**kw) -> AdaKV:
    """``AdaKV(CriticalKV(SnapKV(...)))``: kvpress's CriticalAdaKV."""
    mine = own(kw, AdaKV)
    return AdaKV(press=criticalkv(**kw), **mine)


METHODS = {
    "adakv": Method(adakv, parts=(AdaKV, SnapKV), rank=5),
    "criticalkv+adakv": Method(criticalkv_adakv, parts=(AdaKV, CriticalKV, SnapKV), rank=6),
}
