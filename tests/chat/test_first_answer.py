"""The first five minutes: the chat's sampling defaults, the loop guard, and figures that compare honestly.

The loop guard is checked on token sequences (what it must and must not call a loop) and end to end on a real
model's real loop: SmolLM2-135M's greedy answer to "What is the capital of France?" repeats "la femme au martyre"
until the reply's limit — the guard ends it, and with the guard off the same reply runs to the limit."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import assert_usage_error, run_cli

try:
    import httpx
except ImportError:  # as tests/server/test_server.py: the `openai` client's fork with httpx's API
    import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).parents[1] / "reference"))
import tiny_gguf  # noqa: E402

FRANCE = "What is the capital of France?"


# -- the guard on token sequences -------------------------------------------------------------------------
def first_loop(tokens, n=64) -> int | None:
    """The index of the token at which a LoopGuard(n) says "loop", or None."""
    from kvlocal.engine.loops import LoopGuard

    g = LoopGuard(n)
    return next((i for i, t in enumerate(tokens) if g.feed(t)), None)


@pytest.mark.parametrize("span", [1, 3, 7, 16])
def test_a_span_repeated_is_a_loop_once_it_covers_the_guard(span):
    rng = np.random.default_rng(span)
    head = list(rng.integers(1000, 2000, size=40))  # no repeats: random tokens, none equal to the span's
    unit = list(range(span))
    tokens = head + unit * (200 // span)
    at = first_loop(tokens)
    assert at == len(head) + 63, at  # the 64th token of the repetition, not one earlier
    assert first_loop(tokens, 0) is None  # 0: the guard is off


def test_text_that_does_not_repeat_is_never_a_loop():
    rng = np.random.default_rng(0)
    assert first_loop(list(rng.integers(0, 50, size=5000))) is None  # a small vocabulary repeats tokens, not spans
    # a span longer than a quarter of the guard repeats fewer than four times in it: not a loop
    assert first_loop(list(range(20)) * 3) is None
    # nearly a loop: one token in every repetition differs
    assert first_loop([t for i in range(40) for t in (1, 2, 3, 4, 5, i)]) is None


def test_a_guard_that_cannot_work_is_refused():
    from kvlocal.engine.loops import LoopGuard

    for bad in (-1, 3):
        with pytest.raises(ValueError, match="give 0 \\(off\\) or at least 8"):
            LoopGuard(bad)
    assert_usage_error(run_cli("chat", "--loop-guard", "4"), "--loop-guard 4: give 0 (off) or at least 8 tokens")


# -- the guard on a real loop ----------------------------------------------------------------------------
@pytest.mark.slow(20)
def test_the_guard_ends_a_real_loop_and_says_so(smollm2_model):
    from kvlocal import Chat
    from kvlocal.runtime import Sampler

    def ask(guard: int):
        with Chat(smollm2_model, sampler=Sampler(), loop_guard=guard, max_reply=256, n_threads=1) as chat:
            reply = chat.ask(FRANCE)
            return reply, chat.finish_reason, chat.engine.stats.generated_tokens

    looped, finish, n = ask(64)
    assert finish == "loop" and n < 200, (finish, n, looped)
    assert "la femme au martyre, la femme au martyre" in looped
    unguarded, finish_off, n_off = ask(0)  # the negative control: the same greedy reply, to the limit
    assert finish_off == "length" and n_off == 256
    assert unguarded.startswith(looped[:80])


def test_a_reply_the_model_ends_is_stop_and_one_cut_short_is_length(smollm2_model):
    from kvlocal import Chat
    from kvlocal.runtime import Sampler

    with Chat(smollm2_model, sampler=Sampler(), max_reply=256, n_threads=1) as chat:
        chat.ask("What is the capital of Japan?")
        assert chat.finish_reason == "stop"
        chat.ask("Tell me about Tokyo.", max_tokens=4)
        assert chat.finish_reason == "length"


@pytest.mark.slow(4)
def test_the_repl_says_why_a_reply_stopped(smollm2):
    r = run_cli("chat", str(smollm2), "--temp", "0", "--repeat-penalty", "1", "-n", "256", "-t", "1", input=FRANCE + "\n")
    assert r.returncode == 0, r.stderr
    assert "[stopped: the reply kept repeating itself (--loop-guard 64" in r.stderr
    r = run_cli("chat", str(smollm2), "--temp", "0", "--repeat-penalty", "1", "-n", "256", "--loop-guard", "0", "-t", "1",
                input=FRANCE + "\n")
    assert "[stopped at the reply limit of 256 tokens (-n)]" in r.stderr and "repeating" not in r.stderr


# -- sampling defaults ------------------------------------------------------------------------------------
def test_a_chat_samples_by_default_and_a_seed_repeats_it(smollm2_model):
    """Chat's default sampler is the chat defaults (not greedy); the same seed gives the same reply."""
    from kvlocal import Chat
    from kvlocal.runtime import CHAT_SAMPLING, Sampler, chat_sampling

    assert chat_sampling(smollm2_model) == CHAT_SAMPLING  # SmolLM2's file declares no sampling of its own
    assert CHAT_SAMPLING["temp"] > 0
    with Chat(smollm2_model, max_reply=24, n_threads=1) as chat:
        assert chat.sampler.temp == CHAT_SAMPLING["temp"] and chat.sampler.seed is None

    def reply(seed):
        with Chat(smollm2_model, sampler=Sampler(**CHAT_SAMPLING, seed=seed), max_reply=24, n_threads=1) as chat:
            return chat.ask("Write one sentence about the sea.")

    a = reply(5)
    assert a == reply(5)
    assert {a, reply(6), reply(7)} != {a}  # other seeds, another reply (three draws: one may repeat)


def test_the_sampling_a_gguf_declares_is_the_chat_default(tmp_path):
    from kvlocal.runtime import CHAT_SAMPLING, Model, chat_sampling

    src = tiny_gguf.write_tiny(tmp_path / "plain.gguf")
    declared = tiny_gguf.rewrite_gguf(src, tmp_path / "declared.gguf", meta={
        "general.sampling.temp": (0.3, gguf.GGUFValueType.FLOAT32),
        "general.sampling.top_k": (20, gguf.GGUFValueType.INT32),
        "general.sampling.penalty_repeat": (1.0, gguf.GGUFValueType.FLOAT32),
        "general.sampling.top_p": (7.5, gguf.GGUFValueType.FLOAT32),  # out of range: ignored
    })
    m = Model(declared)
    try:
        got = chat_sampling(m)
    finally:
        m.close()
    assert got["temp"] == pytest.approx(0.3) and got["top_k"] == 20 and got["repeat_penalty"] == 1.0
    assert got["top_p"] == CHAT_SAMPLING["top_p"] and got["min_p"] == CHAT_SAMPLING["min_p"]


def test_run_stays_greedy_and_chat_takes_temp_0_as_greedy(smollm2, tmp_path):
    """`kvlocal run` is greedy by default (two runs, one text); `kvlocal chat --temp 0 --repeat-penalty 1` gives run's
    reply (--temp 0 alone keeps the chat's repeat penalty, as llama.cpp's tools do)."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("Name three colours.")

    def run():
        r = run_cli("run", str(smollm2), "--prompt-file", str(prompt), "--chat", "-n", "16", "--json", "-t", "1")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["text"]

    text = run()
    assert text == run()
    r = run_cli("chat", str(smollm2), "--temp", "0", "--repeat-penalty", "1", "-n", "16", "-t", "1",
                input="Name three colours.\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == text.strip()
    assert "greedy" in r.stderr.splitlines()[0]  # the banner says how it samples


# -- honest figures ---------------------------------------------------------------------------------------
STATUS = re.compile(r"KV ([\d,]+) of ([\d,]+) tokens kept in ([\d.,]+) MiB \(llama\.cpp's cache at -c (\d+): ([\d.,]+) MiB\)")


def test_the_status_line_compares_with_llama_cpp_s_cache_for_the_same_context(smollm2):
    """A short chat: the compressed cache is smaller than llama.cpp's for the same -c (it used to be compared with a
    full cache for the few tokens seen, which made compression look like a loss); --method full is llama.cpp's own
    size (the patched cache's bias aside). The banner says the same in one line."""
    r = run_cli("chat", str(smollm2), "--temp", "0", "-n", "8", "-c", "4096", "-t", "1", input="Hello!\n")
    assert r.returncode == 0, r.stderr
    banner = r.stderr.splitlines()[0]
    assert re.search(r"budget 0\.1: 410 tokens in [\d.]+ MiB \(llama\.cpp's cache at -c 4096: 90 MiB\) · criticalkv, "
                     r"recall on, state backend · greedy", banner), banner
    kept, seen, mib, ctx, full = STATUS.search(r.stderr).groups()
    assert kept == seen and int(ctx) == 4096 and float(full) == 90 and float(mib) < float(full) / 3
    r = run_cli("chat", str(smollm2), "--method", "full", "--temp", "0", "-n", "8", "-c", "4096", "-t", "1",
                input="Hello!\n")
    *_, mib, ctx, full = STATUS.search(r.stderr).groups()
    assert float(full) <= float(mib) < 1.1 * float(full)
    assert "· no budget (--method full): 4,096 tokens in" in r.stderr.splitlines()[0]


def test_the_same_figures_under_the_same_names(smollm2, smollm2_model, tmp_path):
    """`/stats`, `kvlocal run --json` and the server's kv object name the cache's figures alike."""
    from kvlocal import Chat
    from kvlocal.runtime import Sampler

    names = ("tokens_seen", "tokens_kept", "budget_cells", "ctx_size", "kv_bytes", "kv_bytes_full", "host_tier_bytes",
             "host_tier_cap", "host_tier_cap_used", "host_tier_past_cap", "host_tier_file_bytes", "host_tier_dropped_rows")
    with Chat(smollm2_model, sampler=Sampler(), max_reply=8, n_threads=1, ctx_size=2048) as chat:
        chat.ask("Hello!")
        f = chat.engine.kv_figures()
        s = chat.stats
    assert tuple(f) == names
    assert (f["tokens_seen"], f["tokens_kept"], f["kv_bytes"], f["kv_bytes_full"], f["ctx_size"]) == (
        s.tokens_seen, s.kv_tokens_kept, s.kv_bytes, s.kv_bytes_full, s.ctx_size) and f["ctx_size"] == 2048

    r = run_cli("chat", str(smollm2), "--temp", "0", "-n", "8", "-t", "1", input="Hello!\n/stats\n")
    for name in names[:8]:  # (the cap's row says what it holds, what happens past it and how much did)
        assert re.search(rf"^  {name} +\S", r.stderr, re.MULTILINE), (name, r.stderr)

    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello!")
    r = run_cli("run", str(smollm2), "--prompt-file", str(prompt), "-n", "4", "--json", "-t", "1")
    out = json.loads(r.stdout)
    assert set(names) <= set(out) and out["ctx_size"] == out["prompt_tokens"] + 4  # run sizes for prompt + -n

    from serving import in_process_server

    with in_process_server(smollm2_model, "smollm2") as (url, _):
        kv = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                        json={"messages": [{"role": "user", "content": "Hello!"}], "temperature": 0}).json()["kv"]
    assert set(names) <= set(kv) and kv["tokens_seen"] > 0 and kv["kv_bytes_full"] > kv["kv_bytes"]


def test_the_server_says_loop_when_the_guard_ends_a_reply(smollm2_model):
    from serving import in_process_server

    with in_process_server(smollm2_model, "smollm2", max_tokens=256, loop_guard=64) as (url, _):
        body = {"messages": [{"role": "user", "content": FRANCE}], "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json=body).json()
        assert r["choices"][0]["finish_reason"] == "loop" and r["usage"]["completion_tokens"] < 200
        o = httpx.post(f"{url}/api/chat", timeout=300, json={**body, "model": "smollm2", "stream": False,
                                                              "options": {"temperature": 0}}).json()
        assert o["done_reason"] == "loop"
