"""Bounded-memory generation: chunked prefill and decoding inside a fixed llama.cpp KV budget.

The llama.cpp context is created with ``n_ctx = budget + chunk + probe`` cells, not the prompt
length, so KV memory is O(budget). A long prompt is decoded in chunks; after each chunk, and during
decoding whenever the live cells pass ``budget + slack``, one *compression event* runs:

    observe  decode the probe (the question, or a generic prompt) with query capture, then remove it
    read     K/V rows and positions of every cell (state backend)
    score    per layer and KV head (kvlocal.compress scorers, numpy + C kernels)
    plan     per layer and KV head, which source rows fill which cell (kvlocal.compress.Plan)
    apply    write the compacted cells back

Different KV heads may keep different tokens in the same cell: attention is computed per head, so a
cell is just a slot. A cell has one position (for the causal mask and for "the next token goes at
max position + 1"); the engine keeps each row's true source position itself (``_true_pos``) and
uses it for scoring, pooling and recency.

An Engine is not thread-safe: use one per thread (or guard it with a lock). Several engines may
share nothing but the read-only W_O cache.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .compress import LayerInputs, Plan, make_scorer
from .errors import UsageError
from .gguf_file import dequantize_tensor, read_gguf
from .runtime import Context, Model
from .runtime.capture import QueryCapture
from .runtime.llama import kv_cache_bytes
from .runtime.state import SeqKV, read_seq, write_seq
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
    kv_bytes_allocated: int = 0
    kv_bytes_full: int = 0  # what llama.cpp's full cache for max_tokens would allocate
    budget_cells: int = 0
    kv_cells_live: int = 0
    kv_cells_live_peak: int = 0
    compression_events: int = 0
    compression_seconds: float = 0.0  # part of prefill/decode seconds: scoring, KV read/write, and the probe's decode
    compression_breakdown: dict = field(default_factory=dict)  # seconds by step: observe, read, score, apply
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=4)
def output_projections(path: str) -> tuple[np.ndarray, ...]:
    """W_O of every layer as float32 [D, Hq*d] (HF layout), dequantized once per model file."""
    by_name = {t.name: t for t in read_gguf(path).tensors}
    out = []
    il = 0
    while f"blk.{il}.attn_output.weight" in by_name:
        out.append(dequantize_tensor(by_name[f"blk.{il}.attn_output.weight"], path))
        il += 1
    return tuple(out)


@dataclass
class EngineConfig:
    budget: Budget = field(default_factory=lambda: Budget(ratio=0.1))
    method: str = "criticalkv"
    chunk: int = 128  # least prefill chunk: n_ctx = budget + chunk + window (then padded by llama.cpp)
    window: int = 32  # most recent tokens always kept; also the probe length cap
    n_sink: int = 4  # first tokens always kept (attention sinks)
    max_tokens: int | None = None  # tokens a session may see in all (hard cap; sizes a ratio budget)


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
    ):
        self.model = model if isinstance(model, Model) else Model(model, n_gpu_layers=n_gpu_layers)
        budget = budget if isinstance(budget, Budget) else Budget.parse(budget)
        self.cfg = EngineConfig(budget, method, chunk, window, n_sink, max_tokens)
        if type_k not in (None, 1) and method != "full":  # 1 = GGML_TYPE_F16
            raise UsageError("compression with a quantized KV cache is not supported yet (K is stored Hadamard-rotated): use the default F16 cache or --method full")
        self.scorer = make_scorer(method)
        m = self.model
        self.head_dim = m.n_embd // m.n_head
        floor = n_sink + window
        # a budget above what the session may see is just the full cache
        self.budget_cells = max_tokens if method == "full" else min(budget.cells_for(max_tokens, floor), max_tokens)
        # llama.cpp pads n_ctx (to 256 cells here); prefill chunks then fill whatever is free, so the
        # effective chunk is n_ctx - budget - probe >= chunk
        headroom = 0 if method == "full" else chunk + window
        self.capture = QueryCapture(m.n_layer, m.n_head, self.head_dim)
        n_ctx = self.budget_cells + headroom
        self.ctx = Context(m, n_ctx=n_ctx, n_batch=min(n_ctx, 2048), flash_attn=flash_attn,
                           n_threads=n_threads, type_k=type_k, cb_eval=self.capture.callback)
        self.stats = EngineStats(n_ctx=self.ctx.n_ctx, budget_cells=self.budget_cells,
                                 kv_bytes_allocated=kv_cache_bytes(m, self.ctx.n_ctx),
                                 # llama.cpp allocates a full cache for every token the session may see
                                 kv_bytes_full=kv_cache_bytes(m, pad_cells(max_tokens)))
        self.n_past = 0  # next position
        self.logits: np.ndarray | None = None
        self.last_token = -1
        # true source positions of the rows of cells written by the last compression:
        # cell position (unique) -> [n_layer, Hkv] positions; cells added since hold one token each
        self._slot_pos = np.zeros(0, dtype=np.int64)
        self._slot_true = np.zeros((m.n_layer, m.n_head_kv, 0), dtype=np.int64)
        self._slot_vnorm = np.zeros((m.n_layer, m.n_head_kv, 0), dtype=np.float32)
        self.last_plan: Plan | None = None  # the latest compression event's plan
        self.prompt_plan: Plan | None = None  # the plan in effect when the prompt ended (--dump-plan)
        self._wo = output_projections(str(m.path)) if method == "criticalkv" else None

    # -- public API ---------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], probe: Sequence[int] | None = None) -> np.ndarray:
        """Decode a prompt in chunks that fill the free cells, compressing back to the budget whenever the
        context is full and once more at the end. ``probe``: tokens whose queries score the cache (the
        question); None uses the generic query-agnostic probe. Returns the last logits."""
        t0 = time.perf_counter()
        self._check_cap(len(tokens))
        probe = self._probe_tokens(probe)
        observed = None  # the probe's queries over the cache as it is now
        i = 0
        while i < len(tokens):
            room = self.ctx.n_ctx - self.live_cells() - self._reserve(probe)
            if room < 1:
                self._compress(probe, observed)
                continue
            chunk = list(tokens[i:i + room])
            observed = self._decode_chunk(chunk, probe)
            i += len(chunk)
        if self.live_cells() > self.budget_cells:
            self._compress(probe, observed)
        self.stats.prompt_tokens += len(tokens)
        if self.prompt_plan is None:
            self.prompt_plan = self.last_plan
        self.stats.prefill_seconds += time.perf_counter() - t0
        self._probe = probe
        return self.logits

    def append(self, tokens: Sequence[int], probe: Sequence[int] | None = None) -> np.ndarray:
        """Add a later turn to the compressed cache (the history is never decoded again)."""
        return self.prefill(tokens, probe)

    def generate(self, max_new: int, sampler: Sampler | None = None, stop_at_eog: bool = True) -> Iterator[int]:
        """Yield up to max_new tokens; the end-of-generation token is kept in the cache, not yielded.

        New tokens fill the cells the prefill chunks used (``slack`` = n_ctx - budget - probe cells);
        when those are full the cache is compressed back to the budget, scored by the last probe."""
        sampler = sampler or Sampler()
        probe = getattr(self, "_probe", None) or self._probe_tokens(None)
        for _ in range(max_new):
            tok = sampler(self.logits)
            t0 = time.perf_counter()
            self._check_cap(1)
            if self.live_cells() + 1 > self.ctx.n_ctx - self._reserve(probe):
                self._compress(probe)
            self.logits = self.ctx.decode([tok], [self.n_past], "last")
            self.n_past += 1
            self.last_token = tok
            self._note_live()
            self.stats.decode_seconds += time.perf_counter() - t0
            if stop_at_eog and self.model.is_eog(tok):
                return
            self.stats.generated_tokens += 1
            yield tok

    @property
    def slack(self) -> int:
        """Cells past the budget that chunks and decoding may fill before the next compression."""
        return self.ctx.n_ctx - self.budget_cells - self.cfg.window

    def live_cells(self) -> int:
        return self.stats.kv_cells_live

    def _probe_tokens(self, probe: Sequence[int] | None) -> list[int]:
        probe = list(probe) if probe else self.model.tokenize(AGNOSTIC_PROBE, add_special=False)
        return probe[-self.cfg.window:]

    def _reserve(self, probe: Sequence[int]) -> int:
        """Cells to keep free for a probe's decode: the probe cap (``window``), whatever this probe's
        length, so that a later, longer probe (the next chat turn) always fits; none for ``full``."""
        return 0 if self.cfg.method == "full" else self.cfg.window

    # -- internals ------------------------------------------------------------------------------------
    def _check_cap(self, n: int) -> None:
        cap = self.cfg.max_tokens
        if cap is not None and self.n_past + n > cap:
            raise UsageError(f"{self.n_past + n} tokens exceed the cap of {cap} this session was sized for: raise -c/--ctx-size")
        if self.cfg.method == "full" and self.n_past + n > self.ctx.n_ctx:
            raise UsageError(f"the full cache of {self.ctx.n_ctx} cells is full: use --budget with a compression method")

    def _note_live(self) -> None:
        self.stats.kv_cells_live = int(llama_live(self.ctx))
        self.stats.kv_cells_live_peak = max(self.stats.kv_cells_live_peak, self.stats.kv_cells_live)

    def _decode_chunk(self, chunk: list[int], probe: list[int]):
        """Decode a prompt chunk; when compression may follow, decode the probe in the same batch (one
        graph, better matmul shapes than a separate small batch), capture its queries, and remove it.
        Returns the observation (queries, positions) or None."""
        p0 = self.n_past
        with_probe = self.cfg.method != "full" and self.live_cells() + len(chunk) > self.budget_cells
        if not with_probe:
            self.logits = self.ctx.decode(chunk, range(p0, p0 + len(chunk)), "last")
            self.n_past += len(chunk)
            self._note_live()
            return None
        t0 = time.perf_counter()
        seq = chunk + probe
        self.capture.arm(len(probe))
        try:
            self.logits = self.ctx.decode(seq, range(p0, p0 + len(seq)), len(chunk) - 1)
        finally:
            self.capture.disarm()
        self.n_past += len(chunk)
        self.ctx.remove(self.n_past, -1)
        self._note_live()
        # the probe's share of this decode counts as compression time (estimated by token share)
        dt = (time.perf_counter() - t0) * len(probe) / len(seq)
        self.stats.compression_seconds += dt
        self.stats.compression_breakdown["observe"] = self.stats.compression_breakdown.get("observe", 0.0) + dt
        return self.capture.take(), np.arange(self.n_past, self.n_past + len(probe))

    def _observe(self, probe: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        """Decode the probe after the cache with query capture, then remove it. Returns per-layer
        post-RoPE queries [Hq, w, d] and their positions [w]."""
        p0 = self.n_past
        q_pos = np.arange(p0, p0 + len(probe))
        self.capture.arm(len(probe))
        try:
            self.ctx.decode(list(probe), q_pos.tolist(), "none")
        finally:
            self.capture.disarm()
        self.ctx.remove(p0, -1)
        return self.capture.take(), q_pos

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
        m = self.model
        fresh = np.broadcast_to(cell_pos.astype(np.int64), (m.n_layer, m.n_head_kv, len(cell_pos)))
        return self._carry(cell_pos, self._slot_true, fresh)

    def _compress(self, probe: Sequence[int], observed=None) -> None:
        """One compression event back to the budget; ``observed``: the probe's queries if the last decode
        already captured them over the current cache, else the probe is decoded now."""
        clock = time.perf_counter
        t0 = clock()
        budget = self.budget_cells
        q, q_pos = observed if observed is not None else self._observe(probe)
        t1 = clock()
        kv = read_seq(self.ctx)
        true = self._true_positions(kv.pos)
        # projected value norms depend only on a row and W_O: carry them over for rows that stay
        m = self.model
        vnorm = self._carry(kv.pos, self._slot_vnorm, np.full((m.n_layer, m.n_head_kv, kv.n), np.nan, np.float32))
        t2 = clock()
        keep = []
        for il in range(self.model.n_layer):
            inputs = LayerInputs(
                k=kv.k[il].transpose(1, 0, 2).astype(np.float32),  # [Hkv, n, d]
                v=kv.v[il].transpose(1, 0, 2).astype(np.float32),
                pos=true[il],  # [Hkv, n]
                q=q[il],
                q_pos=q_pos,
                wo=self._wo[il] if self._wo is not None else None,
                layer=il,
                n_sink=self.cfg.n_sink,
                window=self.cfg.window,  # the probe is not cached: protect the most recent rows instead
                vnorm=vnorm[il],  # CriticalKV fills in the ones it computes
            )
            keep.append(self.scorer.keep(inputs, budget))  # [Hkv, budget] cell indices, position order
        plan = Plan.from_keep(keep, true)
        self.last_plan = plan
        t3 = clock()
        self._apply(kv, plan)
        self._slot_vnorm = np.take_along_axis(vnorm, plan.keep, axis=2)
        t4 = clock()
        self.stats.compression_events += 1
        self.stats.compression_seconds += t4 - t0
        for name, dt in (("observe", t1 - t0), ("read", t2 - t1), ("score", t3 - t2), ("apply", t4 - t3)):
            self.stats.compression_breakdown[name] = self.stats.compression_breakdown.get(name, 0.0) + dt

    def _apply(self, kv: SeqKV, plan: Plan) -> None:
        slot_pos = plan.slot_positions()
        k, v = [], []
        for il, rows in enumerate(plan.keep):  # rows: [Hkv, B] source cells per head
            heads = np.arange(rows.shape[0])[:, None]
            k.append(kv.k[il][rows, heads].transpose(1, 0, 2))  # [B, Hkv, d]
            v.append(kv.v[il][rows, heads].transpose(1, 0, 2))
        write_seq(self.ctx, dataclasses.replace(kv, pos=slot_pos.astype(np.int32), k=k, v=v))
        self._slot_pos = slot_pos.astype(np.int64)
        self._slot_true = plan.positions  # [n_layer, Hkv, B]
        self._note_live()


def pad_cells(n: int) -> int:
    """The n_ctx llama.cpp really allocates for n cells: rounded up to a multiple of 256."""
    return -(-n // 256) * 256


def llama_live(ctx: Context) -> int:
    """Cells held by sequence 0 (the patched runtime's listing, or the state blob's header)."""
    try:
        return len(ctx.cells()[0])
    except UsageError:
        return len(read_seq(ctx).pos)
