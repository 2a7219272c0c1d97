"""The bounded-memory Engine (kvlocal.engine) on the real llama.cpp and SmolLM2-135M, against the PyTorch
reference (kvlocal.reference). No mocks: the engine is subclassed only to *record* what it does (every
compression event's plan, the LayerInputs one event scored, llama.cpp's own cell list after every decode).

How the engine is checked against the reference (test_engine_matches_reference_with_the_same_plans): the
engine prefills 600 tokens of English prose into a 256-cell context at a budget of 128 cells, so several
compression events run, each over a cache whose keys were computed over an already-compressed cache. The
reference replays the same story: it decodes the same tokens in the same order and, at every point
where the engine compressed, keeps exactly the source positions the engine's plan kept (per layer, per
KV head). Both then decode the same continuation (the engine's greedy tokens; one decode-time event
falls inside it) and their next-token distributions are compared by KL and top-1 agreement.

The tolerance comes from a control measured in the same test: llama.cpp and the reference on the FULL
cache (no compression), same tokens. llama.cpp computes with Q8-rounded activations and an F16 cache,
the reference in float32, and on a Q4 model float order alone moves logits (measured: up to ~0.9
for the same cache in another cell order), so "the same" means "as close as the full-cache control",
not bit-identical. Two negative controls show that the comparison can fail: the reference with other
plans (the same number of kept positions per head, the sinks and the recent window kept as the engine
keeps them, the rest drawn at random) must be far from the engine, and so must the uncompressed reference.

Sizes are small (SmolLM2-135M, prompts of 300-600 tokens, budgets of 64-160 cells, one llama.cpp
thread, one torch thread): the suite shares two CPU cores.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pytest

from replay import replay
from kvlocal.compress import VALUE_NORMS, CriticalKV, LayerInputs, Plan, SnapKV, projected_value_norms
from kvlocal.compress.criticalkv import l2_factor
from kvlocal.engine import AGNOSTIC_PROBE, LOW_WATER, VALUE_NORM, Budget, Engine
from kvlocal.errors import UsageError
from kvlocal.runtime.llama import kv_cache_bytes
from kvlocal.runtime import Sampler
from kvlocal.eval.metrics import compare_logits
from kvlocal.eval.tasks import sample_text

THREADS = 1  # llama.cpp threads: the machine is small and shared
N_PROMPT = 600  # tokens of sample.txt in the reference comparison
BUDGET, CHUNK, WINDOW, N_SINK = 128, 64, 32, 4  # n_ctx = 128 + 64 + 32 = 224, padded by llama.cpp to 256
N_DECODE = 100  # more than the decode slack (256 - 128 - 32 = 96): one decode-time event in the comparison
INPUTS_EVENT = 3  # the event whose LayerInputs test_kept_sets_match_the_reference_scorer checks


def padded(n_ctx: int) -> int:
    """llama.cpp rounds n_ctx up to a multiple of 256 (llama-context.cpp, GGML_PAD(n_ctx, 256))."""
    return -(-n_ctx // 256) * 256


# -- recording ---------------------------------------------------------------------------------------


@dataclass
class Decode:
    phase: str  # "prefill" or "decode"
    n_tokens: int
    first_pos: int
    last_pos: int
    cells: int  # llama.cpp's own count of sequence 0's cells right after the decode (probe included)


@dataclass
class Event:
    n_past: int  # the cache held positions < n_past when the event ran
    plan: Plan
    probe: list[int]
    phase: str
    decodes_before: int  # len(engine.decodes) when the event ended
    scored_cells: np.ndarray  # cell positions read and scored (after the probe was removed)
    inputs: list[LayerInputs] | None = None  # what the scorer read, per layer (INPUTS_EVENT only)
    keeps: list[np.ndarray] | None = None  # what the scorer returned, per layer
    budget: int | None = None  # the budget the scorer was given


class _RecordingScorer:
    """Delegates to the engine's scorer; keeps the LayerInputs while ``log[0]`` is a list."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    def plan_layer(self, inputs: LayerInputs, budget: int):
        out = self.inner.plan_layer(inputs, budget)
        if self.log[0] is not None:
            self.log[0].append((inputs.detached(), int(budget), out.keep.copy()))
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


class RecordingEngine(Engine):
    """The Engine, unchanged, plus a log: every compression event, the LayerInputs of the events listed
    in ``inputs_of``, and every llama.cpp decode with the cell count right after it."""

    def __init__(self, *args, inputs_of: tuple[int, ...] = (), **kwargs):
        kwargs.setdefault("backend", "state")  # it records the K/V rows the scorers read on the host
        kwargs.setdefault("observe_every", 1)  # every event decodes its probe: what the reference recomputes
        kwargs.setdefault("low_water", 1.0)  # every event leaves the budget (fewer events: the low_water test)
        kwargs.setdefault("decode_observe", "probe")  # the decode-time ones too (the kept queries: test_observation)
        super().__init__(*args, **kwargs)
        self.events: list[Event] = []
        self.decodes: list[Decode] = []
        self.phase = "prefill"
        self._inputs_of = set(inputs_of)
        self._log: list = [None]
        self.scorer = _RecordingScorer(self.scorer, self._log)
        decode = self.ctx.decode

        def recording_decode(tokens, positions=None, logits="last"):
            out = decode(tokens, positions, logits)
            pos = list(positions) if positions is not None else [-1]
            self.decodes.append(Decode(self.phase, len(tokens), int(pos[0]), int(pos[-1]), len(self.ctx.cells()[0])))
            return out

        self.ctx.decode = recording_decode  # this instance's context only
        read = self.compressor.read

        def recording_read():
            out = read()
            self._scored_cells = np.array(out.pos, copy=True)
            return out

        self.compressor.read = recording_read  # the cells each event scored

    def prefill(self, tokens, probe=None):
        self.phase = "prefill"
        return super().prefill(tokens, probe)

    def generate(self, *args, **kwargs):
        self.phase = "decode"
        yield from super().generate(*args, **kwargs)

    def _compress(self, *args, **kwargs):
        probe = list(args[0] if args else kwargs["probe"])
        self._log[0] = [] if len(self.events) in self._inputs_of else None
        try:
            super()._compress(*args, **kwargs)
            log = self._log[0]
        finally:
            self._log[0] = None
        self.events.append(Event(
            n_past=self.n_past, plan=self.last_plan, probe=probe, phase=self.phase, decodes_before=len(self.decodes),
            scored_cells=self._scored_cells, inputs=[x[0] for x in log] if log else None,
            keeps=[x[2] for x in log] if log else None, budget=log[0][1] if log else None,
        ))


class Forced:
    """A sampler that records the logits it is shown and returns their argmax (greedy), or the next
    token of a given list (to make another engine decode the same tokens)."""

    def __init__(self, tokens: list[int] | None = None):
        self.tokens, self.logits, self.out = tokens, [], []

    def __call__(self, logits: np.ndarray) -> int:
        self.logits.append(np.array(logits, dtype=np.float32))
        tok = int(np.argmax(logits)) if self.tokens is None else int(self.tokens[len(self.out)])
        self.out.append(tok)
        return tok


def cells(eng: Engine) -> np.ndarray:
    """Positions of the cells llama.cpp holds for sequence 0, in cell order."""
    return eng.ctx.cells()[1].astype(np.int64)


# -- the reference replay ----------------------------------------------------------------------------


def plan_keeper(plan: Plan):
    return lambda il, h, held: plan.positions[il, h]


def random_keeper(plan: Plan, rng):
    """Another plan: as many positions per head as ``plan`` keeps, the sinks and the WINDOW most recent
    positions among them (the engine's protected rows), the rest drawn at random from what the head holds."""

    def kept_for(il, h, held):
        held = np.sort(held[held >= 0])
        fixed = held[(held < N_SINK) | (held >= held[-WINDOW])]
        rest = np.setdiff1d(held, fixed)
        return np.sort(np.concatenate([fixed, rng.choice(rest, plan.n_slots - len(fixed), replace=False)]))

    return kept_for


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ref_model(smollm2_ref):
    return smollm2_ref


@pytest.fixture(scope="session")
def text_tokens(smollm2_model) -> list[int]:
    tokens = smollm2_model.tokenize(sample_text())
    assert len(tokens) > N_PROMPT
    return tokens


@pytest.fixture(scope="session")
def prompt(text_tokens) -> list[int]:
    return text_tokens[:N_PROMPT]


@pytest.fixture(scope="session")
def run(smollm2_model, prompt):
    """One compressed run: prefill with the prompt's tail as the probe (as `kvlocal run`), then N_DECODE
    greedy tokens."""
    eng = RecordingEngine(smollm2_model, BUDGET, "criticalkv", max_tokens=N_PROMPT + N_DECODE, chunk=CHUNK,
                          recent=WINDOW, n_sink=N_SINK, n_threads=THREADS, inputs_of=(INPUTS_EVENT,))
    logits0 = eng.prefill(prompt, probe=prompt[-WINDOW:])
    after_prefill = dict(n_past=eng.n_past, pos_max=eng.ctx.pos_max(), cells=cells(eng), stats=copy.deepcopy(eng.stats),
                         plan=eng.last_plan, slot_true=eng.kv.record.true.copy(), n_events=len(eng.events))
    sampler = Forced()
    generated = list(eng.generate(N_DECODE, sampler, stop_at_eog=False))
    logits = np.stack(sampler.logits + [eng.logits])  # after the prompt, then after each generated token
    np.testing.assert_array_equal(logits[0], logits0)
    return dict(engine=eng, generated=generated, logits=logits, after_prefill=after_prefill)


@pytest.fixture(scope="session")
def comparison(smollm2_model, ref_model, prompt, run):
    """The reference replays of ``run`` (the engine's plans; other plans; no compression) and the
    full-cache llama.cpp control, all over the same tokens: the prompt, then the engine's greedy tokens."""
    import torch

    eng = run["engine"]
    tokens = prompt + run["generated"]
    at_event = {}

    def look(i, cache):  # the reference's own view of event INPUTS_EVENT: its cache and the probe's queries
        if i == INPUTS_EVENT:
            ev = eng.events[i]
            _, q = ref_model(torch.tensor(ev.probe), torch.arange(ev.n_past, ev.n_past + len(ev.probe)),
                             copy.deepcopy(cache), capture_queries=True)
            at_event.update(cache=copy.deepcopy(cache), q=[x.numpy() for x in q])

    same = replay(ref_model, tokens, N_PROMPT, [(e.n_past, plan_keeper(e.plan)) for e in eng.events], look)
    rng = np.random.default_rng(0)
    other = replay(ref_model, tokens, N_PROMPT, [(e.n_past, random_keeper(e.plan, rng)) for e in eng.events])
    ref_full = replay(ref_model, tokens, N_PROMPT, [])

    full = Engine(smollm2_model, 1.0, "full", max_tokens=len(tokens), chunk=CHUNK, n_threads=THREADS)
    full.prefill(prompt)
    forced = Forced(run["generated"])
    assert list(full.generate(N_DECODE, forced, stop_at_eog=False)) == run["generated"]
    llama_full = np.stack(forced.logits + [full.logits])
    return dict(same=same, other=other, ref_full=ref_full, llama_full=llama_full, at_event=at_event, full=full)


# -- 1. the engine against the reference, same plans ----------------------------------------------------


@pytest.mark.slow(37)
def test_engine_matches_reference_with_the_same_plans(run, comparison):
    eng = run["engine"]
    phases = [e.phase for e in eng.events]
    assert phases.count("prefill") >= 4 and phases.count("decode") >= 1, phases
    for e in eng.events:
        assert e.plan.n_slots == BUDGET

    engine = run["logits"]
    assert engine.shape == comparison["same"].shape == comparison["llama_full"].shape
    control = compare_logits(comparison["llama_full"], comparison["ref_full"])  # llama.cpp vs reference, full cache
    same = compare_logits(engine, comparison["same"])  # engine vs reference with the engine's plans
    other = compare_logits(engine, comparison["other"])  # engine vs reference with other plans
    uncompressed = compare_logits(engine, comparison["ref_full"])  # engine vs reference, full cache
    for name, m in (("control (full cache)", control), ("same plans", same), ("other plans", other),
                    ("reference uncompressed", uncompressed)):
        print(f"{name:24} mean KL {m['mean_kl']:.4f}  max KL {m['max_kl']:.4f}  top-1 {m['top1_agreement']:.3f}  "
              f"decisive top-1 {m['decisive_top1_agreement']:.3f} ({m['decisive_positions']})")

    # the control is what tests/reference measured for this model (mean KL 0.003 over 300 tokens)
    assert control["mean_kl"] <= 0.02 and control["decisive_top1_agreement"] == 1.0, control
    # the same plans: as close as the control (measured: equal to it)
    assert same["mean_kl"] <= max(3 * control["mean_kl"], 0.005), (same, control)
    assert same["max_kl"] <= max(3 * control["max_kl"], 0.03), (same, control)
    assert same["top1_agreement"] >= control["top1_agreement"] - 0.05, (same, control)
    assert same["decisive_top1_agreement"] == 1.0, same
    # negative controls: what the engine keeps matters, and the comparison sees it (measured 20-40x)
    assert other["mean_kl"] >= 8 * same["mean_kl"], (other, same)
    assert uncompressed["mean_kl"] >= 8 * same["mean_kl"], (uncompressed, same)


# -- 2. the kept sets against the reference scorer -----------------------------------------------------


def reference_layer(x: LayerInputs, engine_rule: bool, wo: np.ndarray):
    """The reference's (LayerKV, Observation) built from the arrays the engine scored.

    The reference protects the rows at or after the first observation query (``pos >= min(q_pos)``):
    with the probe decoded after the cache, none. The engine passes ``recent=WINDOW``: the WINDOW most
    recent positions of each head are protected (and left out of the pooling) instead. With
    ``engine_rule`` the engine's rule is expressed in the reference's terms: each head's WINDOW most
    recent rows get one common position T just past the cache and the queries positions T, T+1, ...;
    every query still sees every row (as the probe does), the order of the other rows, the sinks and
    all the arrays are unchanged.
    """
    import torch

    from kvlocal.reference import compress as rc
    from kvlocal.reference.cache import LayerKV

    pos, q_pos = x.pos_h.copy(), x.q_pos.copy()
    if engine_rule:
        t = int(pos.max()) + 1
        pos = np.where(pos >= np.sort(pos, axis=1)[:, -x.recent][:, None], t, pos)
        q_pos = t + np.arange(len(q_pos))
    hkv, n = pos.shape
    kv = LayerKV(k=torch.from_numpy(x.k.copy()), v=torch.from_numpy(x.v.copy()), pos=torch.from_numpy(pos),
                 count=torch.ones(hkv, n, dtype=torch.int64), bias=torch.zeros(hkv, n))
    return kv, rc.Observation(q=torch.from_numpy(x.q.copy()), q_pos=torch.from_numpy(q_pos), wo=torch.from_numpy(wo))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||, in float64 (an F16 cache's rows squared and summed in float16 overflow)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow(17)
def test_kept_sets_match_the_reference_scorer(run, comparison, ref_model, smollm2_model):
    from kvlocal.reference import compress as rc

    eng = run["engine"]
    ev = eng.events[INPUTS_EVENT]
    m = smollm2_model
    assert ev.inputs is not None and len(ev.inputs) == m.n_layer and ev.budget == BUDGET
    # the engine's scorer: CriticalKV over SnapKV with the defaults of the papers' code, and the engine's value norm
    assert eng.scorer.inner == CriticalKV(SnapKV(window_size=32, kernel_size=7, pooling="max"), epsilon=1e-4,
                                          first_stage_ratio=0.5, value_norm=VALUE_NORM)
    norm = eng.scorer.inner.value_norm  # the reference ranks by the same
    ref_scorer = rc.CriticalKV(rc.SnapKV(window_size=32, kernel_size=7, pooling="max", n_sink=N_SINK),
                               epsilon=1e-4, first_stage_ratio=0.5, value_norm=norm)
    ref_cache, ref_q = comparison["at_event"]["cache"], comparison["at_event"]["q"]

    plain_differ = 0
    for il, x in enumerate(ev.inputs):
        assert (x.n_sink, x.recent, x.bias) == (N_SINK, WINDOW, None)
        np.testing.assert_array_equal(x.q_pos, np.arange(ev.n_past, ev.n_past + len(ev.probe)))
        np.testing.assert_array_equal(ev.plan.keep[il], ev.keeps[il])  # the plan is what the scorer chose

        # the arrays are the reference's: W_O, the K/V rows at their true positions, the probe's queries
        # (measured relative errors: K, q <= 0.023, V <= 0.047 — Q8 activations and the F16 cache; rows
        # labelled one position off are >= 0.4 away)
        wo = eng._wo[il]  # W_O as the engine reads it from the GGUF; with L2 norms the scorer gets its factor
        np.testing.assert_allclose(wo, ref_model.layers[il].attention.wo.weight.numpy(), rtol=1e-6, atol=1e-7)
        if norm == "l2":
            assert x.wo is None
            np.testing.assert_array_equal(x.wo_l2, l2_factor(wo, x.n_head))
        else:
            assert x.wo is wo and x.wo_l2 is None
        layer = ref_cache[il]
        for h in range(m.n_head_kv):
            index = {int(p): i for i, p in enumerate(layer.pos[h].numpy())}
            rows = [index[int(p)] for p in x.pos_h[h]]  # KeyError: a row labelled with a position not held
            ref_k, ref_v = layer.k[h, rows].numpy(), layer.v[h, rows].numpy()
            assert rel_err(x.k[h], ref_k) < 0.06 and rel_err(x.v[h], ref_v) < 0.1, (il, h)
            assert rel_err(x.k[h], np.roll(ref_k, 1, axis=0)) > 0.25 < rel_err(x.v[h], np.roll(ref_v, 1, axis=0))
        assert rel_err(x.q, ref_q[il]) < 0.06, il
        # value norms carried from earlier events are those of the rows that carry them
        known = ~np.isnan(x.vnorm) if x.vnorm is not None else np.zeros((m.n_head_kv, x.n), dtype=bool)
        if known.any():
            exact = np.stack(projected_value_norms(x.v, wo, x.n_head, p=VALUE_NORMS[norm]))  # through W_O
            np.testing.assert_allclose(x.vnorm[known], exact[known], rtol=1e-4)

        # the kept sets: exactly the reference's, with the window rule the engine uses
        kv, obs = reference_layer(x, engine_rule=True, wo=wo)
        want = ref_scorer.plan(kv, obs, ev.budget)
        for h in range(m.n_head_kv):
            assert set(ev.plan.keep[il][h].tolist()) == set(want.keep[h].tolist()), f"layer {il} head {h}"
        # with the reference's own rule (nothing protected past the probe) some rows differ
        kv, obs = reference_layer(x, engine_rule=False, wo=wo)
        assert not rc.protected_mask(kv, 0, obs.q_pos).any()
        theirs = ref_scorer.plan(kv, obs, ev.budget)
        plain_differ += sum(len(set(ev.plan.keep[il][h].tolist()) - set(theirs.keep[h].tolist()))
                            for h in range(m.n_head_kv))
    print(f"event {INPUTS_EVENT} (n_past {ev.n_past}): all {m.n_layer} layers keep the reference's sets; with the "
          f"reference's own window rule {plain_differ} of {m.n_layer * m.n_head_kv * ev.budget} kept rows would differ")


# -- 3. chunked prefill inside n_ctx, true positions ----------------------------------------------------


@pytest.mark.slow(7)
def test_chunked_prefill_stays_within_n_ctx(run, smollm2_model):
    eng, after = run["engine"], run["after_prefill"]
    n_ctx = eng.ctx.n_ctx
    # n_ctx is budget + chunk + window (padded by llama.cpp), not the prompt length
    assert n_ctx == eng.stats.n_ctx == padded(BUDGET + CHUNK + WINDOW) < N_PROMPT
    # measured: the bytes of llama.cpp's K/V buffers (patched runtime), equal to the formula for n_ctx cells
    assert eng.stats.kv_bytes_measured
    assert eng.stats.kv_bytes_allocated == sum(kv_cache_bytes(smollm2_model, n_ctx))
    prefill = [d for d in eng.decodes if d.phase == "prefill"]
    assert len(prefill) >= 4  # the prompt went in in pieces
    # live cells never exceed n_ctx: the engine's figure and llama.cpp's own count (probe cells included)
    assert BUDGET < after["stats"].kv_cells_live_peak <= n_ctx
    assert max(d.cells for d in eng.decodes) <= n_ctx
    assert eng.stats.kv_cells_live_peak <= n_ctx

    # positions stay the original token positions
    assert after["n_past"] == N_PROMPT and after["pos_max"] == N_PROMPT - 1
    pos = after["cells"]
    assert len(pos) == after["stats"].kv_cells_live == BUDGET  # the prompt ended with a compression event
    assert np.all(np.diff(pos) > 0)  # strictly increasing in cell order
    plan, true = after["plan"], after["slot_true"]
    np.testing.assert_array_equal(pos, plan.slot_positions())
    np.testing.assert_array_equal(true, plan.positions)
    assert np.all(np.diff(true, axis=2) > 0)  # each head's rows in position order
    assert np.all(true <= pos) and true.min() >= 0  # a cell's position is the largest it holds
    # every layer and head kept the sinks and the most recent WINDOW tokens, in the last cells
    assert np.all(true[:, :, :N_SINK] == np.arange(N_SINK))
    assert np.all(true[:, :, -WINDOW:] == np.arange(N_PROMPT - WINDOW, N_PROMPT))
    np.testing.assert_array_equal(pos[-WINDOW:], np.arange(N_PROMPT - WINDOW, N_PROMPT))
    # after the decode-time event, the same holds with the generated tokens
    assert eng.n_past == eng.ctx.pos_max() + 1 == N_PROMPT + N_DECODE
    assert np.all(np.diff(cells(eng)) > 0)


# -- 4. decode-time compression -------------------------------------------------------------------------


def decode_run(model, text_tokens, probe_kind: str, n_gen: int = 150):
    """Budget 160 in a 256-cell context (decode slack 64); a 300-token prompt, then n_gen tokens."""
    prompt = text_tokens[:300]
    eng = RecordingEngine(model, 160, "criticalkv", max_tokens=len(prompt) + n_gen + 64, chunk=CHUNK, recent=WINDOW,
                          n_threads=THREADS)
    eng.prefill(prompt, probe=prompt[-WINDOW:] if probe_kind == "question" else None)
    before = eng.stats.compression_events
    live = []
    for _ in eng.generate(n_gen, Sampler(), stop_at_eog=False):
        live.append((eng.stats.kv_cells_live, len(eng.ctx.cells()[0])))
    return eng, prompt, before, np.array(live)


@pytest.mark.parametrize("probe_kind", ["question", "agnostic"])
@pytest.mark.slow(6)
def test_decode_time_compression(smollm2_model, text_tokens, probe_kind):
    eng, prompt, before, live = decode_run(smollm2_model, text_tokens, probe_kind)
    slack = eng.slack
    assert eng.ctx.n_ctx == padded(eng.budget_cells + CHUNK + WINDOW)
    assert slack == eng.ctx.n_ctx - eng.budget_cells - WINDOW  # docs/engine.md
    assert len(live) == 150 > 2 * slack
    decode_events = [e for e in eng.events if e.phase == "decode"]
    np.testing.assert_array_equal(live[:, 0], live[:, 1])  # the engine's count is llama.cpp's
    print(f"{probe_kind} probe ({len(eng.last_probe)} tokens): live cells {live[:, 0].min()}..{live[:, 0].max()}, "
          f"budget {eng.budget_cells} + slack {slack}, n_ctx {eng.ctx.n_ctx}, {len(decode_events)} decode-time events")
    peak = int(live[:, 0].max())
    assert peak <= eng.budget_cells + slack + 1, \
        f"live cells reached {peak} > budget {eng.budget_cells} + slack {slack} + 1 (probe of {len(eng.last_probe)} tokens)"
    assert eng.stats.compression_events - before == len(decode_events) >= 2
    assert eng.n_past == len(prompt) + len(live) == eng.ctx.pos_max() + 1
    for e in decode_events:
        assert e.plan.n_slots == eng.budget_cells
        assert np.all(e.plan.positions[:, :, -WINDOW:] == np.arange(e.n_past - WINDOW, e.n_past))
    assert np.all(np.diff(cells(eng)) > 0) and cells(eng).max() < eng.n_past


@pytest.mark.slow(7)
def test_low_water_reads_a_prompt_in_fewer_events_in_the_same_cells(smollm2_model, text_tokens):
    """``low_water``: a prompt's events before its last leave a share of the budget, so the next chunks are
    longer and fewer events read the prompt — in the same context, and the last event leaves the whole budget."""
    prompt = text_tokens[:N_PROMPT]
    runs = {}
    for low in (1.0, 0.5):
        eng = RecordingEngine(smollm2_model, BUDGET, "criticalkv", max_tokens=N_PROMPT + 1, chunk=CHUNK, recent=WINDOW,
                              n_sink=N_SINK, n_threads=THREADS, low_water=low)
        eng.prefill(prompt, probe=prompt[-WINDOW:])
        runs[low] = eng
    whole, half = runs[1.0], runs[0.5]
    print("events:", [e.plan.n_slots for e in whole.events], "against", [e.plan.n_slots for e in half.events])
    assert half.ctx.n_ctx == whole.ctx.n_ctx and half.stats.kv_bytes_allocated == whole.stats.kv_bytes_allocated
    assert half.stats.kv_cells_live_peak <= half.ctx.n_ctx
    assert 1 < len(half.events) < len(whole.events)
    assert all(e.plan.n_slots == BUDGET for e in whole.events)
    *inside, last = half.events
    assert inside[0].plan.n_slots == BUDGET // 2  # the rest of the prompt was long: half the budget
    assert all(BUDGET // 2 <= e.plan.n_slots <= BUDGET for e in inside)
    # the last event inside the prompt left the rest of it room for one chunk: read in one decode, then the
    # event that ends the prompt, which leaves the whole budget with the recent span and the sinks
    assert last.decodes_before - inside[-1].decodes_before == 1
    assert last.plan.n_slots == half.live_cells() == BUDGET and half.n_past == N_PROMPT
    assert np.all(last.plan.positions[:, :, -WINDOW:] == np.arange(N_PROMPT - WINDOW, N_PROMPT))
    assert np.all(last.plan.positions[:, :, :N_SINK] == np.arange(N_SINK))
    with pytest.raises(UsageError, match="low_water"):
        Engine(smollm2_model, BUDGET, "criticalkv", max_tokens=N_PROMPT, low_water=0)
    # the default: LOW_WATER where a recall tier keeps what the events drop, the whole budget without one
    assert LOW_WATER < 1
    for recall, low in ((True, LOW_WATER), (False, 1.0)):
        eng = Engine(smollm2_model, BUDGET, "criticalkv", max_tokens=N_PROMPT, recall=recall, n_threads=THREADS)
        assert eng.cfg.low_water == low


def test_append_after_decoding_with_a_longer_probe(smollm2_model, text_tokens):
    """A chat: a turn scored by a short probe, a reply, then the next turn with a longer probe (each chat
    turn's own tokens are its probe, at most ``window`` of them). Whatever the reply left in the cache,
    the next turn's probe must fit. The reply stops at the first state where a full-length probe would
    not (if decoding ever lets the cache get there)."""
    eng = Engine(smollm2_model, 160, "criticalkv", max_tokens=1000, chunk=CHUNK, recent=WINDOW, n_threads=THREADS)
    eng.prefill(text_tokens[:300], probe=None)  # the query-agnostic probe
    assert len(eng.model.tokenize(AGNOSTIC_PROBE, add_special=False)) < WINDOW
    n_gen = 0
    for _ in eng.generate(eng.ctx.n_ctx - eng.budget_cells, Sampler(), stop_at_eog=False):
        n_gen += 1
        if eng.live_cells() + WINDOW > eng.ctx.n_ctx:
            break
    print(f"reply of {n_gen} tokens leaves {eng.live_cells()} of {eng.ctx.n_ctx} cells live")
    turn = text_tokens[300:340]
    eng.append(turn, probe=turn)  # measured: RuntimeError: llama_decode failed (1): the context of 256 cells ...
    assert eng.n_past == 300 + n_gen + len(turn) and eng.live_cells() <= eng.ctx.n_ctx


# -- 5. budgets and bad input ---------------------------------------------------------------------------


def test_budget_parse_and_floor(smollm2_model):
    assert Budget.parse("0.1") == Budget(ratio=0.1) and Budget.parse("1") == Budget(ratio=1.0)
    assert Budget.parse("2048") == Budget(cells=2048) and Budget.parse(512) == Budget(cells=512)
    for bad in ("0", "-1", "1.5", "abc", "", "nan", "inf", "-0.5", None):
        with pytest.raises(UsageError):
            Budget.parse(bad)
    floor = N_SINK + WINDOW
    assert Budget.parse("36").cells_for(10_000, floor) == 36
    assert Budget.parse("0.001").cells_for(10_000, floor) == floor  # a ratio is raised to the floor
    with pytest.raises(UsageError, match="floor"):
        Budget.parse("20").cells_for(10_000, floor)
    with pytest.raises(UsageError, match="floor"):
        Engine(smollm2_model, 20, max_tokens=1000, recent=WINDOW, n_sink=N_SINK)
    with pytest.raises(UsageError, match="unknown compression method"):
        Engine(smollm2_model, 64, "nope", max_tokens=1000)
    with pytest.raises(UsageError, match="IQ4_NL KV cache is not supported: use f16"):
        Engine(smollm2_model, 64, "criticalkv", max_tokens=1000, type_k=20)  # a type kvlocal cannot rewrite


def kept_jaccard(a: Plan, b: Plan) -> float:
    """Mean over layers and KV heads of |A ∩ B| / |A ∪ B| of the kept source positions."""
    out = []
    for x, y in zip(a.positions.reshape(-1, a.positions.shape[-1]), b.positions.reshape(-1, b.positions.shape[-1])):
        x, y = set(x[x >= 0].tolist()), set(y[y >= 0].tolist())
        out.append(len(x & y) / len(x | y))
    return float(np.mean(out))


@pytest.mark.slow(36)
def test_eviction_on_a_quantized_cache_scores_in_the_rotated_basis(smollm2_model, text_tokens, monkeypatch):
    """A q8_0 K and V cache holds Walsh–Hadamard-rotated rows: scoring them with rotated queries keeps
    nearly the F16 cache's sets (what differs is q8_0's noise); scoring them with the model's own queries
    keeps other tokens. Kept rows are copied as raw bytes; KVSlimmer's merged rows are quantized again."""
    from kvlocal.runtime import kvquant

    tokens = text_tokens[:600]

    def plan_of(method, **types):
        eng = Engine(smollm2_model, 0.2, method, max_tokens=len(tokens) + 8, n_threads=THREADS, **types)
        eng.prefill(tokens, probe=tokens[-WINDOW:])
        reply = list(eng.generate(8))
        assert eng.stats.compression_events >= 2
        return eng, reply

    f16, f16_reply = plan_of("criticalkv")
    q8, q8_reply = plan_of("criticalkv", type_k=8, type_v=8)
    assert q8.basis.k_rot == 64 and q8.stats.kv_bytes_allocated < 0.6 * f16.stats.kv_bytes_allocated
    rotated = kept_jaccard(f16.prompt_plan, q8.prompt_plan)
    monkeypatch.setattr(kvquant.CacheBasis, "queries", lambda self, q: q)  # forget the rotation
    unrotated = kept_jaccard(f16.prompt_plan, plan_of("criticalkv", type_k=8, type_v=8)[0].prompt_plan)
    monkeypatch.undo()
    print(f"kept-set Jaccard with the F16 cache: rotated queries {rotated:.3f}, unrotated {unrotated:.3f}")
    assert rotated > 0.9 and unrotated < rotated - 0.15, (rotated, unrotated)
    assert q8_reply[:3] == f16_reply[:3]

    merged, _ = plan_of("kvslimmer", type_k=8, type_v=8)
    assert (merged.kv.record.count > 1).any()


@pytest.mark.slow(7)
def test_probe_cells_are_removed_after_observation(run):
    eng = run["engine"]
    start = 0
    for e in eng.events:
        # the probe was decoded right after the cache (positions n_past ...) ...
        tail = e.n_past + len(e.probe) - 1
        since = eng.decodes[start:e.decodes_before]
        assert any(d.last_pos == tail and d.first_pos <= e.n_past for d in since), e.n_past
        # ... and gone before the cells were read and scored
        assert len(e.scored_cells) and e.scored_cells.max() < e.n_past
        assert len(np.unique(e.scored_cells)) == len(e.scored_cells)
        start = e.decodes_before
    after = run["after_prefill"]
    assert after["cells"].max() == N_PROMPT - 1 and after["pos_max"] == N_PROMPT - 1
    assert cells(eng).max() == eng.n_past - 1


def test_the_probe_decides_what_is_kept(smollm2_model, text_tokens):
    prompt = text_tokens[:300]
    question = smollm2_model.tokenize(" Who is the narrator, and what does he decide to do about the sea?",
                                      add_special=False)
    agnostic = smollm2_model.tokenize(AGNOSTIC_PROBE, add_special=False)
    plans = {}
    for name, probe in (("question", question), ("agnostic", None)):
        eng = RecordingEngine(smollm2_model, 64, "criticalkv", max_tokens=len(prompt), chunk=CHUNK, recent=WINDOW,
                              n_threads=THREADS)
        eng.prefill(prompt, probe=probe)
        assert eng.events and all(e.probe == (probe or agnostic) for e in eng.events)
        plans[name] = eng.last_plan.positions
    a, b = plans["question"].reshape(-1, 64), plans["agnostic"].reshape(-1, 64)  # [layer * head, slot]
    differ = sum(len(np.setdiff1d(x, y)) for x, y in zip(a, b))
    print(f"question vs agnostic probe: {differ} of {plans['question'].size} kept rows differ")
    assert differ > 0.02 * plans["question"].size


# -- a reporting check ------------------------------------------------------------------------------------


@pytest.mark.slow(17)
def test_full_cache_bytes_are_what_llama_allocates(comparison):
    """``kv_bytes_full`` is documented as "what stock llama.cpp's full cache for max_tokens would
    allocate": for ``--method full`` it is what the context did allocate, less the patched cache's
    attention bias (F32 per cell, KV head and layer)."""
    full = comparison["full"]
    m = full.model
    assert full.ctx.n_ctx == padded(full.cfg.max_tokens)
    assert full.stats.kv_bytes_measured
    bias = full.ctx.n_ctx * m.n_head_kv * 4 * m.n_layer
    assert full.stats.kv_bytes_full == full.stats.kv_bytes_allocated - bias, \
        f"kv_bytes_full counts {full.cfg.max_tokens} cells, llama.cpp allocated {full.ctx.n_ctx}"
