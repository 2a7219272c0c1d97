"""The engine's scoring and selection layer: numpy in, numpy out, hot loops in ``kvlocal._kernels``.

One compression event, per layer: :class:`LayerInputs` (K, V, positions in cell order, the observation
queries, ``W_O``) -> a :class:`Scorer` -> kept cells per KV head -> a :class:`Plan` for all layers::

    from kvlocal.compress import LayerInputs, make_scorer, plan_layers

    scorer = make_scorer("criticalkv")                     # CriticalKV(SnapKV())
    plan = plan_layers(scorer, layers, budget=1024)         # layers: one LayerInputs per layer
    plan.keep[il]            # [Hkv, B] source cells per slot, per KV head, in position order (-1: empty)
    plan.slot_positions()    # [B] the position of every cell after the plan is applied
    k, v, counts, bias = plan.materialize(k_cells, v_cells, counts_in)   # the rows to write (merges done)

Methods (``METHODS``, the CLI's ``--method``; each declared by its scorer's module and gathered by
:mod:`kvlocal.compress.methods`): eviction (``full``, ``streaming``, ``snapkv``, ``criticalkv``, ``defensivekv``),
head-adaptive budgets (``adakv``, ``criticalkv+adakv``: a head may take up to ``max_share`` times the budget, so
plans have up to ``max_share * budget`` slots), and merging (``kvslimmer``, ``meanmerge``, ``criticalkv+kvslimmer``:
slots that stand for several tokens, with counts and a ``log(count)`` bias).

The contract is documented once, in :mod:`kvlocal.compress.base`; the PyTorch reference of every
scorer (``kvlocal.reference.compress``, its twin of the same name) keeps exactly the same sets
(``tests/compress/test_compress.py``, ``tests/compress/test_methods.py``).
"""

from __future__ import annotations

from kvlocal.compress.adakv import AdaKV, head_budgets
from kvlocal.compress.base import (LayerInputs, Scorer, native_scoring, observation_window, plan_layers, select,
                                   top_cells)
from kvlocal.compress.criticalkv import VALUE_NORMS, CriticalKV, norm_p, projected_value_norms
from kvlocal.compress.defensivekv import DefensiveKV
from kvlocal.compress.evict_merge import EvictThenMerge
from kvlocal.compress.full import Full
from kvlocal.compress.kvslimmer import KVSlimmer
from kvlocal.compress.meanmerge import MeanMerge
from kvlocal.compress.methods import (BIAS_METHODS, MERGING_METHODS, METHODS, WO_METHODS, Method, discover,
                                      make_scorer, method_params, methods_help, value_norm_refusal)
from kvlocal.compress.plan import LayerPlan, Plan
from kvlocal.compress.snapkv import SnapKV
from kvlocal.compress.streaming import StreamingLLM

discover()  # METHODS: every scorer module's own declaration (kvlocal.compress.methods)

# Every method runs on both KV backends (the engine's --backend). A scorer exists up to three times:
#   - the torch oracle: kvlocal.reference.compress (PyTorch, readable, the definition tests check against);
#   - numpy + C: these scorers, on K/V the state backend reads to the host (hot loops in kvlocal.kernels);
#   - ggml graphs: the same scorers fed by the patched llama.cpp's on-device graphs (llama_kv_score: window
#     votes and projected value norms; llama_kv_compact: the kept rows). A scorer that reads K/V itself (a
#     merge, DefensiveKV's maximum) asks for the rows it reads (LayerInputs.rows), which then cross.

__all__ = [
    "BIAS_METHODS",
    "MERGING_METHODS",
    "METHODS",
    "VALUE_NORMS",
    "WO_METHODS",
    "value_norm_refusal",
    "AdaKV",
    "CriticalKV",
    "DefensiveKV",
    "EvictThenMerge",
    "Full",
    "KVSlimmer",
    "LayerInputs",
    "LayerPlan",
    "MeanMerge",
    "Method",
    "Plan",
    "Scorer",
    "SnapKV",
    "StreamingLLM",
    "discover",
    "head_budgets",
    "make_scorer",
    "method_params",
    "methods_help",
    "native_scoring",
    "norm_p",
    "observation_window",
    "plan_layers",
    "projected_value_norms",
    "select",
    "top_cells",
]
