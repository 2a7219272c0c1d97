"""Compressed runs on llama.cpp's RPC backend, on loopback (issue 63; docs/distributed.md).

Two ``kvlocal rpc-server`` processes on 127.0.0.1 (CPU devices) hold two thirds of SmolLM2-135M's layers, their KV
cache and the output layer; the CPU backend computes the same arithmetic there as here, so a compressed run split across
them keeps the same rows, decodes the same tokens and ends with the same logits as the same run on one machine.
Every wait is bounded and every server is killed at the end. Without a runtime built with the RPC backend and
its rpc-server (``python ggml_patches/build.py``) the tests skip locally and fail under CI (tests/policy.py).
"""

from __future__ import annotations

import ctypes
import gc
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from policy import missing

from kvlocal.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
N_REMOTE = 20  # SmolLM2's layers 11-29 and its output (llama.cpp's layer 30) on the servers, half each; 0-10 here
THREADS = 2


def rpc_runtime() -> None:
    """Skip (fail under CI) unless the runtime has the RPC backend and its rpc-server."""
    from kvlocal.runtime import rpc

    try:
        ok = rpc.has_rpc() and rpc.server_binary() is not None
    except UsageError as e:
        missing(f"no llama.cpp runtime: {e}")
    if not ok:
        missing("this llama.cpp runtime has no RPC backend or no rpc-server: rerun `python ggml_patches/build.py` "
                "(GGML_RPC=ON), or point LLAMA_CPP_LIB_PATH at such a build")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server on port {port} exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"rpc-server on port {port} did not listen within {timeout} s")


def die_with_parent() -> None:
    """(Linux) the child is killed when the test process dies, however it dies: no server outlives a killed run."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Servers:
    """rpc-servers started with ``kvlocal rpc-server`` on free loopback ports; :meth:`stop` kills them all."""

    def __init__(self, n: int = 2):
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            for _ in range(n):
                port = free_port()
                proc = subprocess.Popen([sys.executable, "-m", "kvlocal", "rpc-server", "--port", str(port),
                                         "--threads", "1"], cwd=REPO, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
                self.procs[f"127.0.0.1:{port}"] = proc
                wait_listening(port, proc)
        except BaseException:
            self.stop()
            raise

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self.procs)

    def kill(self, endpoint: str) -> None:
        proc = self.procs[endpoint]
        proc.kill()
        proc.wait(timeout=10)

    def restart(self, endpoint: str) -> None:
        """A new server on a killed one's port."""
        self.procs[endpoint].stderr.close()
        port = int(endpoint.rsplit(":", 1)[1])
        self.procs[endpoint] = proc = subprocess.Popen(
            [sys.executable, "-m", "kvlocal", "rpc-server", "--port", str(port), "--threads", "1"], cwd=REPO,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
        wait_listening(port, proc)

    def stop(self) -> None:
        gc.collect()  # contexts and models left to the collector free their remote buffers while the servers live
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            proc.stderr.close()


@pytest.fixture(scope="module")
def servers():
    rpc_runtime()
    s = Servers()
    yield s
    s.stop()


def prompt_tokens(model, n: int = 600) -> list[int]:
    facts = " ".join(f"Locker {i} holds a {['red', 'blue', 'green', 'gold'][i % 4]} key numbered {i * 37 % 1000}."
                     for i in range(200))
    return model.tokenize(facts)[:n]


def run(model, backend: str, method: str, recall: bool, tokens: list[int]):
    """A compressed run: a prefill with events, a question that re-selects (recall), 24 greedy tokens."""
    from kvlocal.engine import Engine

    eng = Engine(model, 128, method, max_tokens=len(tokens) + 64, chunk=64, recent=16, n_threads=THREADS,
                 backend=backend, recall=recall, recall_steps=3,  # (each answer step that swaps costs a re-selection)
                 method_params={"value_norm": "l1"} if "criticalkv" in method else None)
    eng.prefill(tokens[:-16], probe=tokens[-16:])
    eng.append(tokens[-16:], question=recall)
    reply = list(eng.generate(16, stop_at_eog=False))
    return eng, reply


@pytest.fixture(scope="module")
def models(servers, smollm2):
    from kvlocal.runtime import Model

    split = Model(smollm2, n_gpu_layers=N_REMOTE, rpc=servers.endpoints, tensor_split=(1, 1))
    local = Model(smollm2)
    yield split, local
    split.close()  # before the servers stop: freeing a remote buffer on a dead server aborts (ggml-rpc)
    local.close()


def test_the_split_model_puts_layers_on_both_servers(models, servers):
    split, local = models
    assert split.rpc == servers.endpoints and split.remote and not local.remote
    assert [d.split()[1] for d in split.devices] == [f"({ep})" for ep in servers.endpoints]
    from kvlocal.engine import Engine

    # auto: the cache is partly remote, where native sends indices and scores instead of rows
    for model, backend in ((split, "native"), (local, "state")):
        eng = Engine(model, 128, "criticalkv", max_tokens=256)
        eng.close()
        assert eng.backend == backend


@pytest.mark.parametrize("backend", ["native", "state"])
@pytest.mark.parametrize("method,recall", [("criticalkv", True), ("kvslimmer", False)])
@pytest.mark.slow(32)
def test_a_split_run_keeps_and_decodes_as_a_local_one(models, backend, method, recall):
    """The same kept rows (every plan's positions and counts), the same greedy reply and the same next-token logits
    on the split model as on the local one; with the recall tier, the same rows back from it."""
    split, local = models
    tokens = prompt_tokens(local)
    a, reply_a = run(split, backend, method, recall, tokens)
    b, reply_b = run(local, backend, method, recall, tokens)
    try:
        compare(split, a, b, reply_a, reply_b, backend, method, recall)
    finally:
        a.close()
        b.close()


def compare(split, a, b, reply_a, reply_b, backend: str, method: str, recall: bool) -> None:
    """The split run `a` against the local run `b`: the assertions, and the line the closing note quotes."""
    assert a.backend == b.backend == backend
    assert a.stats.compression_events == b.stats.compression_events > 2
    for pa, pb in ((a.prompt_plan, b.prompt_plan), (a.last_plan, b.last_plan)):
        assert np.array_equal(pa.positions, pb.positions) and np.array_equal(pa.counts, pb.counts)
    if recall:
        assert a.tier.rows_out == b.tier.rows_out > 0 and a.stats.recall_rows_in == b.stats.recall_rows_in > 0
    if method == "kvslimmer":
        assert a.last_plan.merged().any()
    assert reply_a == reply_b
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-3)
    print(f"\n{backend} {method}{' +recall' if recall else ''}: {a.stats.compression_events} events, "
          f"{int((a.last_plan.positions >= 0).sum())} kept rows identical; reply {split.detokenize(reply_a)!r} on both; "
          f"max |logit difference| {np.abs(a.logits - b.logits).max():.2e}")


def test_an_unreachable_or_stock_server_is_refused_in_one_line(smollm2, stock_runtime):
    """A port where nothing listens, and a stock rpc-server (its flash attention ignores the attention bias): each
    refused before llama.cpp connects (ggml-rpc would abort the process), in one line naming the server."""
    rpc_runtime()
    from kvlocal.runtime import Model

    port = free_port()
    with pytest.raises(UsageError, match=f"rpc-server 127.0.0.1:{port} cannot be reached"):
        Model(smollm2, n_gpu_layers=4, rpc=f"127.0.0.1:{port}")
    stock = stock_runtime / "llama_cpp" / "lib" / "ggml-rpc-server"
    if not stock.exists():
        missing(f"the unpatched runtime in {stock_runtime} has no rpc-server: delete it and rebuild it "
                f"(`python ggml_patches/build.py --stock {stock_runtime}`)")
    port = free_port()
    proc = subprocess.Popen([str(stock), "--port", str(port), "--threads", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, proc)
        with pytest.raises(UsageError, match=f"rpc-server 127.0.0.1:{port} runs RPC protocol 7.0.0 with a stock ggml"):
            Model(smollm2, n_gpu_layers=4, rpc=f"127.0.0.1:{port}")
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_doctor_lists_the_servers_devices():
    """Servers of their own: an rpc-server serves one client at a time, and the module's split model holds both of
    the module's (a doctor asking them then says they are busy)."""
    from conftest import run_cli

    rpc_runtime()
    s = Servers()
    try:
        r = run_cli("doctor", "--rpc", ",".join(s.endpoints), timeout=120)
    finally:
        s.stop()
    for ep in s.endpoints:
        assert f"{ep} device 0:" in r.stdout and "GiB free (RPC protocol 7.0.0)" in r.stdout, r.stdout
        assert f"{ep}: kvlocal's patched ggml" in r.stdout
    bad = run_cli("doctor", "--rpc", "nohost", timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "HOST:PORT" in bad.stderr


# the end of a killed run's script: the ServerLost the engine raised, printed as `kvlocal` prints it, then proof that
# the process goes on — a context on this machine alone decodes
LOST = """
except ServerLost as e:
    print(f"kvlocal: error: {{e}}", file=sys.stderr, flush=True)
    Context(Model(sys.argv[1]), 64, n_threads=2).decode(model.tokenize("Still here."))
    print("alive", flush=True)
    sys.exit(e.exit_code)
"""

def kill_mid_run(s: Servers, argv: list[str], ready: str, dead: str, go: str | None = None) -> tuple[int, str, str]:
    """Run ``argv`` until its first line of output is ``ready``, kill the server ``dead``, let the run go on (writing
    ``go`` to it) and end, bounded: (returncode, stdout, stderr)."""
    proc = subprocess.Popen(argv, cwd=REPO, stdin=None if go is None else subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == ready, proc.stderr.read()
        s.kill(dead)
        out, err = proc.communicate(go, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    return proc.returncode, out, err


def assert_one_lost_line(returncode: int, out: str, err: str, start: str) -> None:
    """The run ended with exit 1 after the process went on (``alive``), and stderr is one line beginning ``start``
    that says what to do."""
    lines = err.strip().splitlines()
    assert returncode == 1 and out.splitlines()[-1] == "alive", (out, err)
    assert len(lines) == 1 and lines[0].startswith(start), err
    assert "restart it (`kvlocal rpc-server`)" in lines[0]
    print("\n" + lines[0])


KILLED = """
import sys
from kvlocal.engine import Engine
from kvlocal.errors import ServerLost
from kvlocal.runtime import Context, Model
model = Model(sys.argv[1], n_gpu_layers={n}, rpc=sys.argv[2].split(","), tensor_split=(1, 1))
tokens = model.tokenize(" ".join(f"Item {{i}} is on shelf {{i % 7}}." for i in range(60)))
eng = Engine(model, 128, "criticalkv", max_tokens=len(tokens) + 4000, chunk=64, n_threads=2, backend="native")
try:
    eng.prefill(tokens)
    for i, tok in enumerate(eng.generate(4000, stop_at_eog=False)):
        print(i, flush=True)
""" + LOST


@pytest.mark.slow(5)
def test_a_server_killed_mid_reply_ends_the_run_with_one_line(smollm2):
    """A server that stops answering mid-reply no longer aborts the process (patch 0015): the engine raises
    ServerLost, one line naming the dead server and what to do (exit 1 from the command line), and the process goes
    on — nothing hangs, no C backtrace."""
    rpc_runtime()
    s = Servers()
    try:
        dead = s.endpoints[1]
        run = kill_mid_run(s, [sys.executable, "-c", KILLED.format(n=N_REMOTE), str(smollm2), ",".join(s.endpoints)],
                           "0", dead)  # killed once the reply has begun
        assert_one_lost_line(*run, f"kvlocal: error: rpc-server {dead} stopped mid-computation")
    finally:
        s.stop()


@pytest.mark.slow(21)
def test_the_front_doors_take_rpc(servers, smollm2, tmp_path, capsys):
    """``--rpc`` on ``kvlocal run`` and ``rpc=`` in ``kvlocal.Chat`` split the model over the servers and give the
    greedy reply the same command gives locally."""
    from kvlocal import Chat
    from kvlocal.cli import main
    from kvlocal.runtime import Sampler

    doc = tmp_path / "prompt.txt"
    doc.write_text(" ".join(f"Locker {i} holds a key numbered {i * 37 % 1000}." for i in range(120))
                   + "\nWhich number does the key in locker 17 have?")
    common = ["run", str(smollm2), "--prompt-file", str(doc), "-n", "12", "--temp", "0", "--budget", "0.2",
              "-t", str(THREADS)]
    replies = []
    for extra in ([], ["-ngl", str(N_REMOTE), "--rpc", ",".join(servers.endpoints)]):
        assert main(common + extra) == 0
        replies.append(capsys.readouterr().out)
    assert replies[0] and replies[0] == replies[1], replies

    said = []
    for kw in ({}, {"n_gpu_layers": N_REMOTE, "rpc": ",".join(servers.endpoints)}):
        chat = Chat(str(smollm2), budget=256, n_threads=THREADS, sampler=Sampler(temp=0), **kw)
        try:
            assert chat.model.remote == bool(kw)
            said.append(chat.ask("Name three colours.", max_tokens=12))
        finally:
            chat.close()
            gc.collect()  # its remote buffers freed while the servers run
    assert said[0] and said[0] == said[1], said


@pytest.mark.slow(18)
def test_a_chat_saved_on_a_split_model_continues_locally(servers, smollm2, tmp_path):
    """A chat read and asked on a model split over the servers, saved, loads on this machine alone and goes on
    as the same chat run locally from the start: the cache a split run saves is the one a local run holds."""
    from kvlocal import Chat
    from kvlocal.runtime import Sampler

    doc = " ".join(f"Locker {i} holds a {['red', 'blue', 'green', 'gold'][i % 4]} key numbered {i * 37 % 1000}."
                   for i in range(80))

    def chat(**kw):  # native both: auto picks it for the split model, state for the local one
        return Chat(str(smollm2), budget=128, backend="native", n_threads=THREADS, sampler=Sampler(temp=0), **kw)

    replies = {}
    for where, kw in (("local", {}), ("split", {"n_gpu_layers": N_REMOTE, "rpc": ",".join(servers.endpoints)})):
        c = chat(**kw)
        try:
            c.read(doc)
            first = c.ask("Which colour is the key in locker 9?", max_tokens=10)
            c.save(tmp_path / f"{where}.kvl")
        finally:
            c.close()
            gc.collect()  # its remote buffers freed while the servers run
        again = Chat.load(tmp_path / f"{where}.kvl", sampler=Sampler(temp=0), n_threads=THREADS)  # on this machine
        try:
            replies[where] = (first, again.ask("And the number of the key in locker 12?", max_tokens=10))
        finally:
            again.close()
    print(replies)
    assert replies["local"][0] and replies["split"] == replies["local"]


KILLED_AT = """
import sys
from kvlocal.engine import Engine
from kvlocal.engine.compressor import Compressor
from kvlocal.errors import ServerLost
from kvlocal.recall import Reselection
from kvlocal.runtime import Context, Model

where, swapping = sys.argv[3], []
apply, swap = Compressor.apply, Reselection.swap


def paused_apply(self, read, plan):  # the event's rows scored and its plan made: the parent kills a server now
    if where == "event" or swapping:
        print("at", flush=True)
        sys.stdin.readline()  # (the parent writes once the server is dead; bounded by its timeout)
    return apply(self, read, plan)


def marked_swap(self, *args, **kwargs):
    swapping.append(1)
    return swap(self, *args, **kwargs)


Compressor.apply, Reselection.swap = paused_apply, marked_swap
model = Model(sys.argv[1], n_gpu_layers={n}, rpc=sys.argv[2].split(","), tensor_split=(1, 1))
tokens = model.tokenize(" ".join(f"Item {{i}} is on shelf {{i % 7}}." for i in range(60)))
eng = Engine(model, 128, "criticalkv", max_tokens=len(tokens) + 400, chunk=64, n_threads=2, backend="native",
             recall=where == "swap")
try:
    if where == "swap":
        Compressor.apply = apply  # the reading's events go through; the question's swap stops
        eng.prefill(tokens)
        Compressor.apply = paused_apply
        eng.append(model.tokenize(" Which shelf holds item 12?", add_special=False), question=True)
    else:
        eng.prefill(tokens)
    print("done", flush=True)
""" + LOST


@pytest.mark.parametrize("where", ["event", "swap"])
@pytest.mark.slow(5)
def test_a_server_killed_mid_event_or_swap_ends_the_run_with_one_line(smollm2, where):
    """A server that dies between a compression event's scoring and its compaction — or inside a recall swap, after
    its rows are read and before they are written — ends the run the same way: one line naming it, exit 1."""
    rpc_runtime()
    s = Servers()
    try:
        dead = s.endpoints[0]
        run = kill_mid_run(s, [sys.executable, "-c", KILLED_AT.format(n=N_REMOTE), str(smollm2), ",".join(s.endpoints),
                               where], "at", dead, go="go\n")
        assert "done" not in run[1], run
        assert_one_lost_line(*run, f"kvlocal: error: rpc-server {dead} ")
    finally:
        s.stop()


@pytest.mark.slow(30)
def test_serve_refuses_while_a_server_is_lost_and_loads_the_model_again_once_it_is_back(smollm2, tmp_path):
    """`kvlocal serve` on a split model outlives a killed rpc-server: the request that meets the loss and every one
    after it are refused with 503 naming the server (every conversation needs every layer), /health says so, the
    process stays up; once a server answers on that port again, the next request loads the model again and is
    served as the first one was."""
    import httpx

    rpc_runtime()
    s = Servers()
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvlocal", "serve", str(smollm2), "--rpc", ",".join(s.endpoints),
                                 "-ngl", str(N_REMOTE), "-ts", "1,1", "--port", str(port), "--temp", "0", "-t", "2"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8}

    def ask() -> httpx.Response:
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)

    try:
        t0 = time.monotonic()
        while "(OpenAI API at" not in log.read_text():
            assert proc.poll() is None and time.monotonic() - t0 < 120, log.read_text()
            time.sleep(0.2)
        first = ask()
        assert first.status_code == 200, first.text
        dead = s.endpoints[1]
        s.kill(dead)
        refused = [ask(), ask()]  # the one that meets the loss, and one after it
        for r in refused:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["message"].startswith(f"rpc-server {dead} stopped mid-computation"), r.text
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["status"] == "rpc_server_lost" and health["rpc_servers_lost"] == [dead], health
        assert proc.poll() is None
        s.restart(dead)
        again = ask()
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        print("\n" + refused[0].json()["error"]["message"])
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        s.stop()
