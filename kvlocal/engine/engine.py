"""Bounded-memory generation: chunked prefill and decoding inside a fixed llama.cpp KV budget.

The llama.cpp context is created with ``n_ctx = budget + chunk + probe`` cells, not the prompt length, so KV
memory is O(budget). A long prompt is decoded in chunks; after each chunk, and during decoding whenever the live
cells pass ``budget + slack``, one *compression event* runs:

    observe  decode the probe (the question, or a generic prompt) with query capture, then remove it
    read     K/V rows and positions of every cell (state backend) / the cells' positions (native)
    score    per layer and KV head (kvlocal.compress scorers, numpy + C kernels; on the native backend
             fed by the device's window attention and value norms, llama_kv_score)
    plan     per layer and KV head, which source rows fill which cell (kvlocal.compress.Plan)
    apply    write the compacted cells back (state) / move the kept rows on the device (llama_kv_compact)

Two KV backends (``backend=``, ``--backend``; :mod:`kvlocal.backends`, one interface: read → layer inputs →
apply): ``native`` keeps K/V on the device — the patched llama.cpp scores the cells and moves the kept rows by
ggml graphs, and only queries, scores, positions, indices and the rows a method reads cross to the host;
``state`` reads the sequence state to the host, scores it there and loads it back (any llama.cpp build; the
oracle native is tested against). Both run every method; ``auto`` picks native where the cache is on a GPU.

Different KV heads may keep different tokens in the same cell: attention is computed per head, so a cell is just
a slot. A cell has one position (for the causal mask and for "the next token goes at max position + 1"); the
backend keeps each row's true source position (its ``RowRecord``) and the scorers use it for pooling and recency.

The recall tier (``recall=``; :mod:`kvlocal.recall`): the rows an event evicts go to host memory, and a later
question (``append(..., question=True)``, :meth:`Engine.reselect`) scores the device cells and the tier's best pages
together and swaps rows in and out, inside the same cells: while the question is answered the rows fill the
context's headroom too (the cells prefill chunks use), and the answer's first compression returns to the budget.

A long turn read whole (``read_cells=``; :mod:`kvlocal.engine.reading`): instead of chunks inside the budget's
context, the turn is decoded in a reading context in host memory and compressed once, so that every row kept is the
full cache's; then the cells move to the budget's context, which is the same before and after.

Models with interleaved sliding-window attention (Gemma 3) keep two caches in llama.cpp: the sliding layers'
cache is bounded by the window already, and llama.cpp keeps it; kvlocal compresses the full-attention layers'
cache (``model.arch.full_layers``) to the budget. Memory figures count both. Scoring uses the model's own
attention scale (``arch.attn_scale``: Gemma's query scaling, a file's ``attention.scale``), with head sizes from
``key_length``/``value_length``.

The observation window (docs/engine.md, "What scores the cache"): in prefill and a chat turn, the last ``recent``
tokens of the text being added (or ``probe=``); at a decode-time event, the last half-window of that probe and of
the reply so far, observed by default by the queries those tokens had when decoded, turned by RoPE
(``decode_observe="kept"``, :meth:`Observations.kept`), so a long reply is scored by what it says now too.
``prefill_observe="window"`` scores a prompt's events before its last by their chunk's own last tokens instead of the
probe (no decode of ours; measured to find fewer facts, not the default). The decodes behind all of these are
:class:`~kvlocal.engine.observer.Observer`'s.

The engine holds its parts and calls them, each with the state it owns: the cells (:class:`~kvlocal.engine.cells.
Cells`: ``n_past``, the logits), the observer, the compressor (:class:`~kvlocal.engine.compressor.Compressor`: the
backend, the scorer, the latest plan), the re-selection (:class:`~kvlocal.recall.Reselection`: the tier, the answer's
step state) and positions (:class:`~kvlocal.engine.positions.Positions`).

Ctrl-C (KeyboardInterrupt) at any point leaves the engine as it was before the interrupted chunk or token: cells
past the last completed position are removed, and a compression event either completes or leaves the previous
cells (``write_seq`` is all or nothing). A whole turn is undone by what it changed (:meth:`Engine.mark`,
:meth:`Engine.undo`: :mod:`kvlocal.engine.undo`). An Engine is not thread-safe: use one per thread (or guard it with a
lock). Several engines may share nothing but the read-only W_O cache.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from kvlocal.compress import BIAS_METHODS, Plan, make_scorer, norm_p
from kvlocal.engine.cells import Cells
from kvlocal.engine.compressor import Compressor
from kvlocal.engine.config import DECODE_OBSERVE, OBSERVE_EVERY, PREFILL_OBSERVE, RECALL_CANDIDATES, RECALL_STEP_CANDIDATES, RECALL_STEP_CONFIDENCE, RECALL_ROOM, RECALL_STEP_EVERY, RECALL_STEPS, Budget, EngineConfig, EngineState, EngineStats, check_read_cells, resolve_low_water, resolve_read_cells, resolve_method_params, resolve_recall
from kvlocal.engine.interrupts import interrupts_deferred
from kvlocal.engine.observation import Observations, Rope
from kvlocal.engine.observer import Observer
from kvlocal.engine.positions import Positions
from kvlocal.engine.reading import read_whole
from kvlocal.engine.undo import TurnMark, after_apply, before_apply, before_reposition, open_mark, release, undo
from kvlocal.errors import CacheFull, RuntimeUnavailable, SettingError, UsageError
from kvlocal.recall import HostTier, Reselection, TierMemory, tier_figures
from kvlocal.backends import make_backend, output_projections, resolve_backend
from kvlocal.runtime import (CacheBasis, Context, Model, QueryCapture, Sampler, bytes_per_value, flash_attention,
                             has_attention_bias, kv_cache_bytes, pad_cells, row_format)

# A generic observation window for when the question is not known yet (a document read before the
# chat starts). Query-agnostic, in the spirit of KVzip's reconstruction prompt: queries that ask for
# the text back attend to what a later question is likely to need. Measured against the
# question-aware probe in docs/engine.md.
AGNOSTIC_PROBE = "\n\nRepeat the text above, with every name, number and key fact in it."


def _part(part: str, name: str, doc: str, settable: bool = False) -> property:
    """The attribute ``name`` of the engine's part ``part`` (its owner), read — and with ``settable`` set — on the
    engine, as its callers always have."""
    put = (lambda self, value: setattr(getattr(self, part), name, value)) if settable else None
    return property(lambda self: getattr(getattr(self, part), name), put, doc=doc)


class Engine:
    """A llama.cpp context whose KV cache stays within a budget.

    ``Engine(model, budget=0.1, method="criticalkv")``, then ``prefill(tokens, probe=...)`` and
    ``generate(n)`` (an iterator of token ids); ``append`` adds a later turn; ``stats`` tells memory,
    speed and compression figures.
    """

    @classmethod
    def from_settings(cls, model: Model, settings, *, max_tokens: int, n_threads: int | None = None,
                      endless: bool = False, recall_mem=None) -> "Engine":
        """The engine a chat's settings (:class:`kvlocal.settings.ChatSettings`) ask for, by their
        :meth:`~kvlocal.settings.ChatSettings.engine_keywords` — how ``kvlocal chat``, ``serve``, ``run`` and
        ``kvlocal.Chat`` all make theirs; ``recall_mem``: a :class:`~kvlocal.recall.TierMemory` shared with other
        engines, instead of the settings' own cap."""
        kw = settings.engine_keywords()
        if recall_mem is not None:
            kw["recall_mem"] = recall_mem
        return cls(model, max_tokens=max_tokens, n_threads=n_threads, endless=endless, **kw)

    def __init__(
        self,
        model: Model | str | Path,
        budget: Budget | float | int | str = 0.1,
        method: str = "criticalkv",
        *,
        max_tokens: int,
        chunk: int = 128,
        recent: int = 32,
        n_sink: int = 4,
        n_gpu_layers: int = 0,
        flash_attn: bool = False,
        n_threads: int | None = None,
        type_k: int | None = None,
        type_v: int | None = None,
        endless: bool = False,
        backend: str = "auto",
        recall: bool | None = False,
        recall_mem: int | str | TierMemory | None = None,  # the tier's RAM cap (TierMemory.of: None the default)
        recall_dir: str | None = None,
        recall_span: str = "row",
        recall_candidates: float = RECALL_CANDIDATES,
        recall_steps: int = RECALL_STEPS,
        recall_step_candidates: float = RECALL_STEP_CANDIDATES,
        recall_step_confidence: float = RECALL_STEP_CONFIDENCE,
        recall_step_every: int = RECALL_STEP_EVERY,
        recall_room: int = RECALL_ROOM,
        observe_every: int = OBSERVE_EVERY,
        method_params: dict | None = None,
        decode_observe: str = DECODE_OBSERVE,
        low_water: float | None = None,
        prefill_observe: str = PREFILL_OBSERVE,
        read_cells: int | str | None = 0,
    ):
        budget = budget if isinstance(budget, Budget) else Budget.parse(budget)
        recall = resolve_recall(recall, method)
        self.cfg = EngineConfig(budget, method, chunk, recent, n_sink, max_tokens, observe_every, decode_observe,
                                prefill_observe, resolve_low_water(low_water, recall))
        self.cfg.validate()
        check_read_cells(read_cells)
        scorer = make_scorer(method, **resolve_method_params(method, method_params))  # e.g. {"value_norm": "l1"}
        resolve_backend(backend, type_k, type_v, recall=recall)  # a refusal before the model loads
        if method in BIAS_METHODS and not has_attention_bias():
            raise RuntimeUnavailable(f"{{method}} {method} needs kvlocal's patched llama.cpp (a per-head attention "
                                     f"bias, patch 0007); this runtime is stock: run `python ggml_patches/build.py`",
                                     "method")
        self.model = model if isinstance(model, Model) else Model(model, n_gpu_layers=n_gpu_layers)
        made = time.perf_counter()  # (the engine's own setup, the model loaded)
        m = self.model
        self.backend = resolve_backend(backend, type_k, type_v, offloaded=m.n_gpu_layers != 0, recall=recall,
                                       head_dims=(m.arch.head_dim_k, m.arch.head_dim_v), remote=m.remote)
        self.layers = m.arch.full_layers  # the model layers whose cache is compressed (all but sliding ones)
        self.head_dim = m.arch.head_dim_k
        # how the cache stores rows: a quantized one as raw blocks, K (and V) Walsh–Hadamard-rotated
        self.basis = None if method == "full" else CacheBasis.for_cache(type_k, type_v, m.arch.head_dim_k, m.arch.head_dim_v)
        self.bytes_per_value = (bytes_per_value(type_k) + bytes_per_value(type_v)) / 2  # of K and V, for the formulas
        # the scorers compute q·k/√d; the model's logits are q·k·attn_scale: scale the queries once
        q_scale = np.float32(m.arch.attn_scale * math.sqrt(self.head_dim))
        floor = scorer.max_slots(n_sink + recent)  # every head's share holds the sinks and the recent span
        # the budget is memory, for every method: the cells a compression may leave (a budget above what the
        # session may see is just the full cache)
        self.budget_cells = max_tokens if method == "full" else min(budget.cells_for(max_tokens, floor), max_tokens)
        # each head's mean share of them: all of them, or less where heads share the cells unevenly (AdaKV: a
        # layer's cells hold its widest head, up to max_share × the mean; the others' surplus slots are masked
        # out by a -inf bias)
        self.head_budget = self.budget_cells if method == "full" else scorer.budget_for_cells(self.budget_cells)
        self.slot_cells = min(scorer.max_slots(self.head_budget), max_tokens)
        self._wo = output_projections(str(m.path)) if scorer.needs_wo else None
        # llama.cpp pads n_ctx (to 256 cells here); prefill chunks then fill whatever is free, so the
        # effective chunk is n_ctx - budget - probe >= chunk
        headroom = 0 if method == "full" else chunk + recent
        capture = QueryCapture.for_model(m)
        n_ctx = self.slot_cells + headroom
        if m.arch.has_swa:  # the sliding cache shares n_ctx: it must hold the window and a chunk with its probe
            n_ctx = max(n_ctx, m.arch.n_swa + chunk + recent)
        if endless and pad_cells(n_ctx) + self._recent_span_of(m) > m.n_ctx_train:
            raise self._no_room(pad_cells(n_ctx))  # before llama.cpp allocates a cache that cannot work
        self.ctx = Context(m, n_ctx=n_ctx, n_batch=min(n_ctx, 2048), n_threads=n_threads,
                           type_k=type_k, type_v=type_v, cb_eval=capture.callback,
                           flash_attn=flash_attention(flash_attn, type_v, biased=method in BIAS_METHODS,
                                                      offloaded=m.n_gpu_layers != 0,
                                                      head_dims=(m.arch.head_dim_k, m.arch.head_dim_v)))
        measured = self.ctx.kv_bytes()
        allocated = measured or kv_cache_bytes(m, self.ctx.n_ctx, self.ctx.n_ubatch)
        self.stats = EngineStats(n_ctx=self.ctx.n_ctx, budget_cells=self.budget_cells, backend=self.backend,
                                 kv_bytes_allocated=sum(allocated), kv_bytes_swa=allocated[1],
                                 kv_bytes_measured=measured is not None,
                                 # stock llama.cpp: a full cache (of the same types) for every token it may see
                                 kv_bytes_full=sum(kv_cache_bytes(m, pad_cells(max_tokens), bias=False,
                                                                  bytes_per_elem=self.bytes_per_value)))
        # where events read and write the cache, and its record of each row's true position and count
        self.kv = make_backend(self.backend, self.ctx, self.layers, m.n_head_kv, self.head_dim, self.basis, self._wo,
                               norm_p(scorer))
        self.kv.prepare()  # its one-time work for the model (W_O's factors), not the first event's
        # the cells, their positions and logits: what every part below decodes into or rewrites
        self.cells = Cells(self.ctx, capture, self.kv, self.stats)
        # the recall tier: every row an event evicts, brought back by a later question (:meth:`reselect`)
        if recall_span not in ("page", "row"):
            raise UsageError(f"recall_span {recall_span!r}: choose page or row")
        # the first tokens of an answer re-select too, each observed by its own query (Reselection.step)
        if recall_steps < 0 or recall_step_every < 1:
            raise UsageError(f"recall_steps {recall_steps} must be >= 0 (0: only the question re-selects), "
                             f"recall_step_every {recall_step_every} >= 1")
        if recall_room < 0:
            raise UsageError(f"recall_room {recall_room} must be >= 0 (0: a re-selection keeps the budget's rows)")
        memory = TierMemory.of(recall_mem) if recall else None
        self.tier = HostTier(len(self.layers), m.n_head_kv, row_format(type_k, m.arch.head_dim_k),
                             row_format(type_v, m.arch.head_dim_v), m.arch.head_dim_k, memory,
                             recall_dir) if recall else None
        # a turn longer than the free cells is read in a reading context of up to this many cells (None: no cap;
        # kvlocal.engine.reading)
        cell_bytes = kv_cache_bytes(m, 1 << 16, bytes_per_elem=self.bytes_per_value)[0] / (1 << 16)
        self.read_cells = resolve_read_cells(read_cells, recall, memory and memory.limit, cell_bytes)
        self._marks: list[TurnMark] = []  # turns that may still be undone (:meth:`mark`), oldest first
        self.last_token = -1
        self.prompt_plan: Plan | None = None  # the plan in effect when the prompt ended (--dump-plan)
        self._probe: list[int] | None = None  # the probe of the last prefill/append
        self._reply: list[int] = []  # tokens generated since the last prefill/append
        # prefill events between two decodes of the probe are scored by its queries moved by RoPE
        self.observer = Observer(self.cells, self.cfg, Observations(Rope.of(m) if method != "full" else None,
                                                                    self.cfg.observe_every), self.stats)
        me = weakref.proxy(self)  # (the undo log's hooks: no cycle that would keep llama.cpp's context alive)
        self.compressor = Compressor(self.cells, self.observer, self.kv, scorer, self.tier, self.stats, self.cfg,
                                     basis=self.basis, q_scale=q_scale, head_budget=self.head_budget,
                                     budget_cells=self.budget_cells, wo=self._wo,
                                     before_apply=lambda read, plan: before_apply(me, read, plan),
                                     after_apply=lambda rewrite, rows: after_apply(me, rewrite, rows))
        # tier rows scored exactly per head at a question, as a multiple of the budget (the best pages by bound); a
        # step's (× the budget); above the confidence a step keeps its decode unswapped, and so do the steps fewer than
        # recall_step_every past the last swap; recall_room: cells a re-selection leaves for the answer
        self.reselection = Reselection(self.tier, self.observer, self.compressor, self.stats, n_ctx=self.ctx.n_ctx,
                                       reserve=self._reserve(), candidates=float(recall_candidates),
                                       steps=int(recall_steps), step_candidates=float(recall_step_candidates),
                                       step_confidence=float(recall_step_confidence),
                                       step_every=int(recall_step_every), room=int(recall_room), span=recall_span)
        # endless (a chat): past max_tokens the session goes on inside the same budget, and its positions
        # are moved back under the trained context whenever they would pass it
        self.endless = endless
        self.positions = Positions(self.cells, self.observer, self.tier, self.basis, self.stats, limit=m.n_ctx_train,
                                   recent_span=self._recent_span_of(m), sliding=m.arch.has_swa)
        if endless:
            if method == "full":
                raise SettingError("an endless session needs a compression method: {method} full keeps every token",
                                   "method")
            if self.ctx.n_ctx + self.positions.recent_span + self.ctx.n_batch > m.n_ctx_train:
                raise self._no_room(self.ctx.n_ctx)
        self.stats.setup_seconds = time.perf_counter() - made

    def _no_room(self, cells: int) -> UsageError:
        m = self.model
        return UsageError(f"the budget's {cells:,} cells leave no room under the {m.n_ctx_train:,} positions "
                          f"{Path(m.path).name} was trained on: lower --budget (a ratio budget is a share of -c)")

    def _recent_span_of(self, m: Model) -> int:
        return max(self.cfg.recent, m.arch.n_swa if m.arch.has_swa else 0)

    # -- what the parts own, read (and set) where the engine is -------------------------------------
    n_past = _part("cells", "n_past", "The next token's position.", settable=True)
    logits = _part("cells", "logits", "The last decoded token's logits (None before any).", settable=True)
    capture = _part("cells", "capture", "The context's query capture (its eval callback).")
    scorer = _part("compressor", "scorer", "The method's scorer (:mod:`kvlocal.compress`).", settable=True)
    last_plan = _part("compressor", "last_plan", "The latest compression event's plan (its layers: ``layers``).")
    last_probe = _part("observer", "last_probe", "The tokens whose queries scored the latest event.")
    observations = _part("observer", "observations", "The probe queries later events reuse (:class:`Observations`).")
    position_limit = _part("positions", "limit", "The positions an endless session stays under (the trained context).",
                           settable=True)

    # -- public API ---------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], probe: Sequence[int] | None = None,
                progress: Callable[[int, int], None] | None = None, reselect_after: bool = False) -> np.ndarray:
        """Decode a prompt in chunks that fill the free cells, compressing back to the budget whenever the
        context is full and once more at the end. ``probe``: tokens whose queries score the cache (the
        question; its last ``recent`` tokens are used); None uses the generic query-agnostic probe.
        ``progress(done, total)`` is called after every chunk. ``reselect_after``: the caller re-selects the cache
        for a question next (``kvlocal run``'s prompt end, a chat's document before its question), which decodes
        the question afresh — so with a recall tier the prompt's last event is observed as the others are, its probe
        decoded once in ``observe_every`` events, instead of afresh for a cache nothing generates from. With
        ``read_cells``, a prompt longer than the free cells is read in a reading context on the host and compressed
        once (:mod:`kvlocal.engine.reading`). Returns the last logits."""
        self._check_usable()
        if len(tokens) == 0:
            raise UsageError("the prompt is empty: give at least one token of text")
        t0 = time.perf_counter()
        self._check_cap(len(tokens))
        cells = self._reading_cells(len(tokens))
        with read_whole(self, cells) if cells else contextlib.nullcontext():
            return self._read(tokens, probe, progress, reselect_after, t0)

    def _read(self, tokens: Sequence[int], probe: Sequence[int] | None, progress, reselect_after: bool,
              t0: float) -> np.ndarray:
        """:meth:`prefill`'s chunks and events, in the context the engine uses now."""
        probe = self._probe_tokens(probe)
        self._probe, self._reply = probe, []
        self.observations.drop_tokens()
        self.reselection.answering = False
        observed = None  # the probe's queries over the cache as it is now
        i = 0
        while i < len(tokens):
            room = self._free_cells()
            if room < 1:
                self._compress(probe, observed, head_budget=self._low_water(len(tokens) - i))
                continue
            self._fit_positions(room + len(probe))
            # at most a batch at a time, so that progress (and a stop asked for there) comes at least that often,
            # in a reading context too (kvlocal.engine.reading), whose room may be the whole turn
            chunk = list(tokens[i:i + min(room, self.ctx.n_batch)])
            last = i + len(chunk) >= len(tokens)
            # a compression may follow the chunk (it fills the cells, or ends the prompt): it is observed
            follows = (self.cfg.method != "full" and (last or len(chunk) == room)
                       and self.live_cells() + len(chunk) > self.compressor.settled)
            if self.cfg.prefill_observe == "window" and not last:
                observed = self.observer.decode_chunk(chunk, probe, follows, window=True)
            else:  # the event that ends the prompt is observed afresh where generation starts from its cache
                fresh = last and not (reselect_after and self.tier is not None)
                observed = self.observer.decode_chunk(chunk, probe,
                                                      follows and (fresh or self.observations.needs_decode(probe)))
            i += len(chunk)
            if progress is not None:
                progress(i, len(tokens))
        if self.live_cells() > self.compressor.settled:
            self._compress(probe, observed)
        self.stats.prompt_tokens += len(tokens)
        if self.prompt_plan is None:
            self.prompt_plan = self.last_plan
        self.stats.prefill_seconds += time.perf_counter() - t0
        return self.logits

    def read_prompt(self, tokens: Sequence[int], probe: Sequence[int] | None = None, tail: int = 32,
                    answer: bool = True) -> np.ndarray:
        """Read a prompt that ends with its question, as ``kvlocal run`` does: with a recall tier, all but its last
        ``tail`` tokens (:meth:`prefill` with ``reselect_after``), then the cache re-selected for ``probe`` before the
        tail is decoded (:meth:`append` with ``question``), so that the question's tokens attend to what came back;
        ``answer=False`` then leaves the answer's first tokens to the cache as it is (a benchmark's decode, not the
        answer's re-selecting steps). Without a tier, or for a prompt of ``tail`` tokens or fewer, :meth:`prefill`.
        Returns the last logits."""
        if self.tier is None or tail <= 0 or len(tokens) <= tail:
            return self.prefill(tokens, probe=probe)
        self.prefill(tokens[:-tail], probe=probe, reselect_after=True)
        logits = self.append(tokens[-tail:], probe=probe, question=True)
        self.reselection.answering = self.reselection.answering and answer
        return logits

    def append(self, tokens: Sequence[int], probe: Sequence[int] | None = None,
               progress: Callable[[int, int], None] | None = None, question: bool = False,
               reselect_after: bool = False) -> np.ndarray:
        """Add a later turn to the compressed cache (the history is never decoded again). ``question``: the
        turn is a question — with a recall tier, the cache is re-selected for it first (:meth:`reselect`),
        so that its own tokens already attend to what came back. ``reselect_after``: as :meth:`prefill`'s."""
        if question:
            self.reselect(probe if probe is not None else tokens, pending=len(tokens))
        logits = self.prefill(tokens, probe, progress, reselect_after=reselect_after)
        self.reselection.answering, self.reselection.held = question and self.tier is not None, None
        return logits

    def reselect(self, probe: Sequence[int] | None, pending: int | None = None) -> int:
        """Re-select the cache for a new question with the recall tier (:mod:`kvlocal.recall`,
        :meth:`Reselection.question <kvlocal.recall.Reselection.question>`): the question's probe (its last ``recent``
        tokens; None: the generic probe) scores the device cells and the tier's best pages together, and rows are
        swapped in and out. ``pending``: the tokens that come next (the question; the probe's by default), whose cells
        the re-selection leaves free. Returns the rows brought back (0 without a tier, or when it holds nothing off
        the device)."""
        if self.tier is None or self.tier.n_rows == 0:
            return 0
        self._check_usable()
        pending = len(probe or ()) if pending is None else pending
        return self.reselection.question(self._probe_tokens(probe), pending)

    def generate(self, max_new: int, sampler: Sampler | None = None, stop_at_eog: bool = True) -> Iterator[int]:
        """Yield up to max_new tokens; the end-of-generation token is kept in the cache, not yielded.

        New tokens fill the cells the prefill chunks used (``slack`` = n_ctx - budget - probe cells);
        when those are full the cache is compressed back to the budget, scored by :meth:`decode_probe`. After a
        question (``append(..., question=True)``) the first ``recall_steps`` tokens re-select the cache with the
        recall tier before they are decoded (:meth:`Reselection.step <kvlocal.recall.Reselection.step>`; their time
        counts in ``decode_seconds``)."""
        self._check_usable()
        if self.logits is None:
            raise UsageError("nothing to continue: prefill a prompt before generating")
        sampler = sampler or Sampler()
        for _ in range(max_new):
            tok = sampler(self.logits)
            t0 = time.perf_counter()
            self._check_cap(1)
            if self._fit_positions(1 + self.cfg.recent):
                self.reselection.held = None  # queries at positions that moved
            if self._free_cells() < 1:
                self._compress(self.decode_probe(), decoding=True)
            eog = self.model.is_eog(tok)
            decoded = self.reselection.answers(len(self._reply), eog) and self.reselection.step(tok)
            if not decoded:
                self.observer.decode_token(tok, self._free_cells())
            self.last_token = tok
            self._reply.append(tok)
            self.cells.note_live()
            self.stats.decode_seconds += time.perf_counter() - t0
            if stop_at_eog and eog:
                self.stats.end_tokens += 1
                return
            self.stats.generated_tokens += 1
            yield tok

    def snapshot(self) -> "EngineState":
        """Everything the engine's next step depends on, copied to the host: llama.cpp's sequence state
        (the cells' K/V rows, positions and biases) and kvlocal's record of the rows (true positions,
        counts), the last logits and the statistics. O(budget) bytes."""
        self._check_usable()
        return EngineState(
            blob=self.kv.save(), n_past=self.n_past, last_token=self.last_token,
            logits=None if self.logits is None else self.logits.copy(), record=self.kv.record.copy(),
            tier_mark=None if self.tier is None else self.tier.mark_of(),
            settled=self.compressor.settled, probe=None if self._probe is None else list(self._probe), reply=list(self._reply),
            stats=self.stats.as_dict())

    def mark(self) -> TurnMark:
        """Where a turn begins, for :meth:`undo`: nothing is copied while the turn decodes; each event notes what it
        rewrites, copying only rows the recall tier does not keep (:mod:`kvlocal.engine.undo`, counted in
        ``rollback_bytes``). Open until undone or :meth:`release`-d."""
        self._check_usable()
        return open_mark(self)

    def undo(self, mark: TurnMark) -> None:
        """Put the engine back to ``mark`` exactly (cells, positions, biases, records, logits, tier, statistics):
        the turn's events are reversed and the cells it added removed. Closes ``mark`` and the marks after it."""
        undo(self, mark)

    def release(self, mark: TurnMark) -> None:
        """Stop keeping what :meth:`undo` would need for ``mark`` (a turn that will not be undone)."""
        release(self, mark)

    def restore(self, state: "EngineState") -> None:
        """Put the engine back to a :meth:`snapshot` of this engine or of one made with the same model and
        settings (a saved session). All or nothing: if llama.cpp refuses the cells, the ones held before
        are loaded back and UsageError is raised."""
        self._check_usable()
        n_cl, hkv = len(self.layers), self.model.n_head_kv
        if state.record.true.shape[:2] != (n_cl, hkv) or state.stats.get("n_ctx") != self.ctx.n_ctx:
            raise UsageError("this state was made with another model or budget: it does not fit this engine")
        with interrupts_deferred():
            try:
                self.kv.load(state.blob)
            except RuntimeError:
                self.cells.note_live()
                raise UsageError("llama.cpp refused the saved cells (another runtime build or cache type?); "
                                 "the session is as it was") from None
            self.n_past, self.last_token = state.n_past, state.last_token
            self.logits = None if state.logits is None else state.logits.copy()
            self.kv.record = state.record.copy()
            if self.tier is not None:  # the undone turn's rows are forgotten, the rows back on the device flagged
                self.tier.truncate(state.tier_mark if state.tier_mark is not None else self.tier.mark_of() * 0)
                self.tier.sync(self.compressor.read().true)
            self.compressor.settled = state.settled
            self.observations.forget()
            self._probe = None if state.probe is None else list(state.probe)
            self._reply = list(state.reply)
            self.reselection.answering = False  # a restored answer goes on without re-selecting
            self._marks.clear()  # they describe the cells replaced
            fixed = {k: getattr(self.stats, k) for k in ("n_ctx", "kv_bytes_allocated", "kv_bytes_swa",
                                                         "kv_bytes_measured", "kv_bytes_full", "budget_cells")}
            self.stats.load(EngineStats(**{**state.stats, **fixed}))
            self.cells.note_live()

    def pin(self, n: int) -> None:
        """Never evict the first ``n`` tokens of the session (a system prompt, tool definitions): they are
        protected like attention sinks by every method, count in the budget and stay first when positions
        move back. UsageError, naming the fix, when they and the recent span do not fit the budget."""
        if self.cfg.method != "full" and n + self.cfg.recent > self.head_budget:
            raise UsageError(f"the system prompt takes {n:,} tokens, which are never evicted; with the {self.cfg.recent} "
                             f"most recent ones they do not fit the budget's {self.head_budget:,} cells per head: raise --budget "
                             f"or shorten the system prompt")
        self.stats.kv_cells_pinned = n

    @property
    def slack(self) -> int:
        """Cells past the budget that chunks and decoding may fill before the next compression."""
        return self.ctx.n_ctx - self.slot_cells - self.cfg.recent

    def live_cells(self) -> int:
        return self.cells.live()

    def kv_figures(self) -> dict:
        """The cache's memory under the names every front door prints (the chat's status line and ``/stats``,
        ``kvlocal run --json``, the server's ``kv`` object): ``tokens_seen``, ``tokens_kept`` (cells holding
        tokens now), ``budget_cells``, ``ctx_size`` (the context the comparison is for: -c, or the model's
        trained one), ``kv_bytes`` (what this cache allocated), ``kv_bytes_full`` (what llama.cpp's own cache,
        of the same types and without compression, allocates for ``ctx_size`` — or for every token seen, once
        they are more), and the recall tier's memory: ``host_tier_bytes``, its cap and what happens past it
        (:func:`~kvlocal.recall.tier_figures`)."""
        s = self.stats
        ctx = self.cfg.max_tokens
        full = s.kv_bytes_full if s.tokens_seen <= ctx else sum(
            kv_cache_bytes(self.model, pad_cells(s.tokens_seen), bias=False, bytes_per_elem=self.bytes_per_value))
        return dict(tokens_seen=s.tokens_seen, tokens_kept=s.kv_cells_live, budget_cells=self.budget_cells, ctx_size=ctx,
                    kv_bytes=s.kv_bytes_allocated, kv_bytes_full=full, **tier_figures(self.tier))

    def close(self) -> None:
        """Free llama.cpp's context and give the recall tier's RAM back (to the conversations sharing its cap)."""
        self.ctx.close()
        if self.tier is not None:
            self.tier.close()

    def decode_probe(self) -> list[int]:
        """The probe of a decode-time event: the last half-window of the prompt's probe followed by the
        last half-window of the reply so far (the whole window for whichever is short)."""
        probe = self._probe or self._probe_tokens(None)
        w = self.cfg.recent
        reply = self._reply[-(w // 2):] if w > 1 else []
        return (probe[-(w - len(reply)):] + reply)[-w:]

    def _probe_tokens(self, probe: Sequence[int] | None) -> list[int]:
        probe = list(probe) if probe else self.model.tokenize(AGNOSTIC_PROBE, add_special=False)
        return probe[-self.cfg.recent:]

    def _free_cells(self) -> int:
        """Cells a chunk or generated tokens may still fill before a compression event (the probe's kept free)."""
        return self.ctx.n_ctx - self.live_cells() - self._reserve()

    def _reserve(self) -> int:
        """Cells to keep free for a probe's decode: the probe cap (``recent``), whatever this probe's
        length, so that a later, longer probe (the next chat turn) always fits; none for ``full``."""
        return 0 if self.cfg.method == "full" else self.cfg.recent

    # -- internals ------------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        self.cells.check_usable()

    def _check_cap(self, n: int) -> None:
        cap = self.cfg.max_tokens
        if cap is not None and not self.endless and self.n_past + n > cap:
            raise CacheFull(f"{self.n_past + n} tokens exceed the cap of {cap} this session was sized for: raise "
                            f"{{ctx_size}}", "ctx_size")
        if self.cfg.method == "full" and self.n_past + n > self.ctx.n_ctx:
            raise CacheFull(f"the full cache of {self.ctx.n_ctx} cells is full: use {{budget}} with a compression "
                            f"method", "budget")

    def _fit_positions(self, n: int) -> bool:
        """Endless sessions: if the next n positions would pass the trained context, reposition first."""
        if self.endless and self.n_past + n > self.position_limit:
            before_reposition(self)  # an open turn keeps the cells and the tier this renumbers
            self.positions.move(n)
            return True
        return False

    def _reading_cells(self, n: int) -> int:
        """The cells of a reading context for a turn of ``n`` tokens (:mod:`kvlocal.engine.reading`): the cells held
        and the turn's, up to ``read_cells`` (None: no cap); 0 where it would be no larger than the budget's context
        (a turn that fits the free cells, ``read_cells`` 0, the full cache) or where an endless session's positions
        would pass the trained context while it is read."""
        if self.read_cells == 0 or self.cfg.method == "full" or n <= self._free_cells():
            return 0
        if self.endless and self.n_past + n + self._reserve() > self.position_limit:
            return 0  # its positions move back while it is read: chunk by chunk, as the moves need
        # (a reading context could move them too, once per window of the limit: not built)
        need = self.live_cells() + n + self._reserve()
        cells = need if self.read_cells is None else min(need, self.read_cells)
        return cells if cells > self.ctx.n_ctx else 0

    def _low_water(self, remaining: int) -> int | None:
        """A head's rows after an event inside a prompt with ``remaining`` tokens to read (None: its budget): no
        fewer than let the rest in one chunk, nor than the rows every head protects (pinned/sinks, recent span)."""
        if self.cfg.low_water >= 1:
            return None
        cells = self.ctx.n_ctx - self._reserve() - remaining  # the most the cells may hold for the rest to fit
        cells = min(self.slot_cells, max(cells, math.ceil(self.cfg.low_water * self.slot_cells)))
        floor = max(self.cfg.n_sink, self.stats.kv_cells_pinned) + self.cfg.recent
        return min(self.head_budget, max(floor, self.scorer.budget_for_cells(cells)))

    def _compress(self, probe: Sequence[int], observed=None, decoding: bool = False,
                  head_budget: int | None = None) -> None:
        """One compression event (:meth:`Compressor.compress <kvlocal.engine.compressor.Compressor.compress>`), a
        decode-time one observed with the reply so far."""
        self.compressor.compress(probe, observed, decoding, head_budget, self._reply)
