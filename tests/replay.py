"""Replaying the engine's compression events in the PyTorch reference (tests/engine/test_engine.py on SmolLM2,
tests/engine/test_engine_archs.py on tiny models of every architecture): the reference decodes the same tokens
and, wherever the engine compressed, keeps exactly the source positions the engine's plan kept."""

from __future__ import annotations

import numpy as np


def keep_positions(cache, kept_for) -> None:
    """Keep, in every layer and KV head of a reference cache, what ``kept_for(il, h, held)`` says
    (``held``: the positions the head holds): an array of source positions, or ``(positions, groups)``
    where each group ``(members, weights)`` is merged into one row by the reference's rule (key
    ``Σ w_i k_i``, value the count-weighted mean, count ``Σ c_i``, bias ``log(count)``, the latest
    member's position). A position that is not held is a bookkeeping bug of the engine's plan."""
    import torch

    from kvlocal.reference.compress import gather_rows

    for il, layer in enumerate(cache.layers):
        rows = []
        for h in range(layer.pos.shape[0]):
            held = layer.pos[h].numpy()
            index = {int(p): i for i, p in enumerate(held) if p >= 0}
            want = kept_for(il, h, held[held >= 0])
            singles, groups = want if isinstance(want, tuple) else (want, ())
            wanted = [int(p) for p in singles] + [int(p) for members, _ in groups for p in members]
            missing = [p for p in wanted if p not in index]
            assert not missing, f"layer {il} head {h}: keeps positions {missing[:8]} the cache does not hold"
            keep = [index[int(p)] for p in singles]
            for members, weights in groups:
                keep.append(merge_rows(layer, h, [index[int(p)] for p in members], weights))
            keep.sort(key=lambda r: int(layer.pos[h, r]))
            rows.append(torch.tensor(keep, dtype=torch.int64))
        gather_rows(layer, rows)


def merge_rows(layer, h: int, rows: list[int], weights) -> int:
    """Merge rows of KV head ``h`` into the one holding the latest position; returns that row."""
    import torch

    rows_t = torch.tensor(rows, dtype=torch.int64)
    w = torch.as_tensor(np.asarray(weights, dtype=np.float32))
    c = layer.count[h, rows_t].to(torch.float32)
    target = rows[int(torch.argmax(layer.pos[h, rows_t]))]
    layer.k[h, target] = (w[:, None] * layer.k[h, rows_t].to(torch.float32)).sum(0).to(layer.k.dtype)
    layer.v[h, target] = ((c[:, None] * layer.v[h, rows_t].to(torch.float32)).sum(0) / c.sum()).to(layer.v.dtype)
    layer.count[h, target] = int(c.sum())
    layer.bias[h, target] = float(np.log(float(c.sum())))
    return target


def replay(ref, tokens: list[int], n_prompt: int, events: list, before_event=None) -> np.ndarray:
    """Decode ``tokens`` with the reference, compressing its cache at the engine's points.

    events: ``(n_past, kept_for)`` in the engine's order. Tokens between two events go through the
    reference in one forward pass (causal attention: the same as one at a time). ``before_event(i, cache)``
    runs before event i is applied. Returns the logits after the prompt and after every later token,
    ``[len(tokens) - n_prompt + 1, V]``."""
    import torch

    cache = ref.new_cache()
    cuts = sorted({n for n, _ in events if 0 < n < len(tokens)} | {n_prompt, len(tokens)})
    out, a = [], 0
    for b in cuts:
        for i, (n, kept_for) in enumerate(events):
            if n == a:
                if before_event is not None:
                    before_event(i, cache)
                keep_positions(cache, kept_for)
        logits = ref(torch.tensor(tokens[a:b]), torch.arange(a, b), cache)  # [b - a, V]
        out.append(logits[max(0, n_prompt - 1 - a):].numpy())
        a = b
    return np.concatenate(out)
