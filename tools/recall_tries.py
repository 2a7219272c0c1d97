"""Re-run ``kvlocal eval`` with one of the recall changes tried for issue 61 and not taken (docs/recall.md §
Similar facts: the tries), so that each negative result can be checked again:

    python -m tools.recall_tries two-probes -- qwen2.5-coder-0.5b --tokens 2048 --tasks multifact12 \\
        --budgets 0.1 --methods criticalkv+recall --seed 1 -t 2 --out tries
    python -m tools.recall_tries document-mass --alpha 0.5 -- qwen2.5-coder-0.5b ...

Each try changes the engine for this process only (the package is not edited):

- ``two-probes``: a question re-selects twice — its probe decoded again over the rows the first swap brought back,
  so that its queries in the later layers are computed over them (the full cache's queries differ from layer 13 on);
- ``document-mass``: once the questions begin, every row of the document on the device gets, in each head, the
  attention bias ``alpha * log(document tokens / the head's document rows on the device)``, so that the document
  keeps its full-cache share of attention against the chat's history (which a tenth of the document on the device
  lets grow);
- ``engine``: any of :class:`~kvlocal.engine.Engine`'s keywords, as JSON (``--set '{"recall_step_confidence": 1}'``:
  every one of an answer's first steps swaps).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from kvlocal.engine import engine as engine_module

Engine = engine_module.Engine


def two_probes() -> None:
    reselect = Engine.reselect

    def twice(self, probe=None, pending=None):
        return reselect(self, probe, pending) + reselect(self, probe, pending)

    Engine.reselect = twice


def document_mass(alpha: float) -> None:
    append = Engine.append

    def mass(eng) -> None:
        end = getattr(eng, "_document_end", None)
        if not end:
            return
        cells, pos = eng.ctx.cells()
        document = pos < end
        for il in range(eng.model.n_layer):
            b = eng.ctx.bias(il)
            held = (np.isfinite(b) & document).sum(axis=1)
            add = (alpha * np.log(end / np.maximum(held, 1))).astype(np.float32)
            eng.ctx.set_bias(il, np.where(document & np.isfinite(b), add[:, None], b))

    def appended(self, tokens, probe=None, progress=None, question=False, reselect_after=False):
        if question and getattr(self, "_document_end", None) is None and self.n_past > 0:
            self._document_end = self.n_past  # the first question after the document's turn
            mass(self)
            apply = self.compressor.apply

            def applied(read, plan):  # every event and swap from here on: this engine's
                apply(read, plan)
                mass(self)

            self.compressor.apply = applied
        return append(self, tokens, probe, progress, question, reselect_after)

    Engine.append = appended


def engine_keywords(values: dict) -> None:
    init = Engine.__init__

    def with_values(self, *args, **kwargs):
        init(self, *args, **{**kwargs, **values})

    Engine.__init__ = with_values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.recall_tries", description=__doc__.split("\n\n")[0])
    p.add_argument("try_", metavar="TRY", choices=("two-probes", "document-mass", "engine"))
    p.add_argument("--alpha", type=float, default=1.0, help="document-mass: the bias's factor (default 1)")
    p.add_argument("--set", default="{}", help="engine: Engine keywords as JSON")
    p.add_argument("eval_args", nargs=argparse.REMAINDER, help="-- then kvlocal eval's arguments")
    args = p.parse_args(argv)
    if args.try_ == "two-probes":
        two_probes()
    elif args.try_ == "document-mass":
        document_mass(args.alpha)
    else:
        engine_keywords(json.loads(args.set))
    from kvlocal.cli import main as kvlocal_main

    rest = args.eval_args[1:] if args.eval_args[:1] == ["--"] else args.eval_args
    return kvlocal_main(["eval", *rest])


if __name__ == "__main__":
    sys.exit(main())
