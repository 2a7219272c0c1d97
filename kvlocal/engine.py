"""Bounded-memory generation: chunked prefill and decoding inside a fixed llama.cpp KV budget.

The llama.cpp context is created with ``n_ctx = budget + chunk + probe`` cells, not the prompt
length, so KV memory is O(budget). A long prompt is decoded in chunks; after each chunk, and during
decoding whenever the live cells pass ``budget + slack``, one *compression event* runs:

    observe  decode the probe (the question, or a generic prompt) with query capture, then remove it
    read     K/V rows and positions of every cell (state backend) / the cells' positions (native)
    score    per layer and KV head (kvlocal.compress scorers, numpy + C kernels; on the native backend
             fed by the device's window attention and value norms, llama_kv_score)
    plan     per layer and KV head, which source rows fill which cell (kvlocal.compress.Plan)
    apply    write the compacted cells back (state) / move the kept rows on the device (llama_kv_compact)

Two KV backends (``backend=``, the CLI's ``--backend``): ``native`` keeps K/V on the device that holds
them — the patched llama.cpp scores the cells and moves the kept rows by ggml graphs, and only
queries, scores, positions and indices cross to the host; ``state`` reads the sequence state to the
host, scores it there and loads it back (any llama.cpp build; every method, merging included; the
oracle the native backend is tested against). ``auto`` picks native where it can run
(:data:`kvlocal.compress.BACKENDS`, an unquantized cache, the patched runtime).

Different KV heads may keep different tokens in the same cell: attention is computed per head, so a
cell is just a slot. A cell has one position (for the causal mask and for "the next token goes at
max position + 1"); the engine keeps each row's true source position itself (``_true_pos``) and
uses it for scoring, pooling and recency.

Models with interleaved sliding-window attention (Gemma 3) keep two caches in llama.cpp: the
sliding layers' cache is bounded by the window already, and llama.cpp keeps it; kvlocal compresses
the full-attention layers' cache (``model.arch.full_layers``) to the budget. Memory figures count both.

Scoring uses the model's own attention scale (``arch.attn_scale``: Gemma's query scaling, a file's
``attention.scale``), with head sizes from ``key_length``/``value_length``.

The observation window (docs/engine.md, "What scores the cache"):

- prefill and a chat turn: the probe is the last ``window`` tokens of the text being added (its end:
  the question and, in a chat, the template's assistant header), or ``probe=`` given explicitly;
- decode-time events: the last half-window of that probe followed by the last half-window of the
  reply generated so far, so a long reply is scored by what it is saying now as well as by the
  question, and does not lose its own beginning to a question that never looks at it.

Ctrl-C (KeyboardInterrupt) at any point leaves the engine as it was before the interrupted chunk or
token: cells past the last completed position are removed, and a compression event either completes
or leaves the previous cells (``write_seq`` is all or nothing).

An Engine is not thread-safe: use one per thread (or guard it with a lock). Several engines may
share nothing but the read-only W_O cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from .compress import BACKENDS, BIAS_METHODS, LayerInputs, Plan, make_scorer, observation_window, plan_layers
from .errors import UsageError
from .runtime import Context, Model
from .runtime.capture import QueryCapture
from .runtime.kvquant import CacheBasis, bytes_per_value
from .runtime.library import has_attention_bias, has_native_compression, runtime_info
from .runtime.llama import N_UBATCH, kv_cache_bytes
from .runtime.weights import output_projections
from .runtime.state import CacheLost, SeqKV, clear_seq, get_blob, read_seq, set_blob, write_seq
from .sampling import Sampler

# A generic observation window for when the question is not known yet (a document read before the
# chat starts). Query-agnostic, in the spirit of KVzip's reconstruction prompt: queries that ask for
# the text back attend to what a later question is likely to need. Measured against the
# question-aware probe in docs/engine.md.
AGNOSTIC_PROBE = "\n\nRepeat the text above, with every name, number and key fact in it."


@dataclass(frozen=True)
class Budget:
    """``--budget``: a ratio in (0, 1] of the tokens seen, or an absolute number of cells (> 1)."""

    ratio: float | None = None
    cells: int | None = None

    @classmethod
    def parse(cls, text: str | float | int) -> "Budget":
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise UsageError(f"--budget {text!r} is not a number: give a ratio in (0, 1] like 0.1 or a cell count like 2048") from None
        if not math.isfinite(value) or value <= 0:
            raise UsageError(f"--budget {text} must be > 0: a ratio in (0, 1] like 0.1 or a cell count like 2048")
        if value <= 1:
            return cls(ratio=value)
        if value != int(value):
            raise UsageError(f"--budget {text}: a ratio must be in (0, 1]; a cell count must be a whole number")
        return cls(cells=int(value))

    def cells_for(self, n_tokens: int, floor: int) -> int:
        """Cells for n_tokens seen. An absolute budget below the floor (sinks + window) is an error;
        a ratio is raised to the floor."""
        if self.cells is not None:
            if self.cells < floor:
                raise UsageError(f"--budget {self.cells} is below the floor of {floor} cells (sinks + window): give at least {floor}")
            return self.cells
        return max(floor, math.ceil(self.ratio * n_tokens))

    def __str__(self) -> str:
        return f"{self.ratio:g}" if self.ratio is not None else str(self.cells)


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    n_ctx: int = 0
    kv_bytes_allocated: int = 0  # K/V bytes of this context, both caches: measured from llama.cpp's buffers
    kv_bytes_swa: int = 0  # of which the sliding-window cache (iSWA models; llama.cpp bounds it itself)
    kv_bytes_measured: bool = False  # False on a stock runtime: kv_bytes_allocated is then the formula
    kv_bytes_full: int = 0  # what llama.cpp's full cache for max_tokens would allocate (formula, both caches)
    wo_cache_bytes: int = 0  # kvlocal's own memory: dequantized W_O kept for CriticalKV (bounded)
    host_bytes_peak: int = 0  # kvlocal's own memory: the largest host copy of the cache one event made
    host_kv_bytes: int = 0  # K/V bytes compression events copied between llama.cpp and the host (0 on native)
    backend: str = ""  # the KV backend compression runs on: "native" or "state"
    budget_cells: int = 0
    kv_cells_live: int = 0
    kv_cells_live_peak: int = 0
    compression_events: int = 0
    compression_seconds: float = 0.0  # part of prefill/decode seconds: scoring, KV read/write, and the probe's decode
    compression_breakdown: dict = field(default_factory=dict)  # seconds by step: observe, read, score, apply
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    repositions: int = 0  # times an endless session moved its positions back into the trained range
    end_tokens: int = 0  # end-of-generation tokens decoded into the cache (not yielded, not in generated_tokens)

    @property
    def tokens_seen(self) -> int:
        """Every token the cache has been fed."""
        return self.prompt_tokens + self.generated_tokens + self.end_tokens

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineConfig:
    budget: Budget = field(default_factory=lambda: Budget(ratio=0.1))
    method: str = "criticalkv"
    chunk: int = 128  # least prefill chunk: n_ctx = budget + chunk + window (then padded by llama.cpp)
    window: int = 32  # most recent tokens always kept; also the probe length cap
    n_sink: int = 4  # first tokens always kept (attention sinks)
    max_tokens: int | None = None  # tokens a session may see in all (hard cap; sizes a ratio budget)

    def validate(self) -> None:
        """Raise UsageError naming the fix for values the engine cannot work with."""
        for name, lo in (("chunk", 1), ("window", 1), ("n_sink", 0), ("max_tokens", 1)):
            val = getattr(self, name)
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < lo:
                raise UsageError(f"{name} must be a whole number >= {lo}, got {val!r}")
        if self.window > N_UBATCH // 2:
            raise UsageError(f"window {self.window} is too large: at most {N_UBATCH // 2} (the probe is decoded with a chunk in one batch)")


class Engine:
    """A llama.cpp context whose KV cache stays within a budget.

    ``Engine(model, budget=0.1, method="criticalkv")``, then ``prefill(tokens, probe=...)`` and
    ``generate(n)`` (an iterator of token ids); ``append`` adds a later turn; ``stats`` tells memory,
    speed and compression figures.
    """

    def __init__(
        self,
        model: Model | str | Path,
        budget: Budget | float | int | str = 0.1,
        method: str = "criticalkv",
        *,
        max_tokens: int,
        chunk: int = 128,
        window: int = 32,
        n_sink: int = 4,
        n_gpu_layers: int = 0,
        flash_attn: bool = False,
        n_threads: int | None = None,
        type_k: int | None = None,
        type_v: int | None = None,
        endless: bool = False,
        backend: str = "auto",
    ):
        budget = budget if isinstance(budget, Budget) else Budget.parse(budget)
        self.cfg = EngineConfig(budget, method, chunk, window, n_sink, max_tokens)
        self.cfg.validate()
        self.scorer = make_scorer(method)
        resolve_backend(backend, method, type_k, type_v)  # a refusal before the model loads
        if method in BIAS_METHODS and not has_attention_bias():
            raise UsageError(f"--method {method} needs kvlocal's patched llama.cpp (a per-head attention bias, "
                             f"patch 0006); this runtime is stock: run `python ggml_patches/build.py`")
        self.model = model if isinstance(model, Model) else Model(model, n_gpu_layers=n_gpu_layers)
        m = self.model
        self.backend = resolve_backend(backend, method, type_k, type_v, offloaded=m.n_gpu_layers != 0)
        self.layers = m.arch.full_layers  # the model layers whose cache is compressed (all but sliding ones)
        self.head_dim = m.arch.head_dim_k
        # how the cache stores rows: a quantized one as raw blocks, K (and V) Walsh–Hadamard-rotated
        self.basis = None if method == "full" else CacheBasis.for_cache(type_k, type_v, m.arch.head_dim_k, m.arch.head_dim_v)
        self.bytes_per_value = (bytes_per_value(type_k) + bytes_per_value(type_v)) / 2  # of K and V, for the formulas
        # the scorers compute q·k/√d; the model's logits are q·k·attn_scale: scale the queries once
        self._q_scale = np.float32(m.arch.attn_scale * math.sqrt(self.head_dim))
        floor = n_sink + window
        # a budget above what the session may see is just the full cache
        self.budget_cells = max_tokens if method == "full" else min(budget.cells_for(max_tokens, floor), max_tokens)
        # the cells a compression may leave: the budget, or more where heads share it unevenly (AdaKV:
        # a layer's cells hold its widest head, the others' surplus slots are masked out by a -inf bias)
        self.slot_cells = min(self.scorer.max_slots(self.budget_cells), max_tokens)
        self._settled = self.budget_cells  # cells right after the latest compression (the budget before any)
        # llama.cpp pads n_ctx (to 256 cells here); prefill chunks then fill whatever is free, so the
        # effective chunk is n_ctx - budget - probe >= chunk
        headroom = 0 if method == "full" else chunk + window
        self.capture = QueryCapture.for_model(m)
        n_ctx = self.slot_cells + headroom
        if m.arch.has_swa:  # the sliding cache shares n_ctx: it must hold the window and a chunk with its probe
            n_ctx = max(n_ctx, m.arch.n_swa + chunk + window)
        self.ctx = Context(m, n_ctx=n_ctx, n_batch=min(n_ctx, 2048), n_threads=n_threads,
                           type_k=type_k, type_v=type_v, cb_eval=self.capture.callback,
                           # llama.cpp stores a quantized V cache only with flash attention
                           flash_attn=flash_attn or type_v not in (None, 1))
        measured = self.ctx.kv_bytes()
        allocated = measured or kv_cache_bytes(m, self.ctx.n_ctx, self.ctx.n_ubatch)
        self.stats = EngineStats(n_ctx=self.ctx.n_ctx, budget_cells=self.budget_cells, backend=self.backend,
                                 kv_bytes_allocated=sum(allocated), kv_bytes_swa=allocated[1],
                                 kv_bytes_measured=measured is not None,
                                 # stock llama.cpp allocates a full cache (of the same types) for every token
                                 # the session may see
                                 kv_bytes_full=sum(kv_cache_bytes(m, pad_cells(max_tokens), bias=False,
                                                                  bytes_per_elem=self.bytes_per_value)))
        self._broken: str | None = None  # set when a failed rewrite lost the cache: nothing more may run
        self.n_past = 0  # next position
        self.logits: np.ndarray | None = None
        self.last_token = -1
        # true source positions of the rows of cells written by the last compression:
        # cell position (unique) -> [n_layer, Hkv] positions; cells added since hold one token each
        n_cl = len(self.layers)
        self._slot_pos = np.zeros(0, dtype=np.int64)
        self._slot_true = np.zeros((n_cl, m.n_head_kv, 0), dtype=np.int64)
        self._slot_vnorm = np.zeros((n_cl, m.n_head_kv, 0), dtype=np.float32)
        self._slot_count = np.zeros((n_cl, m.n_head_kv, 0), dtype=np.int64)  # source tokens per row (0: empty)
        self.last_plan: Plan | None = None  # the latest compression event's plan (its layers: self.layers)
        self.prompt_plan: Plan | None = None  # the plan in effect when the prompt ended (--dump-plan)
        self.last_probe: list[int] = []  # the tokens whose queries scored the latest event
        self._probe: list[int] | None = None  # the probe of the last prefill/append
        self._reply: list[int] = []  # tokens generated since the last prefill/append
        self._wo = output_projections(str(m.path)) if self.scorer.needs_wo else None
        # endless (a chat): past max_tokens the session goes on inside the same budget, and its positions
        # are moved back under the trained context whenever they would pass it (:meth:`_reposition`)
        self.endless = endless
        self.position_limit = m.n_ctx_train  # positions an endless session stays under
        self._recent_span = max(window, m.arch.n_swa if m.arch.has_swa else 0)
        if endless:
            if method == "full":
                raise UsageError("an endless session needs a compression method: --method full keeps every token")
            if self.ctx.n_ctx + self._recent_span + self.ctx.n_batch > m.n_ctx_train:
                raise UsageError(f"the budget's {self.ctx.n_ctx:,} cells leave no room under the {m.n_ctx_train:,} positions "
                                 f"{Path(m.path).name} was trained on: lower --budget")

    # -- public API ---------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], probe: Sequence[int] | None = None,
                progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Decode a prompt in chunks that fill the free cells, compressing back to the budget whenever the
        context is full and once more at the end. ``probe``: tokens whose queries score the cache (the
        question; its last ``window`` tokens are used); None uses the generic query-agnostic probe.
        ``progress(done, total)`` is called after every chunk. Returns the last logits."""
        self._check_usable()
        if len(tokens) == 0:
            raise UsageError("the prompt is empty: give at least one token of text")
        t0 = time.perf_counter()
        self._check_cap(len(tokens))
        probe = self._probe_tokens(probe)
        self._probe, self._reply = probe, []
        observed = None  # the probe's queries over the cache as it is now
        i = 0
        while i < len(tokens):
            room = self.ctx.n_ctx - self.live_cells() - self._reserve()
            if room < 1:
                self._compress(probe, observed)
                continue
            self._fit_positions(room + len(probe))
            chunk = list(tokens[i:i + room])
            observed = self._decode_chunk(chunk, probe)
            i += len(chunk)
            if progress is not None:
                progress(i, len(tokens))
        if self.live_cells() > self._settled:
            self._compress(probe, observed)
        self.stats.prompt_tokens += len(tokens)
        if self.prompt_plan is None:
            self.prompt_plan = self.last_plan
        self.stats.prefill_seconds += time.perf_counter() - t0
        return self.logits

    def append(self, tokens: Sequence[int], probe: Sequence[int] | None = None,
               progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Add a later turn to the compressed cache (the history is never decoded again)."""
        return self.prefill(tokens, probe, progress)

    def generate(self, max_new: int, sampler: Sampler | None = None, stop_at_eog: bool = True) -> Iterator[int]:
        """Yield up to max_new tokens; the end-of-generation token is kept in the cache, not yielded.

        New tokens fill the cells the prefill chunks used (``slack`` = n_ctx - budget - probe cells);
        when those are full the cache is compressed back to the budget, scored by :meth:`decode_probe`."""
        self._check_usable()
        if self.logits is None:
            raise UsageError("nothing to continue: prefill a prompt before generating")
        sampler = sampler or Sampler()
        for _ in range(max_new):
            tok = sampler(self.logits)
            t0 = time.perf_counter()
            self._check_cap(1)
            self._fit_positions(1 + self.cfg.window)
            if self.live_cells() + 1 > self.ctx.n_ctx - self._reserve():
                self._compress(self.decode_probe())
            with self._rollback():
                self.logits = self._decode([tok], [self.n_past], "last")
                self.n_past += 1
            self.last_token = tok
            self._reply.append(tok)
            self._note_live()
            self.stats.decode_seconds += time.perf_counter() - t0
            if stop_at_eog and self.model.is_eog(tok):
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
            blob=get_blob(self.ctx), n_past=self.n_past, last_token=self.last_token,
            logits=None if self.logits is None else self.logits.copy(),
            slot_pos=self._slot_pos.copy(), slot_true=self._slot_true.copy(), slot_vnorm=self._slot_vnorm.copy(),
            slot_count=self._slot_count.copy(), settled=self._settled,
            probe=None if self._probe is None else list(self._probe), reply=list(self._reply),
            stats=self.stats.as_dict())

    def restore(self, state: "EngineState") -> None:
        """Put the engine back to a :meth:`snapshot` of this engine or of one made with the same model and
        settings (a saved session). All or nothing: if llama.cpp refuses the cells, the ones held before
        are loaded back and UsageError is raised."""
        self._check_usable()
        n_cl, hkv = len(self.layers), self.model.n_head_kv
        if state.slot_true.shape[:2] != (n_cl, hkv) or state.stats.get("n_ctx") != self.ctx.n_ctx:
            raise UsageError("this state was made with another model or budget: it does not fit this engine")
        previous = get_blob(self.ctx)
        with interrupts_deferred():
            clear_seq(self.ctx)
            try:
                set_blob(self.ctx, state.blob)
            except RuntimeError:
                clear_seq(self.ctx)
                set_blob(self.ctx, previous)
                self._note_live()
                raise UsageError("llama.cpp refused the saved cells (another runtime build or cache type?); "
                                 "the session is as it was") from None
            self.n_past, self.last_token = state.n_past, state.last_token
            self.logits = None if state.logits is None else state.logits.copy()
            self._slot_pos, self._slot_true = state.slot_pos.copy(), state.slot_true.copy()
            self._slot_vnorm, self._slot_count = state.slot_vnorm.copy(), state.slot_count.copy()
            self._settled = state.settled
            self._probe = None if state.probe is None else list(state.probe)
            self._reply = list(state.reply)
            fixed = {k: getattr(self.stats, k) for k in ("n_ctx", "kv_bytes_allocated", "kv_bytes_swa",
                                                         "kv_bytes_measured", "kv_bytes_full", "budget_cells")}
            self.stats = EngineStats(**{**state.stats, **fixed})
            self._note_live()

    def decode_probe(self) -> list[int]:
        """The probe of a decode-time event: the last half-window of the prompt's probe followed by the
        last half-window of the reply so far (the whole window for whichever is short)."""
        probe = self._probe or self._probe_tokens(None)
        w = self.cfg.window
        reply = self._reply[-(w // 2):] if w > 1 else []
        return (probe[-(w - len(reply)):] + reply)[-w:]

    @property
    def slack(self) -> int:
        """Cells past the budget that chunks and decoding may fill before the next compression."""
        return self.ctx.n_ctx - self.slot_cells - self.cfg.window

    def live_cells(self) -> int:
        return self.stats.kv_cells_live

    def _probe_tokens(self, probe: Sequence[int] | None) -> list[int]:
        probe = list(probe) if probe else self.model.tokenize(AGNOSTIC_PROBE, add_special=False)
        return probe[-self.cfg.window:]

    def _reserve(self) -> int:
        """Cells to keep free for a probe's decode: the probe cap (``window``), whatever this probe's
        length, so that a later, longer probe (the next chat turn) always fits; none for ``full``."""
        return 0 if self.cfg.method == "full" else self.cfg.window

    # -- internals ------------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken:
            raise RuntimeError(f"this engine lost its cache ({self._broken}): start a new one")

    def _check_cap(self, n: int) -> None:
        cap = self.cfg.max_tokens
        if cap is not None and not self.endless and self.n_past + n > cap:
            raise UsageError(f"{self.n_past + n} tokens exceed the cap of {cap} this session was sized for: raise -c/--ctx-size")
        if self.cfg.method == "full" and self.n_past + n > self.ctx.n_ctx:
            raise UsageError(f"the full cache of {self.ctx.n_ctx} cells is full: use --budget with a compression method")

    def _fit_positions(self, n: int) -> bool:
        """Endless sessions: if the next n positions would pass the trained context, reposition first."""
        if self.endless and self.n_past + n > self.position_limit:
            self._reposition()
            return True
        return False

    def _reposition(self) -> None:
        """Move the cache's positions back into the trained range, as StreamingLLM does ("positions within
        the cache"): the cells older than the recent span (``window``; a sliding-window model's window)
        take consecutive positions 0, 1, ... in their order, and the recent span follows them shifted as one
        block, so recent tokens keep their exact distances and old ones keep their order. llama.cpp
        re-rotates the keys (K-shift) at the next decode. The rows' recorded positions (the scorers' order
        and recency) become their cell's new position in the old part and shift with the block in the
        recent one — kept strictly increasing per head, which the plans require."""
        ctx = self.ctx
        cells = np.unique(ctx.cells()[1] if has_attention_bias() else read_seq(ctx).pos).astype(np.int64)
        recent = self.n_past - self._recent_span
        old = cells[cells < recent]

        def moved(p: np.ndarray) -> np.ndarray:
            return np.where(p < recent, np.searchsorted(old, p), p - recent + len(old))

        with interrupts_deferred():
            if self.model.arch.has_swa:  # sliding-window cells between full-cache cells (outside the window)
                prev = -1
                for p in [*old.tolist(), recent]:
                    if p > prev + 1:
                        ctx.remove(prev + 1, p)
                    prev = p
            for i, p in enumerate(old.tolist()):
                if p != i:
                    ctx.shift(p, p + 1, i - p)
            if recent != len(old):
                ctx.shift(recent, -1, len(old) - recent)
            cell_new = moved(self._slot_pos)
            t = self._slot_true
            label = np.where(t >= recent, t - recent + len(old), cell_new)
            idx = np.arange(t.shape[-1])
            label = np.maximum.accumulate(np.where(t >= 0, label - idx, np.iinfo(np.int64).min // 2), axis=-1) + idx
            self._slot_true = np.where(t >= 0, label, -1)
            self._slot_pos = cell_new
            self.n_past = int(moved(np.array([self.n_past]))[0])
            self.stats.repositions += 1

    @contextlib.contextmanager
    def _rollback(self):
        """Run a decode; if it fails or is interrupted (Ctrl-C), remove every cell past ``n_past`` so the
        cache is what it was before, and re-raise."""
        try:
            yield
        except BaseException:
            self.capture.disarm()
            self.ctx.remove(self.n_past, -1)
            self._note_live()
            raise

    def _decode(self, tokens, positions, logits) -> np.ndarray:
        """``ctx.decode`` under Ctrl-C control: a SIGINT while llama.cpp computes (and calls our eval
        callback, where a KeyboardInterrupt would be swallowed by ctypes) stops the graph at its next
        node and is raised when llama.cpp returns (inside :meth:`_rollback`, which drops the cells)."""
        try:
            with interrupts_deferred(self.capture.request_stop):
                return self.ctx.decode(tokens, positions, logits)
        finally:
            self.capture.clear_stop()

    def _note_live(self) -> None:
        self.stats.kv_cells_live = int(llama_live(self.ctx))
        self.stats.kv_cells_live_peak = max(self.stats.kv_cells_live_peak, self.stats.kv_cells_live)

    def _decode_chunk(self, chunk: list[int], probe: list[int]):
        """Decode a prompt chunk; when compression may follow, decode the probe in the same call as the
        chunk's tail (one graph, better matmul shapes than a separate small batch, and one ubatch, so
        that a sliding-window cache only reuses cells relative to a real token), capture its queries,
        and remove it. Returns the observation (queries, positions) or None."""
        p0 = self.n_past
        with_probe = self.cfg.method != "full" and self.live_cells() + len(chunk) > self._settled
        with self._rollback():
            if not with_probe:
                self.logits = self._decode(chunk, range(p0, p0 + len(chunk)), "last")
                self.n_past += len(chunk)
                self._note_live()
                return None
            head = max(0, len(chunk) + len(probe) - min(self.ctx.n_batch, self.ctx.n_ubatch))
            if head:
                self._decode(chunk[:head], range(p0, p0 + head), "none")
            t0 = time.perf_counter()
            seq = chunk[head:] + probe
            self.capture.arm(len(probe))
            try:
                self.logits = self._decode(seq, range(p0 + head, p0 + len(chunk) + len(probe)), len(seq) - len(probe) - 1)
            finally:
                self.capture.disarm()
            self.n_past += len(chunk)
            self.ctx.remove(self.n_past, -1)
            queries = self.capture.take()
        self._note_live()
        self.last_probe = list(probe)
        # the probe's share of this decode counts as compression time (estimated by token share)
        dt = (time.perf_counter() - t0) * len(probe) / len(seq)
        self.stats.compression_seconds += dt
        self.stats.compression_breakdown["observe"] = self.stats.compression_breakdown.get("observe", 0.0) + dt
        return queries, np.arange(self.n_past, self.n_past + len(probe))

    def _observe(self, probe: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """Decode the probe after the cache with query capture, then remove it. Returns per compressed
        layer post-RoPE queries [Hq, w, d] and their positions [w]."""
        p0 = self.n_past
        q_pos = np.arange(p0, p0 + len(probe))
        with self._rollback():
            self.capture.arm(len(probe))
            try:
                self._decode(list(probe), q_pos.tolist(), "none")
            finally:
                self.capture.disarm()
            self.ctx.remove(p0, -1)
            queries = self.capture.take()
        self.last_probe = list(probe)
        return queries, q_pos

    def _carry(self, cell_pos: np.ndarray, slot_values: np.ndarray, fresh: np.ndarray) -> np.ndarray:
        """Per-row values [n_layer, Hkv, n] of the cells read now: the value of the slot a cell was
        written to by the last compression (matched by its unique cell position), else ``fresh``."""
        out = np.array(fresh, copy=True)
        if len(self._slot_pos):
            j = np.minimum(np.searchsorted(self._slot_pos, cell_pos), len(self._slot_pos) - 1)
            hit = self._slot_pos[j] == cell_pos
            out[:, :, hit] = slot_values[:, :, j[hit]]
        return out

    def _true_positions(self, cell_pos: np.ndarray) -> np.ndarray:
        """[n_layer, Hkv, n] true source position of every row, from each cell's position."""
        shape = (len(self.layers), self.model.n_head_kv, len(cell_pos))
        return self._carry(cell_pos, self._slot_true, np.broadcast_to(cell_pos.astype(np.int64), shape))

    def _compress(self, probe: Sequence[int], observed=None) -> None:
        """One compression event back to the budget; ``observed``: the probe's queries if the last decode
        already captured them over the current cache, else the probe is decoded now."""
        clock = time.perf_counter
        t0 = clock()
        budget = self.budget_cells
        q, q_pos = observed if observed is not None else self._observe(probe)
        t1 = clock()
        if self.backend == "native":
            t2, t3 = self._compress_native(q, q_pos, clock)
            self._count_event(t0, t1, t2, t3, clock())
            return
        kv = read_seq(self.ctx)
        true = self._true_positions(kv.pos)  # -1 for the empty rows of a head
        # projected value norms depend only on a row and W_O: carry them over for rows that stay
        n_cl, hkv = len(self.layers), self.model.n_head_kv
        vnorm = self._carry(kv.pos, self._slot_vnorm, np.full((n_cl, hkv, kv.n), np.nan, np.float32))
        counts = self._carry(kv.pos, self._slot_count, np.ones((n_cl, hkv, kv.n), np.int64))
        t2 = clock()
        host = kv.blob.nbytes if kv.blob is not None else 0
        basis = self.basis

        def layer_inputs():
            for i, il in enumerate(self.layers):  # i: index in the compressed cache, il: the model's layer
                yield LayerInputs(
                    k=basis.keys(kv.k[i].transpose(1, 0, 2)),  # [Hkv, n, d] float32, in the stored basis
                    v=basis.values(kv.v[i].transpose(1, 0, 2)),  # as the model computed them
                    pos=true[i],  # [Hkv, n]
                    q=basis.queries(q[i] * self._q_scale),  # in the keys' basis
                    q_pos=q_pos,
                    wo=self._wo[il] if self._wo is not None else None,
                    layer=il,
                    n_sink=self.cfg.n_sink,
                    window=self.cfg.window,  # the probe is not cached: protect the most recent rows instead
                    bias=count_bias(counts[i]),  # log(count) of merged rows, -inf for empty ones
                    vnorm=vnorm[i],  # CriticalKV fills in the ones it computes
                )

        plan = plan_layers(self.scorer, layer_inputs(), budget)
        host += 2 * kv.n * hkv * self.head_dim * 4  # one layer's K and V in float32 at a time
        self.last_plan = plan
        t3 = clock()
        written = self._apply(kv, plan, vnorm, counts)
        host = max(host, (kv.blob.nbytes if kv.blob is not None else 0) + written)
        self.stats.host_bytes_peak = max(self.stats.host_bytes_peak, host)
        self.stats.host_kv_bytes += (kv.blob.nbytes if kv.blob is not None else 0) + written
        self._count_event(t0, t1, t2, t3, clock())

    def _count_event(self, t0: float, t1: float, t2: float, t3: float, t4: float) -> None:
        self.stats.wo_cache_bytes = self._wo.nbytes if self._wo is not None else 0
        self.stats.compression_events += 1
        self.stats.compression_seconds += t4 - t0
        for name, dt in (("observe", t1 - t0), ("read", t2 - t1), ("score", t3 - t2), ("apply", t4 - t3)):
            self.stats.compression_breakdown[name] = self.stats.compression_breakdown.get(name, 0.0) + dt

    def _compress_native(self, q: list[np.ndarray], q_pos: np.ndarray, clock) -> tuple[float, float]:
        """The score and apply steps on the native backend: the device computes each query head's window
        attention over the cells and the value norms of the rows not scored before (``Context.score``),
        the scorers choose from those, and the device moves the kept rows (``Context.compact``). Only
        queries, positions, biases, scores and indices cross to the host. Returns the clock after reading
        the cells' positions and after planning."""
        ctx, n_cl, hkv = self.ctx, len(self.layers), self.model.n_head_kv
        _, cell_pos = ctx.cells()
        cell_pos = cell_pos.astype(np.int64)
        true = self._true_positions(cell_pos)
        vnorm = self._carry(cell_pos, self._slot_vnorm, np.full((n_cl, hkv, len(cell_pos)), np.nan, np.float32))
        counts = self._carry(cell_pos, self._slot_count, np.ones((n_cl, hkv, len(cell_pos)), np.int64))
        t2 = clock()
        w = observation_window(self.scorer) or 1
        qs = np.stack([qi[:, -w:] for qi in q]) * self._q_scale  # [n_layer, Hq, w, d]
        bias = count_bias(counts)
        need = np.flatnonzero(np.isnan(vnorm).any(axis=(0, 1))) if self._wo is not None else None
        votes, norms = ctx.score(qs, 1 / math.sqrt(self.head_dim), bias, need)
        if norms is not None:
            vnorm[:, :, need] = np.where(np.isnan(vnorm[:, :, need]), norms, vnorm[:, :, need])
        layers = (LayerInputs(k=None, v=None, pos=true[i], q=qs[i], q_pos=q_pos[-w:], layer=il, n_sink=self.cfg.n_sink,
                              window=self.cfg.window, bias=None if bias is None else bias[i], vnorm=vnorm[i],
                              votes=votes[i])
                  for i, il in enumerate(self.layers))
        plan = plan_layers(self.scorer, layers, self.budget_cells)
        self.last_plan = plan
        t3 = clock()
        slot_pos = plan.slot_positions()
        slot_counts = np.where(plan.keep >= 0, np.take_along_axis(counts, np.maximum(plan.keep, 0), axis=2), 0)
        kept = np.take_along_axis(vnorm, np.maximum(plan.keep, 0), axis=2)
        kept[plan.keep < 0] = np.nan
        with np.errstate(divide="ignore"):
            cell_bias = np.log(slot_counts.astype(np.float32)) if np.any(slot_counts != 1) else None
        with interrupts_deferred():
            try:
                ctx.compact(plan.keep, slot_pos, cell_bias)
            finally:
                self._note_live()
            self._slot_pos = slot_pos.astype(np.int64)
            self._slot_true = plan.positions
            self._slot_vnorm = kept
            self._slot_count = slot_counts
            self._settled = max(self.budget_cells, plan.n_slots)
        return t2, t3

    def _apply(self, kv: SeqKV, plan: Plan, vnorm: np.ndarray, counts: np.ndarray) -> int:
        """Write the plan's rows into the cells: kept rows as they are, merged ones combined
        (:meth:`Plan.materialize`), each with its bias (``log(count)``, ``-inf`` for an empty slot).
        Returns the bytes of the new rows it held on the host (float32, every layer)."""
        slot_pos = plan.slot_positions()
        k, v, slot_counts, bias = plan.materialize(kv.k, kv.v, counts, self.basis.k_codec, self.basis.v_codec)
        # cell-major rows for the state; no bias section at all while every slot holds one plain token
        cell_bias = [b.T for b in bias] if np.any(slot_counts != 1) else None
        # projected value norms stay valid for rows copied unchanged
        kept = np.take_along_axis(vnorm, np.maximum(plan.keep, 0), axis=2)
        kept[(plan.keep < 0) | plan.merged()] = np.nan
        # the cells and the engine's record of them change together: a Ctrl-C waits for both
        with interrupts_deferred():
            try:
                write_seq(self.ctx, dataclasses.replace(kv, pos=slot_pos.astype(np.int32), k=k, v=v, blob=None,
                                                        bias=cell_bias),
                          previous=kv.blob)
            except CacheLost as e:
                self._broken = str(e)
                raise
            finally:
                self._note_live()
            self._slot_pos = slot_pos.astype(np.int64)
            self._slot_true = plan.positions  # [n_layer, Hkv, B], -1 for empty slots
            self._slot_vnorm = kept
            self._slot_count = slot_counts
            self._settled = max(self.budget_cells, plan.n_slots)
        return sum(a.nbytes for a in k) + sum(a.nbytes for a in v)


@dataclass
class EngineState:
    """An :class:`Engine`'s :meth:`~Engine.snapshot`: ``blob`` is llama.cpp's sequence state (uint8),
    the arrays kvlocal's per-row record ([n_compressed_layer, n_head_kv, slots] for the slots the last
    compression wrote)."""

    blob: np.ndarray
    n_past: int
    last_token: int
    logits: np.ndarray | None
    slot_pos: np.ndarray
    slot_true: np.ndarray
    slot_vnorm: np.ndarray
    slot_count: np.ndarray
    settled: int
    probe: list[int] | None
    reply: list[int]
    stats: dict

    @property
    def nbytes(self) -> int:
        arrays = (self.blob, self.logits, self.slot_pos, self.slot_true, self.slot_vnorm, self.slot_count)
        return sum(a.nbytes for a in arrays if a is not None)


@contextlib.contextmanager
def interrupts_deferred(on_signal=None):
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block ends, then raise
    KeyboardInterrupt (in place of any error the block raised: the interrupted work is discarded).
    ``on_signal()`` runs when the signal arrives (e.g. to stop a computation early). Only the main
    thread receives signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []

    def handler(signum, frame):
        pending.append(signum)
        if on_signal is not None:
            on_signal()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    except BaseException:
        if not pending:
            raise
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt


def resolve_backend(backend: str, method: str, type_k: int | None = None, type_v: int | None = None,
                    offloaded: bool = True) -> str:
    """The KV backend an engine runs compression on: ``native`` or ``state``. UsageError, naming the fix, for
    ``native`` where it cannot run.

    ``auto`` picks native where it can run and the model is ``offloaded`` to a GPU (its cache then stays on
    the device instead of crossing PCIe twice per event), and state on the CPU, where the cache is in host
    memory either way and the host scorers measured faster (docs/engine.md, "Native backend")."""
    if backend not in ("auto", "native", "state"):
        raise UsageError(f"--backend {backend!r}: choose native, state or auto")
    if backend == "state":
        return "state"
    why = None
    if "native" not in BACKENDS.get(method, ()):
        why = f"--method {method} runs on the state backend only (merging and DefensiveKV are computed on the host)"
    elif any(t not in (None, 0, 1, 30) for t in (type_k, type_v)):  # f32, f16, bf16
        why = "a quantized KV cache runs on the state backend only (its rows would be re-quantized on the device)"
    elif not has_native_compression():
        why = "this llama.cpp has no on-device compression (patches 0010-0011): run `python ggml_patches/build.py`"
    if why is None:
        return "native" if backend == "native" or (offloaded and runtime_info().gpu_offload) else "state"
    if backend == "native":
        raise UsageError(f"--backend native: {why}; use --backend state")
    return "state"


def count_bias(counts: np.ndarray) -> np.ndarray | None:
    """The attention bias of rows standing for ``counts`` tokens: ``log(count)``, ``-inf`` for an empty
    row (0); None while every row is one plain token."""
    if np.all(counts == 1):
        return None
    with np.errstate(divide="ignore"):
        return np.log(counts.astype(np.float32))


def pad_cells(n: int) -> int:
    """The n_ctx llama.cpp really allocates for n cells: rounded up to a multiple of 256."""
    return -(-n // 256) * 256


def llama_live(ctx: Context) -> int:
    """Cells held by sequence 0 (the patched runtime's listing, or the state blob's header)."""
    try:
        return len(ctx.cells()[0])
    except UsageError:
        return len(read_seq(ctx).pos)
