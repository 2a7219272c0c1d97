"""`kvlocal serve`: real HTTP on a loopback port, the real llama.cpp on smollm2-135m.

One server process serves the module (budget 256 cells); a second one checks --api-key, a third the
warning for a public address and Ctrl-C. What needs the worker's inside runs an in-process server (the
same app on uvicorn, on a thread): the failure path (an exception inside generation), /health and a
second client while a reply is held mid-way, and a client that leaves while its long message is read.
Waits are bounded by WAIT seconds; no test asserts a duration (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO
from policy import need
from serving import in_process_server

try:
    import httpx
except ImportError:  # huggingface_hub's and the `openai` client's HTTP library (a fork with httpx's API)
    import httpx2 as httpx

MODEL = "smollm2-135m"
WAIT = 120  # the bound on every wait for the server (seconds); never an assertion on how long something took
GERMANY = [{"role": "user", "content": "What is the capital of Germany?"}]
JAPAN = [{"role": "user", "content": "What is the capital of Japan?"}]


def _serve_command() -> list[str]:
    """`python -m kvlocal serve`, or `python -m kvlocal.server` while the CLI does not list the command yet."""
    import argparse

    from kvlocal.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    if "serve" in sub.choices:
        return [sys.executable, "-m", "kvlocal", "serve"]
    return [sys.executable, "-m", "kvlocal.server"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KVLOCAL_API_KEY"}  # the key is a test's own choice
    return {**env, "PYTHONUNBUFFERED": "1"}


class Server:
    """A `kvlocal serve` subprocess; its stderr goes to a file (read by the tests, never a full pipe)."""

    def __init__(self, log: Path, *args: str, preexec_fn=None, greedy: bool = True):
        """``greedy``: the server's default sampling is greedy (``--temp 0 --repeat-penalty 1``), so that replies
        can be compared; False: the server's own defaults."""
        self.log_path = log
        self._log = open(log, "w")
        args = ("--temp", "0", "--repeat-penalty", "1", *args) if greedy else args
        self.proc = subprocess.Popen([*_serve_command(), MODEL, *args], stdout=subprocess.DEVNULL, stderr=self._log,
                                     cwd=REPO, env=_env(), preexec_fn=preexec_fn)
        self.url = self._wait_for_url()
        self.port = int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_log(self, *fragments: str, timeout: float = 30) -> str:
        """The log once it holds every fragment (a request's line is written after its reply is sent)."""
        t0 = time.time()
        while not all(f in (log := self.log()) for f in fragments):
            assert time.time() - t0 < timeout, f"not in the server's log after {timeout} s: {fragments}\n{log}"
            time.sleep(0.1)
        return log

    def _wait_for_url(self, timeout: float = 180) -> str:
        t0 = time.time()
        while time.time() - t0 < timeout:
            m = re.search(r"· (http://\S+:\d+) ", self.log())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"the server did not start in {timeout} s:\n{self.log()}")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self, sig=signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve") / "stderr.txt", "--budget", "256", "--port", "0")
    assert s.health()["status"] == "ok"
    yield s
    s.stop()


def _url(server) -> str:
    """The base URL of a Server, or the URL itself (the in-process server)."""
    return server if isinstance(server, str) else server.url


def chat(server, messages, timeout=300, **params) -> dict:
    r = httpx.post(_url(server) + "/v1/chat/completions", json={"messages": messages, **params}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(server, messages, on_event=None, **params) -> list[dict]:
    """The SSE events of a streamed completion, as JSON; the last one is the string "[DONE]".
    ``on_event(event)`` is called with each as it arrives."""
    events = []
    with httpx.stream("POST", _url(server) + "/v1/chat/completions", json={"messages": messages, "stream": True, **params},
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if on_event is not None:
                    on_event(events[-1])
    return events


def streamed_text(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])


def assert_error(r, status: int, param=None, fragment: str = ""):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert err["param"] == param, err
    assert fragment in err["message"], err
    return err


# -- the API ------------------------------------------------------------------------------------------------
def test_health_and_models(server):
    from kvlocal.recall import default_recall_mem

    h = server.health()
    assert h["model"] == MODEL and h["method"] == "criticalkv" and h["budget"] == "256"
    assert h["host_tier_cap"] == default_recall_mem() and 0 <= h["host_tier_cap_used"] <= h["host_tier_cap"]
    r = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert r["object"] == "list" and [m["id"] for m in r["data"]] == [MODEL]


def test_completion(server):
    r = chat(server, GERMANY, max_tokens=24)
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-") and r["model"] == MODEL
    choice = r["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert "Berlin" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    u = r["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and 10 < u["prompt_tokens"] < 100
    kv = r["kv"]
    assert set(kv) >= {"tokens_kept", "tokens_seen", "kv_bytes", "kv_bytes_full", "ctx_size", "method", "budget",
                       "cache_reused", "compression_events"}
    assert kv["method"] == "criticalkv" and kv["budget"] == "256" and kv["cache_reused"] is False
    # the cache also holds the end-of-generation token that ended the reply (not a completion token)
    assert kv["tokens_seen"] == u["total_tokens"] + 1 and 0 < kv["kv_bytes"] < kv["kv_bytes_full"]


def test_max_tokens_and_stop_strings(server):
    r = chat(server, GERMANY, max_tokens=3, cache_prompt=False)
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 3
    r = chat(server, GERMANY, max_completion_tokens=24, stop=["Berlin", "Paris"], cache_prompt=False)
    text = r["choices"][0]["message"]["content"]
    assert r["choices"][0]["finish_reason"] == "stop"
    assert "capital" in text and "Berlin" not in text, text  # the model says "The capital of Germany is Berlin."
    events = chat_stream(server, GERMANY, max_tokens=24, stop="Berlin", cache_prompt=False)
    assert streamed_text(events) == text  # a stop string's beginning is held back, never streamed
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_greedy_stream_equals_non_stream(server):
    plain = chat(server, JAPAN, max_tokens=24, temperature=0)
    text = plain["choices"][0]["message"]["content"]
    assert "Tokyo" in text
    for reuse in (False, True):  # a fresh chat; then the cached one, taken back to before its reply
        events = chat_stream(server, JAPAN, max_tokens=24, temperature=0, cache_prompt=reuse,
                             stream_options={"include_usage": True})
        assert events[-1] == "[DONE]"
        first, finish, usage = events[0], events[-3], events[-2]
        assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
        assert streamed_text(events) == text
        assert finish["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
        assert "kv" in finish
        assert usage["choices"] == [] and usage["usage"] == plain["usage"]
        assert len({e["id"] for e in events[:-1]}) == 1


def test_openai_client(server):
    openai = need("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    r = client.chat.completions.create(model=MODEL, messages=GERMANY, max_tokens=24, temperature=0)
    assert "Berlin" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0
    assert r.model_extra["kv"]["method"] == "criticalkv"
    pieces, finish, usage = [], None, None
    for c in client.chat.completions.create(model="anything", messages=JAPAN, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}):
        if c.choices:
            pieces.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
        if c.usage:
            usage = c.usage
    assert "Tokyo" in "".join(pieces) and finish == "stop" and usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=GERMANY, top_p=0.0)
    assert e.value.status_code == 400 and "top_p" in str(e.value)


def test_ollama_client(server):
    """Ollama's API through the official `ollama` client: chat (streamed and not), generate, list, show;
    a follow-up chat reuses the conversation's cache as an OpenAI one does; what it cannot do is a 400."""
    ollama = need("ollama")
    client = ollama.Client(host=server.url, timeout=WAIT)
    assert [m.model for m in client.list().models] == [MODEL]
    shown = client.show(MODEL)
    assert shown.details.format == "gguf" and shown.modelinfo["context_length"] == 8192
    r = client.chat(model=MODEL, messages=GERMANY, options={"temperature": 0, "num_predict": 24}, stream=False)
    assert "Berlin" in r.message.content and r.done and r.done_reason == "stop" and r.eval_count > 0
    follow = GERMANY + [{"role": "assistant", "content": r.message.content}, {"role": "user", "content": "And of France?"}]
    parts = list(client.chat(model=MODEL, messages=follow, options={"temperature": 0, "num_predict": 24}, stream=True))
    paris = "".join(p.message.content for p in parts)
    assert "Paris" in paris and parts[-1].done and not any(p.done for p in parts[:-1])
    # the client keeps only Ollama's fields; the raw reply also has kvlocal's kv: the conversation's cache was reused
    more = follow + [{"role": "assistant", "content": paris}, {"role": "user", "content": "And of Italy?"}]
    raw = httpx.post(server.url + "/api/chat", json={"model": MODEL, "messages": more, "stream": False,
                                                     "options": {"temperature": 0, "num_predict": 24}}, timeout=WAIT).json()
    assert "Rome" in raw["message"]["content"] and raw["kv"]["cache_reused"] is True and raw["kv"]["method"] == "criticalkv"
    g = client.generate(model=MODEL, prompt="What is the capital of Japan?", options={"temperature": 0, "num_predict": 24})
    assert "Tokyo" in g.response and g.done and g.prompt_eval_count > 0
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "What is this?", "images": ["aGk="]}])
    assert e.value.status_code == 400 and "text-only" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="hi", format="json")
    assert e.value.status_code == 400 and "format" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3:8b")
    assert e.value.status_code == 404 and "not found" in e.value.error


def test_a_request_may_choose_its_cache_settings(server):
    """The kv extension object: this conversation's budget, method and recall instead of the server's; a
    conversation is continued only with the settings it was started with."""
    own = {"budget": 64, "method": "streaming", "recall": False}
    r = chat(server, GERMANY, max_tokens=8, temperature=0, kv=own)
    assert (r["kv"]["budget"], r["kv"]["budget_cells"], r["kv"]["method"]) == ("64", 64, "streaming")
    assert r["kv"]["host_tier_bytes"] == 0  # recall off
    follow = GERMANY + [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "And of France?"}]
    again = chat(server, follow, max_tokens=8, temperature=0, kv=own)
    assert again["kv"]["cache_from"] == "memory" and again["kv"]["method"] == "streaming"
    default = chat(server, follow, max_tokens=8, temperature=0)
    assert default["kv"]["cache_from"] == "read" and default["kv"]["method"] == "criticalkv"
    url = server.url + "/v1/chat/completions"
    for kv, param in (({"method": "nope"}, "kv.method"), ({"size": 1}, "kv.size"), ({"budget": "lots"}, "kv.budget"),
                      ({"recall": "yes"}, "kv.recall"), ("64", "kv")):
        assert_error(httpx.post(url, json={"messages": GERMANY, "kv": kv}, timeout=60), 400, param)


def test_a_bad_setting_is_worded_as_the_request_names_it(server):
    """An API client reads a bad setting by its JSON path, never by the command line's flag: refused while the
    request is parsed (``kv.budget 'lots' is not a number``), and refused by the engine, once the model is known
    (a budget below the floor of the sinks and the recent span)."""
    url = server.url + "/v1/chat/completions"
    err = assert_error(httpx.post(url, json={"messages": GERMANY, "kv": {"budget": "lots"}}, timeout=60), 400,
                       "kv.budget", "kv.budget 'lots' is not a number: give a ratio")
    assert "--" not in err["message"], err
    err = assert_error(httpx.post(url, json={"messages": GERMANY, "kv": {"budget": 10}}, timeout=60), 400, "kv.budget",
                       "kv.budget 10 is below the floor")
    assert "--" not in err["message"], err


def test_bad_requests_then_serving_on(server):
    url = server.url + "/v1/chat/completions"
    post = lambda body: httpx.post(url, content=body if isinstance(body, str) else json.dumps(body), timeout=60)  # noqa: E731
    assert_error(post("{not json"), 400, None, "not valid JSON")
    assert_error(post("[1, 2]"), 400, None, "JSON object")
    assert_error(post({}), 400, "messages", "required")
    assert_error(post({"messages": []}), 400, "messages")
    assert_error(post({"messages": [{"role": "assistant", "content": "Hi"}]}), 400, "messages[0].role", "comes user")
    assert_error(post({"messages": GERMANY + [{"role": "assistant", "content": "Berlin."}]}), 400, "messages", "last message")
    assert_error(post({"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "x"}]}), 400,
                 "messages[1].role", "only come first")
    assert_error(post({"messages": [{"role": "tool", "content": "x"}]}), 400, "messages[0].role")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert_error(post({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]}),
                 400, "messages[0].content[1].type", "text-only")
    assert_error(post({"messages": GERMANY, "temperature": -1}), 400, "temperature", ">= 0")
    assert_error(post({"messages": GERMANY, "top_p": 1.5}), 400, "top_p")
    assert_error(post({"messages": GERMANY, "temperature": "hot"}), 400, "temperature", "a number")
    assert_error(post({"messages": GERMANY, "max_tokens": 0}), 400, "max_tokens")
    assert_error(post({"messages": GERMANY, "n": 2}), 400, "n")
    assert_error(post({"messages": GERMANY, "stop": [""]}), 400, "stop")
    assert_error(post({"messages": [{"role": "user", "content": "   "}]}), 400, "messages[0].content", "empty")
    r = httpx.get(server.url + "/v1/nope", timeout=10)
    assert_error(r, 404, None, "/v1/nope")
    assert_error(httpx.get(url, timeout=10), 405, None)
    # text parts are joined; the server is still fine after all that
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of Germany?"}]
    r = chat(server, [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": parts}],
             max_tokens=24)
    assert "Berlin" in r["choices"][0]["message"]["content"]


def test_plain_completions(server):
    """/v1/completions: a prompt without the chat template, streamed and not (greedy: the same text); a prompt
    that goes on from an earlier prompt and its completion reads only the rest; echo; the openai client."""
    openai = need("openai")
    url = server.url + "/v1/completions"
    prompt = "The capital of France is"
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url, json=body, timeout=WAIT).json()
    text = r["choices"][0]["text"]
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and "Paris" in text, r
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 8
    assert r["kv"]["cache_reused"] is False and r["kv"]["method"] == "criticalkv"
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=WAIT) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert "".join(e["choices"][0]["text"] for e in events) == text and events[-1]["choices"][0]["finish_reason"] == "length"
    more = prompt + text + " The capital of Germany is"
    r2 = httpx.post(url, json={**body, "prompt": more}, timeout=WAIT).json()
    assert r2["kv"]["cache_reused"] is True and r2["kv"]["tokens_reused"] >= 13  # the prompt and completion before
    assert r2["usage"]["prompt_tokens"] < 10 and "Berlin" in r2["choices"][0]["text"], r2
    r3 = httpx.post(url, json={**body, "echo": True}, timeout=WAIT).json()
    assert r3["choices"][0]["text"] == prompt + text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert c.choices[0].text == text
    for bad, param in (({"max_tokens": 4}, "prompt"), ({"prompt": [1, 2, 3]}, "prompt"), ({"prompt": "x", "suffix": "y"}, "suffix"),
                       ({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "best_of": 3}, "best_of")):
        assert_error(httpx.post(url, json=bad, timeout=WAIT), 400, param)


def timed_pair(server, messages) -> list[tuple[dict, float]]:
    """The reply to ``messages`` continuing the server's cached conversation, then read fresh, each with its
    wall time (printed by the tests, never asserted)."""
    out = []
    for reuse in (True, False):
        t = time.perf_counter()
        out.append((chat(server, messages, max_tokens=8, cache_prompt=reuse), time.perf_counter() - t))
    return out


@pytest.mark.slow(56)
def test_follow_up_reuses_the_compressed_cache(server):
    prose = (REPO / "kvlocal/data/sample.txt").read_text() + "\n" + (REPO / "kvlocal/data/gpl-3.0.txt").read_text()[:4000]
    first = [{"role": "user", "content": prose + "\n\nWho is speaking in the first dialogue of the text above?"}]
    r1 = chat(server, first, max_tokens=8)
    assert r1["usage"]["prompt_tokens"] > 1800 and r1["kv"]["cache_reused"] is False
    assert r1["kv"]["tokens_kept"] < r1["kv"]["tokens_seen"] and r1["kv"]["compression_events"] > 0
    follow = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "Which license is quoted at the end?"}]
    (reused, t_reused), (fresh, t_fresh) = timed_pair(server, follow)
    n1, n_reused, n_fresh = (x["usage"]["prompt_tokens"] for x in (r1, reused, fresh))
    # measured, not asserted (docs/server.md quotes it): the assertions below are on tokens
    print(f"\nfollow-up to a {n1}-token message: {t_reused:.2f} s reusing the compressed cache ({n_reused} prompt "
          f"tokens read), {t_fresh:.2f} s as a fresh conversation ({n_fresh} prompt tokens read)")
    # the server says how it found each conversation: the follow-up continued the cached one, the other did not
    assert reused["kv"]["cache_reused"] is True and fresh["kv"]["cache_reused"] is False
    assert reused["kv"]["tokens_reused"] == r1["kv"]["tokens_seen"] and fresh["kv"]["tokens_reused"] == 0
    server.wait_log(f"continue · {n_reused:,} prompt + ", f"new · {n_fresh:,} prompt + ")
    # what it decoded was the new message only: the fresh read is the first request's prompt, the reply and
    # the same new message; the reused read left out the first two
    history = n_fresh - n_reused - n1  # the reply as the fresh read tokenizes it
    assert 0 < history <= r1["usage"]["completion_tokens"] + 2, (n1, n_reused, n_fresh, r1["usage"])
    assert n_reused * 10 < n_fresh
    assert reused["kv"]["tokens_seen"] == r1["kv"]["tokens_seen"] + reused["usage"]["total_tokens"]


@pytest.mark.slow(39)
def test_conversations_survive_a_restart(smollm2, tmp_path):
    """--session-dir: a conversation continues from its saved cache after the server restarts (reading only
    the new message); a damaged file is skipped with a warning and that conversation is read fresh."""
    folder = tmp_path / "sessions"
    folder.mkdir()
    args = ("--budget", "256", "--port", "0", "--session-dir", str(folder))
    prose = (REPO / "kvlocal/data/sample.txt").read_text()
    doc = [{"role": "user", "content": prose + "\n\nWho is speaking in the first dialogue of the text above?"}]
    server = Server(tmp_path / "first.txt", *args)
    try:
        r1 = chat(server, doc, max_tokens=8)
        r2 = chat(server, JAPAN, max_tokens=8)
    finally:
        assert server.stop() == 0
    files = sorted(folder.glob("*.kvl"), key=lambda p: p.stat().st_mtime)
    assert len(files) == 2 and r1["kv"]["cache_from"] == "read"
    files[1].write_bytes(files[1].read_bytes()[:-100])  # the Japan conversation's file, damaged

    server = Server(tmp_path / "second.txt", *args)
    try:
        follow = doc + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "Who is Mr. Bennet's wife?"}]
        (restored, t_restored), (fresh, t_fresh) = timed_pair(server, follow)
        assert restored["kv"]["cache_from"] == "session_dir" and fresh["kv"]["cache_from"] == "read"
        assert restored["kv"]["tokens_reused"] == r1["kv"]["tokens_seen"]
        assert restored["usage"]["prompt_tokens"] * 10 < fresh["usage"]["prompt_tokens"]
        # measured, not asserted (docs/server.md quotes it)
        print(f"\nafter a restart, a follow-up to a {r1['usage']['prompt_tokens']}-token message: {t_restored:.2f} s "
              f"from the session folder, {t_fresh:.2f} s reading it again ({t_fresh / t_restored:.1f}x); "
              f"session file {files[0].stat().st_size / 2**20:.1f} MiB")
        japan = chat(server, JAPAN + [{"role": "assistant", "content": r2["choices"][0]["message"]["content"]},
                                      {"role": "user", "content": "And of Italy?"}], max_tokens=8)
        assert japan["kv"]["cache_from"] == "read"  # its file was damaged: read fresh, with a warning
        server.wait_log("warning: skipped", "serving on")
    finally:
        server.stop()


def test_a_restart_with_other_settings_reads_saved_conversations_afresh(smollm2_model, tmp_path, capsys):
    """--session-dir, the worker restarted with another cache setting (--recall, --backend, --low-water,
    --pin-system: settings the by-hand comparison once left out): a saved conversation is not continued under
    settings its cache was not made with — it is read afresh, with one warning naming the setting. Restarted
    with its own settings, the same file is restored (so the refusals above are the settings', not the file's)."""
    from kvlocal.runtime import Sampler
    from kvlocal.server.store import ChatStore
    from kvlocal.server.worker import Job, Worker

    folder = tmp_path / "sessions"
    folder.mkdir()
    server = dict(budget="256", method="criticalkv", ctx_size=0, chunk=128, recent=32, cache_type_k="f16",
                  cache_type_v="f16", n_threads=1)  # as `kvlocal serve` gives them; the rest: Chat's defaults

    def reply(messages, **changed):
        """The Result of one request on a newly started worker over ``folder`` (a restart)."""
        worker = Worker(smollm2_model, MODEL, chat_options={**server, **changed}, defaults={},
                        store=ChatStore(folder, 1 << 30))
        try:
            return worker.submit(Job(messages, Sampler(), max_tokens=4)).result(timeout=WAIT)
        finally:
            worker.close()

    first = reply(GERMANY)
    follow = GERMANY + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of France?"}]
    capsys.readouterr()
    for name, value in [("recall", False), ("backend", "state"), ("low_water", 0.5), ("pin_system", False)]:
        r = reply(follow, **{name: value})
        warnings = [ln for ln in capsys.readouterr().err.splitlines() if "saved with other settings" in ln]
        assert (r.mode, r.kv["cache_from"]) == ("new", "read"), f"restored under another {name}"
        assert len(warnings) == 1 and name in warnings[0], warnings
    r = reply(follow)
    assert (r.mode, r.kv["cache_from"]) == ("restored", "session_dir")
    assert "saved with other settings" not in capsys.readouterr().err


def test_a_full_disk_while_saving_is_a_warning(smollm2, tmp_path):
    """A session file that cannot be written (a file-size limit stands in for a full disk): a warning, no
    partial file left, the reply sent and the server serving on."""
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill, as a full disk gives ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    folder = tmp_path / "sessions"
    folder.mkdir()
    server = Server(tmp_path / "log.txt", "--budget", "256", "--port", "0", "--session-dir", str(folder),
                    preexec_fn=limit)
    try:
        assert "Berlin" in chat(server, GERMANY, max_tokens=16, temperature=0)["choices"][0]["message"]["content"]
        server.wait_log("warning: could not save the conversation", "serving on")
        assert list(folder.iterdir()) == []  # nothing half-written
        assert "Tokyo" in chat(server, JAPAN, max_tokens=16, temperature=0)["choices"][0]["message"]["content"]
    finally:
        server.stop()


def test_client_leaving_mid_stream_stops_the_reply(server):
    story = [{"role": "user", "content": "Write a very long story about a dragon who lives in a castle by the sea."}]
    before = server.health()["served"]
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={"messages": story, "stream": True, "max_tokens": 400, "cache_prompt": False}, timeout=120) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 4:
                break  # leaving the block closes the connection
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        h = server.health()
        if h["served"] > before and not h["busy"]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the reply did not end within {WAIT} s after the client left: {h}")
    line = [ln for ln in server.wait_log(" cancelled ").splitlines() if " cancelled " in ln][-1]
    completion = int(re.search(r"\+ (\d+) completion", line).group(1))
    assert completion < 400, line
    # the conversation stays cached with its partial reply; the server goes on
    assert "Berlin" in chat(server, GERMANY, max_tokens=24)["choices"][0]["message"]["content"]


def test_startup_usage_errors(server, tmp_path):
    def fails(*args, fragment: str):
        r = subprocess.run([*_serve_command(), *args], capture_output=True, text=True, timeout=120, cwd=REPO, env=_env())
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("kvlocal: error: ") and fragment in lines[0], r.stderr

    fails(MODEL, "--port", "70000", fragment="--port 70000")
    fails(MODEL, "--port", str(server.port), fragment="in use")
    fails(str(tmp_path / "missing.gguf"), "--port", "0", fragment="no such file")
    fails(MODEL, "--port", "0", "--budget", "abc", fragment="--budget")
    fails(MODEL, "--port", "0", "--session-dir", str(tmp_path / "nope"), fragment="--session-dir")
    fails(MODEL, "--port", "0", "--session-dir", str(tmp_path), "--session-max", "lots", fragment="--session-max")


def test_api_key(smollm2, tmp_path):
    s = Server(tmp_path / "stderr.txt", "--budget", "256", "--port", "0", "--api-key", "sesame", greedy=False)
    try:
        # the server's own sampling: the chat defaults (SmolLM2's file declares none), said at start
        assert "sampling temp 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.1, random seed" in s.log()
        url = s.url + "/v1/chat/completions"
        body = {"messages": GERMANY, "max_tokens": 8}
        assert_error(httpx.post(url, json=body, timeout=30), 401, None, "missing API key")
        assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}, timeout=30), 401, None)
        assert_error(httpx.get(s.url + "/v1/models", timeout=30), 401, None)
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer sesame"}, timeout=300)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert "warning" not in s.log()
        openai = need("openai")  # the checks above do not need it
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        s.stop()


def test_public_address_warns_and_ctrl_c_stops_cleanly(smollm2, tmp_path):
    s = Server(tmp_path / "stderr.txt", "--budget", "256", "--host", "0.0.0.0", "--port", "0")
    try:
        assert "warning: listening on 0.0.0.0 without --api-key" in s.log()
        assert httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=30).json()["status"] == "ok"
    finally:
        code = s.stop(signal.SIGINT)
    assert code == 0, s.log()
    assert "Traceback" not in s.log() and s.log().rstrip().endswith("kvlocal serve: stopped")


# -- in process: the worker's inside, the failure path and the pieces ---------------------------------------
@pytest.fixture
def in_process(smollm2_model):
    """An app on a Worker in this process, served by uvicorn on a thread; yields (url, worker)."""
    with in_process_server(smollm2_model, MODEL, budget="256") as served:
        yield served


def test_two_clients_at_once_and_health_stays_free(in_process):
    """While the worker is in the middle of a reply (held after its first piece), /health answers, the piece
    already made reaches its client, and a second client's request waits in the queue; released, both
    replies complete, one after the other. The event loop is not the worker."""
    url, worker = in_process
    make = worker.new_chat
    held, release = threading.Event(), threading.Event()

    def held_chat(system, options=None, tools=None):  # the first reply stops after its first piece until released
        chat = make(system, options, tools)
        send = chat.send

        def send_held(new, max_tokens=None, progress=None, tool_choice="auto"):
            for piece in send(new, max_tokens, progress, tool_choice):
                yield piece
                if not held.is_set():
                    held.set()
                    release.wait(WAIT)

        chat.send = send_held
        return chat

    worker.new_chat = held_chat
    first_piece = threading.Event()

    def on_event(e):
        if e != "[DONE]" and e["choices"] and e["choices"][0]["delta"].get("content"):
            first_piece.set()

    try:
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(chat_stream, url, JAPAN, on_event=on_event, max_tokens=32)
            assert held.wait(WAIT), "the first reply never began"
            h = httpx.get(url + "/health", timeout=WAIT).json()
            assert h["busy"] is True and h["served"] == 0 and h["queued"] == 0, h  # answered mid-reply
            assert first_piece.wait(WAIT), "the piece made before the hold never reached the streaming client"
            b = pool.submit(chat, url, GERMANY, max_tokens=32)
            deadline = time.monotonic() + WAIT
            while h["queued"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
                h = httpx.get(url + "/health", timeout=WAIT).json()
            assert h["busy"] is True and h["queued"] == 1 and h["served"] == 0, h  # the second client waits
            assert not a.done() and not b.done()
            release.set()
            japan, germany = a.result(WAIT), b.result(WAIT)
    finally:
        release.set()
    assert "Tokyo" in streamed_text(japan)
    assert "Berlin" in germany["choices"][0]["message"]["content"]
    h = httpx.get(url + "/health", timeout=WAIT).json()
    assert h["served"] == 2 and h["queued"] == 0 and h["busy"] is False, h


def test_client_leaving_during_a_long_read_keeps_the_conversation(in_process):
    """A follow-up whose new message is long, abandoned by its client while the server reads it: the read
    stops at the next chunk boundary, the conversation stays cached as it was, and the next follow-up
    reuses it. The read is held after its first chunk until the server has seen the client go, so what
    is counted does not depend on the machine's speed."""
    url, worker = in_process
    make, submit = worker.new_chat, worker.submit
    jobs, chunks, armed, reading = [], [], threading.Event(), threading.Event()
    noticed = []  # whether the server had marked the job cancelled when the read reached its next chunk

    def tracked_chat(system, options=None, tools=None):  # records a read's chunks once armed, holds it after the first
        chat = make(system, options, tools)
        send = chat.send

        def send_tracked(new, max_tokens=None, progress=None, tool_choice="auto"):
            def hook(done, total):
                if armed.is_set():
                    chunks.append((done, total))
                    if len(chunks) == 1:
                        reading.set()
                        noticed.append(jobs[-1].cancelled.wait(WAIT))
                if progress is not None:
                    progress(done, total)  # the server's own check: raises once the client is gone
            return send(new, max_tokens, hook, tool_choice)

        chat.send = send_tracked
        return chat

    def submit_tracked(job):
        jobs.append(job)
        return submit(job)

    worker.new_chat, worker.submit = tracked_chat, submit_tracked
    first = [{"role": "user", "content": "Remember the word 'lighthouse'. Say OK."}]
    r1 = chat(url, first, max_tokens=4)
    base = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]}]
    long_message = (REPO / "kvlocal/data/gpl-3.0.txt").read_text()[:9000] + "\n\nSummarize this."
    body = json.dumps({"messages": base + [{"role": "user", "content": long_message}], "max_tokens": 4}).encode()
    armed.set()
    conn = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=WAIT)
    try:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert reading.wait(WAIT), "the server never began to read the long message"
    finally:
        conn.close()  # the client leaves in the middle of the read
    deadline = time.monotonic() + WAIT
    while (worker.served < 2 or worker.busy) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.served == 2 and not worker.busy, "the abandoned read did not end"
    done, total = chunks[0]
    print(f"\na {total:,}-token message abandoned while read: {len(chunks)} chunk ({done:,} tokens) read, then stopped")
    assert noticed == [True], "the server did not notice the client leaving during the read"
    assert len(chunks) == 1 and done < total, chunks  # no chunk read after the client left
    assert len(worker.cache) == 1  # the conversation, put back as it was
    again = chat(url, base + [{"role": "user", "content": "Which word did I ask you to remember?"}], max_tokens=8)
    assert again["kv"]["cache_reused"] is True and again["kv"]["tokens_reused"] == r1["kv"]["tokens_seen"]
    assert again["usage"]["prompt_tokens"] * 10 < total  # only the new message was read


def test_generation_error_is_500_and_the_server_goes_on(in_process):
    url, worker = in_process
    make = worker.new_chat

    def failing_chat(system, options=None, tools=None):
        chat = make(system, options, tools)
        send = chat.send

        def broken(new, max_tokens=None, progress=None, tool_choice="auto"):
            if "explode" in new[-1]["content"]:
                yield "partial"
                raise RuntimeError("boom in llama.cpp")
            yield from send(new, max_tokens, progress, tool_choice)

        chat.send = broken
        return chat

    worker.new_chat = failing_chat
    post = lambda **body: httpx.post(url + "/v1/chat/completions", json=body, timeout=120)  # noqa: E731
    boom = [{"role": "user", "content": "Please explode."}]
    err = assert_error(post(messages=boom), 500, None, "boom in llama.cpp")
    assert err["type"] == "server_error"
    assert worker.cache.bytes == 0 and len(worker.cache) == 0  # the failed chat was dropped
    # streaming: the error comes after the first piece, as an error event, then [DONE]
    with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": boom, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        data = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]" and "boom in llama.cpp" in json.loads(data[-2])["error"]["message"]
    r = post(messages=GERMANY, max_tokens=24)
    assert r.status_code == 200 and "Berlin" in r.json()["choices"][0]["message"]["content"]
    assert len(worker.cache) == 1


@pytest.mark.slow(5)
def test_one_recall_cap_holds_across_conversations(smollm2_model):
    """--recall-mem is one cap for every conversation's recall tier: a second conversation that needs room takes it
    from the first one's oldest rows (counted there, none of its own dropped) — not from the rows the first one's last
    turn evicted, which a regenerate reads back — and the tiers' RAM stays under it."""
    from kvlocal.eval.tasks import sample_text

    cap = 8 << 20  # 128 blocks of SmolLM2's 90 heads: one conversation's reading fits, two do not
    text = sample_text()
    first = [{"role": "user", "content": text[:800] + "\nWhat is this about?"}]
    second = [{"role": "user", "content": text[800:1600] + "\nWhat is this about?"}]
    with in_process_server(smollm2_model, MODEL, budget="64", recall_mem=f"{cap}") as (url, worker):
        a = chat(url, first, max_tokens=4)
        assert (a["kv"]["host_tier_cap"], a["kv"]["host_tier_past_cap"], a["kv"]["host_tier_dropped_rows"]) == (
            cap, "drop_oldest", 0)
        first += [a["choices"][0]["message"], {"role": "user", "content": "Thanks."}]
        a = chat(url, first, max_tokens=4)["kv"]
        b = chat(url, second, max_tokens=4)["kv"]
        h = httpx.get(url + "/health", timeout=WAIT).json()
        tiers = {key[-2][1][:20]: c.engine.tier for key, (c, _) in worker.cache._items.items()}
        held = sum(t.pool.ram_bytes for t in tiers.values())
        assert a["host_tier_cap_used"] < b["host_tier_cap_used"] == h["host_tier_cap_used"] <= h["host_tier_cap"] == cap
        assert held <= cap and b["host_tier_dropped_rows"] == 0
        assert tiers["Thanks."].cap_dropped_rows > 0 and tiers[second[0]["content"][:20]].cap_dropped_rows == 0
        # the first conversation's last turn lost rows to the second's room: regenerating its reply reads it afresh
        again = chat(url, first, max_tokens=4)["kv"]
        assert again["cache_from"] == "read" and again["host_tier_cap_used"] <= cap


def test_serve_rss_follows_a_conversations_memory(smollm2):
    """tools/serve_rss: a `kvlocal serve` process, one conversation continued turn after turn, a row of the server's
    resident memory and the recall tier's figures after the first turn and every --every turns."""
    sys.path.insert(0, str(REPO))
    from tools import serve_rss

    rows = serve_rss.run(str(smollm2), turns=3, every=2, chars=120, max_tokens=4,
                         serve_args=["--recall-mem", "8M", "-t", "1"])
    assert [r["turn"] for r in rows] == [0, 1, 2, 3] and all(r["rss_mib"] > 50 for r in rows)
    assert rows[1]["tokens_seen"] < rows[2]["tokens_seen"] < rows[3]["tokens_seen"]
    assert [r["cache_reused"] for r in rows[1:]] == [False, True, True]
    assert all(r["host_tier_cap"] == 8 << 20 and r["host_tier_cap_used"] <= 8 << 20 for r in rows[1:])
    assert "recall cap: 8.0 MiB" in serve_rss.table(rows)


def test_conversation_cache_bounds():
    from kvlocal.chat.conversation import ConversationCache

    class Fake:
        closed = False

        def close(self):
            self.closed = True

    cache = ConversationCache(max_bytes=250, max_chats=3)
    chats = [Fake() for _ in range(5)]
    key = lambda i: (("user", str(i)), ("assistant", "ok"))  # noqa: E731
    for i in range(3):
        cache.put(key(i), chats[i], 100)  # the third one passes 250 bytes: the oldest goes
    assert len(cache) == 2 and cache.bytes == 200 and chats[0].closed and cache.evictions == 1
    assert cache.take(key(1)) is chats[1] and cache.bytes == 100
    cache.put(key(1) + (("user", "more"), ("assistant", "yes")), chats[1], 100)
    assert cache.take_parent(key(1) + (("user", "more"),)) is chats[1]
    zero = ConversationCache(max_bytes=0, max_chats=8)  # --cache-mib 0: nothing is kept
    zero.put(key(4), chats[4], 1)
    assert len(zero) == 0 and chats[4].closed


def test_stop_string_helpers():
    from kvlocal.chat.stops import find_stop as _find_stop, partial_stop as _partial_stop

    assert _find_stop("The capital is Berlin.", ["Berlin", "is"], 0) == 12
    assert _find_stop("abc", ["x"], 0) == -1
    assert _partial_stop("The capital is Ber", ["Berlin"]) == 3
    assert _partial_stop("The capital", ["Berlin"]) == 0
    assert _partial_stop("ab\n", ["\n\n", "b\nc"]) == 2
