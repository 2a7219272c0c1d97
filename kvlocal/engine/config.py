"""What an engine is configured with and what it reports: the budget, the settings, the statistics, and
a snapshot of its state."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from kvlocal.compress import make_scorer, value_norm_refusal
from kvlocal.errors import SettingError, UsageError
from kvlocal.backends import RowRecord
from kvlocal.runtime import N_UBATCH


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
            raise SettingError(f"{{budget}} {text!r} is not a number: give a ratio in (0, 1] like 0.1 or a cell count "
                               f"like 2048", "budget") from None
        if not math.isfinite(value) or value <= 0:
            raise SettingError(f"{{budget}} {text} must be > 0: a ratio in (0, 1] like 0.1 or a cell count like 2048",
                               "budget")
        if value <= 1:
            return cls(ratio=value)
        if value != int(value):
            raise SettingError(f"{{budget}} {text}: a ratio must be in (0, 1]; a cell count must be a whole number",
                               "budget")
        return cls(cells=int(value))

    def cells_for(self, n_tokens: int, floor: int) -> int:
        """Cells for n_tokens seen. An absolute budget below the floor (sinks + the recent span) is an error;
        a ratio is raised to the floor."""
        if self.cells is not None:
            if self.cells < floor:
                raise SettingError(f"{{budget}} {self.cells} is below the floor of {floor} cells (sinks + the recent "
                                   f"span): give at least {floor}", "budget")
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
    host_kv_bytes: int = 0  # K/V bytes events copied between llama.cpp's cache and kvlocal's memory (0 on native;
    # the state backend in place: the kept rows it writes back; through the state blob: every cell out, kept ones in)
    device_transfers: int = 0  # copies between the host and the cache's backends that kvlocal's llama.cpp calls made
    # (scores, merges, compactions, recalled rows: llama_kvlocal_get_counters); O(layers) an event, not O(rows)
    backend: str = ""  # the KV backend compression runs on: "native" or "state"
    budget_cells: int = 0
    kv_cells_live: int = 0
    kv_cells_live_peak: int = 0
    kv_cells_pinned: int = 0  # the first cells, never evicted (a system prompt, tool definitions: Engine.pin)
    compression_events: int = 0
    compression_seconds: float = 0.0  # part of prefill/decode seconds: scoring, KV read/write, and the probe's decode
    compression_breakdown: dict = field(default_factory=dict)  # seconds by step: observe, read, score, apply
    observations_moved: int = 0  # events scored by an earlier probe decode's queries, moved by RoPE (observe_every)
    observations_kept: int = 0  # decode-time events scored by the queries their probe's tokens had (decode_observe)
    observations_window: int = 0  # prompt events scored by their chunk's own last tokens (prefill_observe="window")
    setup_seconds: float = 0.0  # making the engine, its model loaded: llama.cpp's context, W_O's factors (once per model)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    repositions: int = 0  # times an endless session moved its positions back into the trained range
    reposition_seconds: float = 0.0  # their time on the host (the recall tier's keys turned included)
    host_tier_bytes: int = 0  # the recall tier's host memory: evicted rows (RAM and --recall-dir file) and page bounds
    recall_events: int = 0  # re-selections for a new question
    recall_seconds: float = 0.0  # their time (the question's probe decode included)
    recall_steps: int = 0  # re-selections at an answer's first tokens (``recall_steps`` of them per answer)
    recall_step_seconds: float = 0.0  # the time of those that swapped (each token's probe decode included)
    recall_steps_confident: int = 0  # of them, decodes kept (no swap): confident, or too soon after a swap
    recall_candidates: int = 0  # tier rows scored by re-selections (the best pages' rows)
    recall_rows_in: int = 0  # rows brought back to the device
    recall_rows_out: int = 0  # rows the tier took (each row once: one brought back and evicted again costs nothing)
    recall_dropped_rows: int = 0  # tier rows forgotten: positions moved back, or an event's own past the RAM cap
    # (the oldest rows dropped for the cap: Engine.kv_figures' host_tier_dropped_rows)
    end_tokens: int = 0  # end-of-generation tokens decoded into the cache (not yielded, not in generated_tokens)
    # host bytes copied so that a turn could be undone (kvlocal.engine.undo): the rows its events evict that no recall
    # tier keeps, the cells whole where its log would hold more (or before positions move, or with a sliding window;
    # on a GPU, across PCIe), the tier's rows before positions move; 0 where the tier holds what its events evicted
    rollback_bytes: int = 0
    rollback_copies: int = 0  # how many such copies
    reading_contexts: int = 0  # turns read whole in a reading context (Engine(read_cells=): kvlocal.engine.reading)
    reading_bytes_peak: int = 0  # the largest one's K/V bytes (host memory; 0 on a stock runtime, which reports none)
    reading_refused: int = 0  # turns read in the budget's context instead: llama.cpp could not allocate the reading one

    @property
    def tokens_seen(self) -> int:
        """Every token the cache has been fed."""
        return self.prompt_tokens + self.generated_tokens + self.end_tokens

    def as_dict(self) -> dict:
        return asdict(self)

    def load(self, other: "EngineStats") -> None:
        """Take ``other``'s figures, in place: the engine's parts count into this one object."""
        for f in fields(self):
            setattr(self, f.name, getattr(other, f.name))


def resolve_recall(recall: bool | None, method: str) -> bool:
    """Whether an engine keeps a recall tier: ``None`` (auto) is on for the eviction methods — merged rows cannot
    come back one by one; the full cache evicts nothing. UsageError, naming the fix, for recall with a
    merging method."""
    merges = make_scorer(method).merges
    if recall is None:
        recall = not merges
    if recall and merges:
        raise SettingError(f"{{recall}} on does not work with {{method}} {method}: a merged row stands for several "
                           "tokens, so bringing one of them back would count it twice; use an eviction method "
                           "(criticalkv)", "recall")
    return bool(recall) and method != "full"


# prefill compression events one decode of the probe scores (kvlocal.engine.observation; docs/engine.md)
OBSERVE_EVERY = 4

# how a decode-time event (the cache full while generating) is observed: "probe" decodes its probe (the prompt
# probe's end and the reply's last tokens) after the cache; "kept" uses the queries those tokens had when they were
# decoded, turned by RoPE to the probe's positions (kvlocal.engine.observation.Observations.kept; docs/engine.md)
DECODE_OBSERVATIONS = ("probe", "kept")
DECODE_OBSERVE = "kept"

# how a prompt's compression events before its last are observed: "probe" decodes the probe (the question, or the
# generic probe of a prompt read before any question: a chat's document) after the cache, once in observe_every
# events, its queries moved by RoPE to the others; "window" takes the queries of the chunk's own last ``recent``
# tokens, captured while the chunk is decoded (SnapKV's observation window: no decode of ours). The event that ends a
# prompt always decodes the probe. docs/engine.md § the chunk's own window: "window" made SmolLM2's 8K compression a
# smaller share of the prefill, but lost retrieval where the question was known (multikey prompts) and found fewer
# facts on the development chat, so the probe stays the default
PREFILL_OBSERVATIONS = ("probe", "window")
PREFILL_OBSERVE = "probe"

# the share of the budget a compression event leaves while a prompt is read, with a recall tier (the event that ends
# it, and events while generating, leave the whole budget): below 1 the next chunk has more free cells, so a prompt
# takes fewer, larger events in the same memory; a row ranked between this share and the budget at one event is
# dropped there instead of competing again at the next — to the tier, from which a question brings it back.
# docs/engine.md § fewer events in the same memory: 0.75 made SmolLM2's 8K compression a smaller share of the
# prefill, without a tier and with one (§ what the chat's default costs), KL equal or lower on the eval, more facts
# on the development chat, one Qwen multikey prompt lost; 0.5 lost a fact on the six-question chat. Without a tier
# every event leaves the budget (1): at 0.75 and 0.9 a chat lost a fact stated before a long turn
# (tests/chat/test_chat_budget.py), which 1 keeps and the tier brings back
LOW_WATER = 0.75

# CriticalKV's value norm where the engine is not told one: L2 (``||v W_O^h||_2``, computed exactly through a d x d
# factor of W_O, D/d times less work than the paper's L1). docs/engine.md § L2 value norms, the default: the same
# facts on the development chat, the six-question chat and a second eval seed, KL within one seed's noise, and
# compression a smaller share of SmolLM2's and Qwen2.5-Coder's 8K prefill at the chat's defaults. The eval's plain
# names keep the paper's L1 (+l2 names L2); so does a bare CriticalKV()
VALUE_NORM = "l2"


def resolve_method_params(method: str, params: dict | None) -> dict:
    """The scorer's hyperparameters: ``params`` with :data:`VALUE_NORM` added where ``method`` has a value norm
    and none is given."""
    params = dict(params or {})
    if "value_norm" not in params and not value_norm_refusal(method):
        params["value_norm"] = VALUE_NORM
    return params


def resolve_low_water(low_water: float | None, recall: bool) -> float:
    """An engine's ``low_water``: the one given, or (None) :data:`LOW_WATER` with a recall tier and 1 without."""
    if low_water is None:
        return LOW_WATER if recall else 1.0
    check_low_water(low_water)
    return low_water


def check_read_cells(read_cells, name: str = "read_cells") -> None:
    """SettingError, naming the fix, unless ``read_cells`` is a whole number >= 0, None (no cap) or "auto"."""
    if read_cells is None or read_cells == "auto":
        return
    if isinstance(read_cells, bool) or not isinstance(read_cells, (int, np.integer)) or read_cells < 0:
        raise SettingError(f"{{read_cells}} {read_cells!r}: give a number of cells >= 0 (0: read in the budget's "
                           f"context), whole (no cap) or auto", name)


def resolve_read_cells(read_cells, recall: bool, tier_limit: int | None, cell_bytes: float) -> int | None:
    """An engine's ``read_cells``: the one given, or for "auto" — with a recall tier — the cells whose K/V fit the
    tier's RAM cap (``tier_limit`` bytes; None: no cap), the host memory the chat gave its evicted rows, which hold
    the reading's after its event anyway; without a tier 0 (read in the budget's context)."""
    if read_cells != "auto":
        return read_cells
    if not recall:
        return 0
    return None if tier_limit is None else int(tier_limit // cell_bytes)


def check_prefill_observe(prefill_observe: str) -> None:
    """UsageError, naming the choices, unless ``prefill_observe`` is one of :data:`PREFILL_OBSERVATIONS`."""
    if prefill_observe not in PREFILL_OBSERVATIONS:
        raise SettingError(f"{{prefill_observe}} {prefill_observe!r}: give one of {', '.join(PREFILL_OBSERVATIONS)}",
                           "prefill_observe")


# the most layers an event plans at once (on the context's threads, no more): the kernels release the GIL, the
# numpy work between them does not, and every layer in flight holds its inputs (views of an F16 cache's cells; a
# quantized cache's decoded to float32), twice as many queued (plan_layers)
PLAN_WORKERS = 4

# an answer's first tokens that re-select the cache with their own query after the question did (the recall tier;
# docs/recall.md § Choices: on the development chat steps found more facts than none, and 32 no more than 10)
RECALL_STEPS = 16
# tier rows a question scores exactly, as a multiple of the head budget (the best pages by bound; docs/recall.md
# § Choices: one budget found fewer facts than four, and scoring every row no more than four)
RECALL_CANDIDATES = 4.0
# and an answer step, as a question (a step displaces at most that many of the question's rows). A quarter was
# tried: less step time, the same facts on the development chat, fewer on the reported eval (§ Choices)
RECALL_STEP_CANDIDATES = RECALL_CANDIDATES
# an answer step keeps the token's decode and swaps nothing when that decode, before any swap, already predicts the
# next token with a probability above this (1.0: every step swaps); its query is held for the next step that swaps
# (a swap serves the tokens after it). docs/recall.md § Choices: a cheaper turn, more facts on the development
# chat, the reported eval unchanged
RECALL_STEP_CONFIDENCE = 0.9
# an answer step may swap only when it is this many steps past the last swap (the ones between keep their decode and
# hold their query for it, as confident ones do); 1: any step may swap
RECALL_STEP_EVERY = 1
# the cells a question's re-selection leaves free for its answer: the rest of the context's headroom (the cells prefill
# chunks fill) holds recalled rows while the answer's first tokens are written, then a compression returns to the
# budget (docs/recall.md § Choices). 0 turns it off: a re-selection keeps the budget's rows
RECALL_ROOM = 64


def check_low_water(value, name: str = "low_water") -> None:
    """UsageError, naming the fix, unless ``value`` is a share of the budget in (0, 1]; ``name``: what the caller
    calls it (``low_water``, ``--low-water``, ``--low-waters``)."""
    if isinstance(value, bool) or not (isinstance(value, (int, float, np.floating)) and 0 < value <= 1):
        why = f"{value!r}: give a share of the budget in (0, 1] (1: every event leaves the whole budget)"
        if name == "low_water":  # the setting: each front door names it its own way
            raise SettingError(f"{{low_water}} {why}", "low_water")
        raise UsageError(f"{name} {why}")


@dataclass
class EngineConfig:
    budget: Budget = field(default_factory=lambda: Budget(ratio=0.1))
    method: str = "criticalkv"
    chunk: int = 128  # least prefill chunk: n_ctx = budget + chunk + recent (then padded by llama.cpp)
    recent: int = 32  # the protected recent span: the newest tokens always kept; also the probe length cap
    n_sink: int = 4  # first tokens always kept (attention sinks)
    max_tokens: int | None = None  # tokens a session may see in all (hard cap; sizes a ratio budget)
    observe_every: int = OBSERVE_EVERY  # prefill events one probe decode scores (kvlocal.engine.observation)
    decode_observe: str = DECODE_OBSERVE  # a decode-time event's observation: "probe" decoded, or "kept" queries
    prefill_observe: str = PREFILL_OBSERVE  # a prompt's events before its last: "probe" decoded, or the chunk's "window"
    low_water: float = 1.0  # the share of the budget a prompt's events before its last one leave (resolve_low_water)

    def validate(self) -> None:
        """Raise UsageError naming the fix for values the engine cannot work with."""
        for name, lo in (("chunk", 1), ("recent", 1), ("n_sink", 0), ("max_tokens", 1), ("observe_every", 1)):
            val = getattr(self, name)
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < lo:
                raise UsageError(f"{name} must be a whole number >= {lo}, got {val!r}")
        check_low_water(self.low_water)
        if self.decode_observe not in DECODE_OBSERVATIONS:
            raise UsageError(f"decode_observe {self.decode_observe!r}: give one of {', '.join(DECODE_OBSERVATIONS)}")
        check_prefill_observe(self.prefill_observe)
        if self.recent > N_UBATCH // 2:
            raise UsageError(f"recent {self.recent} is too large: at most {N_UBATCH // 2} (the probe is decoded with a chunk in one batch)")


@dataclass
class EngineState:
    """An :class:`~kvlocal.engine.Engine`'s :meth:`~kvlocal.engine.Engine.snapshot`: ``blob`` is llama.cpp's
    sequence state (uint8), ``record`` kvlocal's record of the rows (:class:`~kvlocal.backends.RowRecord`)."""

    blob: np.ndarray
    n_past: int
    last_token: int
    logits: np.ndarray | None
    record: RowRecord
    tier_mark: np.ndarray | None  # rows per head of the recall tier then ([n_layer, Hkv]); None: no tier
    settled: int
    probe: list[int] | None
    reply: list[int]
    stats: dict

    @property
    def nbytes(self) -> int:
        return self.blob.nbytes + (0 if self.logits is None else self.logits.nbytes) + self.record.nbytes
