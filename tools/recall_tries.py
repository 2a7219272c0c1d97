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
- ``newcomers``: at a question's re-selection, the device rows that an earlier re-selection brought back from the tier
  (the facts earlier questions and answers used, whole) score ``--factor`` times their attention, so that such a fact
  keeps its cells only where the new question needs it more than what it displaces (commit 703e743 built it into the
  engine, ``Engine(recall_returned=)``; this is the same scoring, the numpy path);
- ``layer-budgets``: the layers before ``--from`` keep ``--early-share`` of the budget ``kvlocal eval`` is given,
  the ones from it on ``--late-share`` (every event, swap and answer step): what a cache sized per layer would hold
  (llama.cpp's cells are the same for every layer, so the other cells stay empty here and the bytes are the
  budget's) — at ``--budgets 0.15 --from 13 --early-share 0.33`` on Qwen2.5-Coder-0.5B the rows held are 0.096 of
  the document's, a tenth;
- ``retrieval-layers``: the layers ``--layers`` (Qwen2.5-Coder-0.5B's retrieval heads sit in 15, 16, 17, 19, 20) hold
  every row they have read, exactly as the full cache does, and the others the budget's — the upper bound of an
  answer whose retrieval heads read the tier's rows on the host. The context gets ``--extra`` cells more for those
  layers' rows; the re-selections still size the other layers' rows by the budget's context. The extra cells
  also change when the document's compression events fall (it is read in one chunk and one event), so its control
  is the same try with ``--layers none`` — which answered as well (11 of 12 on seed 1, against 8): the control, not
  the layers, found the cause. ``--phase document`` lets only the document's reading fill the extra cells (the chat
  then runs in the budget's cells: 11, 12, 12 of 12 on the development seeds), ``--phase questions`` only the later
  turns (8 of 12, as without the try): what ``Engine(read_cells=)`` then built (docs/recall.md § Similar facts);
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


def newcomers(factor: float) -> None:
    import kvlocal.compress.snapkv as snapkv
    import kvlocal.recall.reselect as reselect

    snapkv.FUSED = False  # every score passes through SnapKV.score (the fused kernel keeps the same rows)
    score, question = snapkv.SnapKV.score, reselect.Reselection.question
    asking = []  # the tier of the question being re-selected for, while it is

    def weighed(self, layer):
        s = score(self, layer)
        for tier in asking:
            for h, store in enumerate(tier.heads[layer.layer]):  # (every layer is compressed in these models)
                back = store.pos[:store.n][store.on_device[:store.n]]
                earlier = np.isin(layer.pos_h[h], back) & np.isfinite(s[h])
                s[h, earlier] *= np.float32(factor)
        return s

    def asked(self, probe, pending):
        asking.append(self.tier)
        try:
            return question(self, probe, pending)
        finally:
            asking.pop()

    snapkv.SnapKV.score = weighed
    reselect.Reselection.question = asked


def layer_budgets(first: int, early: float, late: float) -> None:
    import kvlocal.engine.compressor as compressor

    plan_layers = compressor.plan_layers

    def planned(scorer, layers, budget, workers=1):
        class Layered:  # the scorer, each layer's budget scaled by its share
            def __getattr__(self, name):
                return getattr(scorer, name)

            def plan_layer(self, layer, b):
                return scorer.plan_layer(layer, max(1, int(b * (late if layer.layer >= first else early))))

        return plan_layers(Layered(), layers, budget, workers)

    compressor.plan_layers = planned


def retrieval_layers(layers: set[int], extra: int, phase: str = "all") -> None:
    import kvlocal.engine.compressor as compressor

    context, init, plan_layers = engine_module.Context, Engine.__init__, compressor.plan_layers
    free, append = Engine._free_cells, Engine.append

    def free_cells(self):  # the extra cells are filled only in ``phase``
        asked = getattr(self, "_asked", False)
        return free(self) - (extra if phase == ("document" if asked else "questions") else 0)

    def appended(self, tokens, probe=None, progress=None, question=False, reselect_after=False):
        try:  # the document is the first turn (``kvlocal eval``'s chats ask it as a question)
            return append(self, tokens, probe, progress, question, reselect_after)
        finally:
            self._asked = True

    def wider(model, n_ctx, **kw):
        return context(model, n_ctx=n_ctx + extra, **kw)

    def with_extra(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.reselection.n_ctx -= extra  # the other layers' re-selected rows: the budget's context's

    def planned(scorer, inputs, budget, workers=1):
        class Whole:  # the scorer, the layers in ``layers`` keeping every row
            def __getattr__(self, name):
                return getattr(scorer, name)

            def plan_layer(self, layer, b):
                return scorer.plan_layer(layer, 1 << 30 if layer.layer in layers else b)

        return plan_layers(Whole(), inputs, budget, workers)

    engine_module.Context, Engine.__init__, compressor.plan_layers = wider, with_extra, planned
    Engine._free_cells, Engine.append = free_cells, appended


def engine_keywords(values: dict) -> None:
    init = Engine.__init__

    def with_values(self, *args, **kwargs):
        init(self, *args, **{**kwargs, **values})

    Engine.__init__ = with_values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.recall_tries", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s TRY [options] -- kvlocal eval's arguments")
    p.add_argument("try_", metavar="TRY",
                   choices=("two-probes", "document-mass", "newcomers", "layer-budgets", "retrieval-layers", "engine"))
    p.add_argument("--alpha", type=float, default=1.0, help="document-mass: the bias's factor (default 1)")
    p.add_argument("--factor", type=float, default=0.5, help="newcomers: the earlier rows' factor (default 0.5)")
    p.add_argument("--from", dest="first", type=int, default=13, help="layer-budgets: the first later layer (13)")
    p.add_argument("--early-share", type=float, default=0.33, help="layer-budgets: the earlier layers' share of it")
    p.add_argument("--late-share", type=float, default=1.0, help="layer-budgets: the later layers' share of it")
    p.add_argument("--layers", default="15,16,17,19,20",
                   help="retrieval-layers: the layers that hold every row, comma-separated, or none")
    p.add_argument("--extra", type=int, default=4096, help="retrieval-layers: the cells added for their rows")
    p.add_argument("--phase", choices=("all", "document", "questions"), default="all",
                   help="retrieval-layers: when the extra cells may be filled (all: the chat's whole length)")
    p.add_argument("--set", default="{}", help="engine: Engine keywords as JSON")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # (a REMAINDER positional would take the try's options)
    args, rest = p.parse_args(argv[:cut]), argv[cut + 1:]
    if args.try_ == "two-probes":
        two_probes()
    elif args.try_ == "document-mass":
        document_mass(args.alpha)
    elif args.try_ == "newcomers":
        newcomers(args.factor)
    elif args.try_ == "layer-budgets":
        layer_budgets(args.first, args.early_share, args.late_share)
    elif args.try_ == "retrieval-layers":
        if args.layers != "none" and args.phase != "all":
            p.error("--layers other than none need the extra cells the whole chat long (--phase all): the rows they "
                    "hold fill them")
        retrieval_layers(set() if args.layers == "none" else {int(x) for x in args.layers.split(",")}, args.extra, args.phase)
    else:
        engine_keywords(json.loads(args.set))
    from kvlocal.cli import main as kvlocal_main

    return kvlocal_main(["eval", *rest])


if __name__ == "__main__":
    sys.exit(main())
