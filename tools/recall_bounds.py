"""How well the recall tier's page bounds point at the rows a question and its answer steps attend to.

    python -m tools.recall_bounds smollm2-135m --tokens 4096
    python -m tools.recall_bounds qwen2.5-coder-0.5b --tokens 4096 --top 32

Reads ``--tokens`` of ``kvlocal bench``'s text with recall on (CriticalKV, budget 0.1), asks its question and decodes
``--steps`` answer tokens, every step swapping. Before each re-selection, per compressed layer and KV head, with the
queries that re-selection is observed by (scaled, in the keys' basis):

- **coverage**: of the rows off the device, the ``--top`` with the largest logit (the most any of the queries gives
  them), and the share of them inside the candidates Quest's bounds choose at 1, 2 and 4 head budgets
  (``kvlocal/recall/select.py``: 4 is the default, ``RECALL_CANDIDATES``);
- **mass**: the attention the off-device rows could take against the device's own (``sum exp(logit - m)`` over the
  device's cells, ``m`` their largest logit): as the page bounds bound it (``PAGE · exp(bound - m)`` summed over the
  pages) and exactly — the test a step could use to skip its swap where the tier has nothing to add.

Figures of one run on one text; the tier's own keys are read in numpy, so this is slow.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvlocal.cli.bench import QUESTION, long_text
from kvlocal.compress import observation_window
from kvlocal.kernels import page_candidates
from kvlocal.engine import Engine
from kvlocal.models import resolve
from kvlocal.recall import PAGE
from kvlocal.runtime import Model

BUDGETS = (1, 2, 4)


def measure(eng: Engine, q: list[np.ndarray], q_pos: np.ndarray, top: int, out: dict) -> None:
    """One re-selection's figures (``q``: per compressed layer ``[Hq, w, d]``, as the re-selection's ``swap`` gets
    them)."""
    read = eng.compressor.read()
    w = observation_window(eng.scorer) or len(q_pos)
    scale = np.sqrt(eng.head_dim)  # the scaled queries' products are the logits times this
    layer_low = []
    for i, qi in enumerate(q):
        qs = eng.basis.queries(qi[:, -w:] * eng.compressor.q_scale)  # what choose_candidates ranks pages by
        keys = eng.basis.keys(read.kv.k[i])  # [n, Hkv, d]
        heads = eng.tier.heads[i]
        group = qs.shape[0] // len(heads)
        low = True
        for h, s in enumerate(heads):
            qh = qs[h * group:(h + 1) * group].reshape(-1, qs.shape[-1])
            device = qh @ keys[:, h].T / scale  # the logits
            device[:, read.true[i][h] < 0] = -np.inf
            m = device.max(axis=1)
            off = np.flatnonzero(~s.on_device[:s.n])
            if len(off) == 0:
                continue
            logits = qh @ eng.basis.keys(s.rows(off)[0]).T / scale  # [queries, rows off the device]
            best = off[np.argsort(-logits.max(axis=0), kind="stable")[:top]]
            for b in BUDGETS:
                cands = page_candidates(qh, s.kmin, s.kmax, s.on_device[:s.n], PAGE, b * eng.head_budget)
                out["coverage"][b].append(np.isin(best, cands).mean())
            log_device = np.log(np.exp(device - m[:, None]).sum(axis=1))
            pages = np.unique(off // PAGE)  # each query's bound on the pages holding a row off the device
            bounds = np.stack([s.page_bounds(qj[None])[pages] for qj in qh]) / scale
            # log10 of the shares, the most any query gives (a bound's may pass what a float holds)
            out["bound"].append(float((np.logaddexp.reduce(np.log(PAGE) + bounds - m[:, None], axis=1)
                                       - log_device).max() / np.log(10)))
            exact = float((np.logaddexp.reduce(logits - m[:, None], axis=1) - log_device).max() / np.log(10))
            out["exact"].append(exact)
            low &= exact < -1
        layer_low.append(low)
    out["layers_low"].append(np.mean(layer_low))
    out["off"].append(np.mean([(~s.on_device[:s.n]).sum() for layer in eng.tier.heads for s in layer]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=64, help="rows of a head that count as the ones attended to most")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    model = Model(resolve(args.model))
    question = model.tokenize(QUESTION, add_special=False)
    eng = Engine(model, 0.1, "criticalkv", max_tokens=args.tokens + len(question) + args.steps + 8,
                 n_threads=args.threads, recall=True, recall_step_confidence=1.0, recall_steps=args.steps)
    eng.prefill(long_text(model, args.tokens), reselect_after=True)  # a document, as a chat reads it
    out = {"coverage": {b: [] for b in BUDGETS}, "bound": [], "exact": [], "layers_low": [], "off": []}
    swap = eng.reselection.swap

    def observed(q, q_pos, *a, **kw):
        measure(eng, q, q_pos, args.top, out)
        return swap(q, q_pos, *a, **kw)

    eng.reselection.swap = observed  # this engine's re-selections only
    eng.append(question, probe=question, question=True)
    for _ in eng.generate(args.steps, stop_at_eog=False):
        pass
    off = float(np.mean(out["off"]))
    print(f"{model.path.name} · {args.tokens:,} tokens read · head budget {eng.head_budget} · "
          f"{len(out['off'])} re-selections (the question, then the steps) · ~{off:,.0f} rows a head off the device")
    print(f"the {args.top} rows off the device a head's queries attend to most, inside the page bounds' candidates:")
    for b in BUDGETS:
        c = np.array(out["coverage"][b])
        print(f"  {b} budget{'s' if b > 1 else ' '} ({b * eng.head_budget:,} rows, {b * eng.head_budget / off:.0%} of "
              f"them): {c.mean():.2f} (a tenth of the heads at or below {np.percentile(c, 10):.2f})")
    bound, exact = (10 ** np.median(out[k]) for k in ("bound", "exact"))
    print(f"attention the rows off the device could take, against the device's (median over heads and "
          f"re-selections): by the page bounds {bound:.3g}, exactly {exact:.3g}; "
          f"layers whose every head is below 0.1 exactly: {np.mean(out['layers_low']):.0%}")


if __name__ == "__main__":
    main()
