"""What crosses the network when a compressed run's layers live on rpc-servers, and how long it takes: bytes and
time per compression event, per recall swap and per decoded token, native against state backend
(docs/distributed.md).

    LLAMA_CPP_LIB_PATH=<an RPC build> python -m tools.rpc_bytes --model smollm2-135m --tokens 4096 8192 --local

Two ``kvlocal rpc-server`` processes on 127.0.0.1 hold the last two thirds of the model's layers and its output
layer (``-ngl`` = 2/3 of the layers, half on each; llama.cpp counts the output as one more layer); between
kvlocal and each server runs a relay (:class:`Relay`, threads in this process) that cuts ggml-rpc's byte streams
into frames (| command | size | payload | up, | size | payload | down), so every byte is counted by command, both
ways, and each answered request is timed: its wait goes to *compute* when a graph was sent since the last answer
(the server computed first: remote compute, then the answer's transfer) and to *transfer* otherwise
(:class:`Conversation`). A run: the prompt's prefill (events at every chunk past the budget), a question that
re-selects with the recall tier, then greedy decoding. The engine's ``_compress``, its observer's ``observe``,
its re-selection's ``swap`` and its context's row copies are wrapped to read the counters around them:

- *event*: a compression event's own traffic (scores, the plan, rows a method reads, the compaction), without the
  decode of its observation probe (listed apart: ``observe``, a forward pass of the probe's tokens);
- *swap*: a recall re-selection (the question's and the answer's first tokens'), without its probe's decode; its
  row copies to and from the servers' layers are counted apart (whether a swap moves only its rows);
- *token*: a decoded token in which no event and no swap ran (the graph's activations at the device boundaries
  and ggml-rpc's own commands).

``--local`` runs the same chat with the whole model on this machine for each step's wall-time ratio; the last
two columns are what a real link would add, from the measured counts: bytes at 1 Gbit/s and the round trips
(answered requests: ggml-rpc's client waits for each) at a LAN's 0.5 ms.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {0: "ALLOC_BUFFER", 1: "GET_ALIGNMENT", 2: "GET_MAX_SIZE", 3: "BUFFER_GET_BASE", 4: "FREE_BUFFER",
            5: "BUFFER_CLEAR", 6: "SET_TENSOR", 7: "SET_TENSOR_HASH", 8: "GET_TENSOR", 9: "COPY_TENSOR",
            10: "GRAPH_COMPUTE", 11: "GET_DEVICE_MEMORY", 12: "INIT_TENSOR", 13: "GET_ALLOC_SIZE", 14: "HELLO",
            15: "DEVICE_COUNT", 16: "GRAPH_RECOMPUTE", 17: "MEMSET_TENSOR"}  # ggml-rpc's enum rpc_cmd
# the requests rpc_serve_client answers (| size (8 bytes) | payload |); the others it only executes, in order
ANSWERED = {"HELLO", "DEVICE_COUNT", "ALLOC_BUFFER", "GET_ALLOC_SIZE", "GET_ALIGNMENT", "GET_MAX_SIZE",
            "BUFFER_GET_BASE", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GET_DEVICE_MEMORY"}
COMPUTES = {"GRAPH_COMPUTE", "GRAPH_RECOMPUTE"}
LINK_BYTES_PER_S = 1e9 / 8  # a 1 Gbit/s link
LINK_RTT_S = 0.0005  # a LAN round trip


class Frames:
    """A byte stream cut into ggml-rpc frames: | head (``with_cmd``: a command byte) | size (8 bytes) | payload |.
    :meth:`feed` returns the frames its bytes complete, as (command or None, frame bytes)."""

    def __init__(self, with_cmd: bool):
        self.head_len = 9 if with_cmd else 8
        self._head, self._left = b"", 0

    def feed(self, data: bytes) -> list[tuple[str | None, int]]:
        done, i = [], 0
        while i < len(data):
            if len(self._head) < self.head_len:
                take = self.head_len - len(self._head)
                self._head += data[i:i + take]
                i += take
                if len(self._head) < self.head_len:
                    break
                self._left = struct.unpack("<Q", self._head[-8:])[0]
            n = min(self._left, len(data) - i)
            self._left -= n
            i += n
            if not self._left:
                size = struct.unpack("<Q", self._head[-8:])[0]
                cmd = COMMANDS.get(self._head[0], str(self._head[0])) if self.head_len == 9 else None
                done.append((cmd, self.head_len + size))
                self._head = b""
        return done

    @property
    def between_frames(self) -> bool:
        return not self._head


class Conversation:
    """One client connection's requests and answers, matched in order (a server answers in the order it was asked):
    each answered request's wait, from its last byte to its answer's last byte, goes to ``wait compute`` when a
    graph computation was sent since the previous answered request (the server computed it first: remote compute
    and the network), else to ``wait <COMMAND>`` (the transfer of a GET_TENSOR's rows, a COPY_TENSOR, ...)."""

    def __init__(self, counts: Counter, lock: threading.Lock):
        self.counts, self.lock = counts, lock
        self.requests, self.answers = Frames(True), Frames(False)
        self.pending: deque = deque()  # (command, time of its last byte, a computation before it)
        self._computing = False

    def up(self, data: bytes, t: float) -> None:
        with self.lock:
            self.counts["up"] += len(data)
            for cmd, size in self.requests.feed(data):
                self.counts[cmd + " up"] += size
                self.counts[cmd + " n"] += 1
                if cmd in ANSWERED:
                    self.pending.append((cmd, t, self._computing))
                    self._computing = False
                self._computing |= cmd in COMPUTES

    def down(self, data: bytes, t: float) -> None:
        with self.lock:
            self.counts["down"] += len(data)
            for _, size in self.answers.feed(data):
                cmd, t_asked, computing = self.pending.popleft()
                self.counts[cmd + " down"] += size
                self.counts["round trips"] += 1
                self.counts["wait compute" if computing else "wait " + cmd] += t - t_asked


class Relay:
    """A TCP relay from a loopback port to ``target`` that counts the bytes it forwards each way, by ggml-rpc
    command, and times each answered request (:class:`Conversation`). The counts are read before the bytes are
    forwarded, so an answer is never seen before its request."""

    def __init__(self, target: str):
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.counts: Counter = Counter()
        self.lock = threading.Lock()
        self.talks: list[Conversation] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def snapshot(self, settle: float = 2.0) -> Counter:
        """The counts so far, taken between frames: a request ggml-rpc does not wait for (SET_TENSOR, GRAPH_COMPUTE)
        may still be on its way through the relay when the call that sent it returns, so this waits (at most
        ``settle`` seconds) until no frame is half through in either direction."""
        deadline = time.monotonic() + settle
        while True:
            with self.lock:
                if time.monotonic() > deadline or all(t.requests.between_frames and t.answers.between_frames
                                                      for t in self.talks):
                    return Counter(self.counts)
            time.sleep(0.001)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            talk = Conversation(self.counts, self.lock)
            with self.lock:
                self.talks.append(talk)
            threading.Thread(target=self._pump, args=(client, server, talk.up), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, talk.down), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, seen) -> None:
        try:
            while data := src.recv(1 << 20):
                seen(data, time.perf_counter())
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


def die_with_parent() -> None:
    """(Linux) a server is killed when this process dies, however it dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_servers(n: int = 2, threads: int = 1) -> list[tuple[subprocess.Popen, str]]:
    out = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = tempfile.TemporaryFile("w+")  # (a pipe nobody reads would block the server once full)
        proc = subprocess.Popen([sys.executable, "-m", "kvlocal", "rpc-server", "--port", str(port), "--threads",
                                 str(threads)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)
        out.append((proc, f"127.0.0.1:{port}"))
        end = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > end or proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"rpc-server on port {port} did not start: {log.read()[-500:]}")
                time.sleep(0.1)
    return out


class Meter:
    """The relays' counts (:class:`Conversation`'s keys) and the wall time around the engine's steps, each step's
    as a Counter in :attr:`steps`; ``rows get n``/``rows set n``/``rows kv``/``rows net``: the rows copied from
    and to the layers on the servers inside the step (``llama_kv_rows_get``/``set``), their K/V bytes and the
    network bytes of those copies."""

    KINDS = ("event", "observe", "swap", "token")

    def __init__(self, relays: list[Relay]):
        self.relays = relays
        self.rows: Counter = Counter()
        self.steps: dict[str, list[Counter]] = {k: [] for k in self.KINDS}
        self._inner: Counter = Counter()  # the observation decodes inside the current event or swap

    def snapshot(self) -> Counter:
        out = Counter(self.rows)
        for r in self.relays:
            out.update(r.snapshot())
        out["wall"] = time.perf_counter()
        return out

    def since(self, before: Counter) -> Counter:
        c = self.snapshot()
        c.subtract(before)
        return c

    def wrap(self, eng, first_remote: int) -> None:
        """Measure ``eng``'s events, swaps and observation decodes, and its row copies of layers from
        ``first_remote`` on (the ones on the servers)."""
        for owner, name, kind in ((eng, "_compress", "event"), (eng.reselection, "swap", "swap"),
                                  (eng.observer, "observe", "observe")):
            setattr(owner, name, self._measured(getattr(owner, name), kind))
        for name in ("get_rows", "set_rows"):
            setattr(eng.ctx, name, self._rows(getattr(eng.ctx, name), name, eng.kv.layers, first_remote))

    def _measured(self, fn, kind: str):
        def run(*args, **kw):
            c0, inner0 = self.snapshot(), Counter(self._inner)
            out = fn(*args, **kw)
            c = self.since(c0)
            if kind == "observe":
                self._inner.update(c)
            else:  # the probe's decode is the observation's, not the event's or the swap's own
                c.subtract(self._inner)
                c.update(inner0)
            self.steps[kind].append(c)
            return out
        return run

    def _rows(self, fn, name: str, layers: list[int], first_remote: int):
        def run(l, cells, heads, *rest):
            c0 = self.snapshot()
            out = fn(l, cells, heads, *rest)
            if layers[l] >= first_remote:
                k, v = out if name == "get_rows" else rest
                self.rows.update({f"rows {name[:3]} n": len(cells), "rows kv": k.nbytes + v.nbytes,
                                  "rows net": network(self.since(c0))})
            return out
        return run


def facts(n_tokens: int) -> str:
    """Numbered facts, about ``n_tokens`` tokens of them or more (12 tokens or so each): the tests' kind of text."""
    colours = ["red", "blue", "green", "gold"]
    return " ".join(f"Locker {i} holds a {colours[i % 4]} key numbered {i * 37 % 1000}." for i in range(n_tokens // 8))


def measure(model, backend: str, tokens: list[int], question: list[int], budget: float, n_gen: int,
            meter: Meter, recall: bool, first_remote: int, flash_attn: bool = False) -> dict:
    """One run (prefill, question, ``n_gen`` greedy tokens); ``meter.steps`` holds its steps, ``token``: the
    decoded tokens in which no event and no swap ran."""
    from kvlocal.engine import Engine

    eng = Engine(model, budget, "criticalkv", max_tokens=len(tokens) + len(question) + n_gen + 8, chunk=512,
                 backend=backend, recall=recall, flash_attn=flash_attn)
    meter.steps = {k: [] for k in meter.KINDS}
    meter.wrap(eng, first_remote)
    c0 = meter.snapshot()
    eng.prefill(tokens)
    prefill = meter.since(c0)
    eng.append(question, question=recall)
    gen = eng.generate(n_gen, stop_at_eog=False)
    while True:
        n_ev, n_sw, c0 = len(meter.steps["event"]), len(meter.steps["swap"]), meter.snapshot()
        if next(gen, None) is None:
            break
        if len(meter.steps["event"]) == n_ev and len(meter.steps["swap"]) == n_sw:
            meter.steps["token"].append(meter.since(c0))
    out = {"kept": eng.live_cells(), "prefill": prefill, "host_kv": eng.stats.host_kv_bytes, "steps": meter.steps}
    eng.close()
    return out


def mean(steps: list[Counter], key: str, pick=np.mean) -> float:
    return float(pick([s[key] for s in steps])) if steps else 0.0


def network(c: Counter) -> float:
    return c["up"] + c["down"]


def waits(c: Counter) -> tuple[float, float]:
    """(the waits for answers after a graph computation, the other waits: transfers) in seconds."""
    other = sum(v for k, v in c.items() if k.startswith("wait ") and k != "wait compute")
    return c["wait compute"], other


def time_rows(label: str, r: dict, local: dict | None) -> list[str]:
    """Per event, swap and decoded token: bytes, wall time (and the same step run locally), the waits, the
    round trips, and what a 1 Gbit/s LAN would add (bytes ÷ its rate + round trips × its round-trip time)."""
    out = []
    for kind in ("event", "swap", "token"):
        steps = r["steps"][kind]
        if not steps:
            continue
        avg = Counter({k: mean(steps, k, np.median if kind == "token" else np.mean) for k in set().union(*steps)})
        compute, transfer = waits(avg)
        here = mean(local["steps"][kind], "wall", np.median if kind == "token" else np.mean) if local else 0
        link = network(avg) / LINK_BYTES_PER_S, avg["round trips"] * LINK_RTT_S
        out.append(f"{label} {kind:<6} {len(steps):>4} {network(avg) / 1e6:>8.2f} {avg['wall'] * 1e3:>8.1f} "
                   + (f"{here * 1e3:>8.1f} {avg['wall'] / here:>5.2f}" if here else f"{'-':>8} {'-':>5}")
                   + f" {compute * 1e3:>10.1f} {transfer * 1e3:>11.1f} {avg['round trips']:>6.0f} "
                   f"{link[0] * 1e3:>9.1f} {link[1] * 1e3:>7.1f}")
    return out


def row_lines(label: str, r: dict) -> list[str]:
    """Whether an event or a swap moves only its rows: the rows it copies from and to the servers' layers (an event:
    the ones the recall tier takes; a swap: those and the ones it brings back), their K/V bytes, the network bytes of
    those copies and the rest of its traffic (the scoring of the device cells); for swaps with a least-squares line
    of a swap's bytes against its rows' K/V bytes (slope 1: each row costs its own bytes)."""
    out = []
    for kind in ("event", "swap"):
        steps = r["steps"][kind]
        if not steps or not mean(steps, "rows kv"):
            continue
        kv = np.array([s["rows kv"] for s in steps], float)
        net = np.array([network(s) for s in steps], float)
        slope = np.polyfit(kv, net, 1)[0] if kind == "swap" and len(steps) > 2 and np.ptp(kv) > 0 else None
        out.append(f"{label} {len(steps)} {kind}s, each: {mean(steps, 'rows set n'):,.0f} rows in and "
                   f"{mean(steps, 'rows get n'):,.0f} out of the servers' layers, K/V {mean(steps, 'rows kv') / 1e6:.2f} "
                   f"MB, their copies {mean(steps, 'rows net') / 1e6:.2f} MB over the network, the rest "
                   f"{(net.mean() - mean(steps, 'rows net')) / 1e6:.2f} MB"
                   + (f"; network bytes per K/V byte across swaps {slope:.2f}" if slope is not None else ""))
    return out


def by_command(c: Counter, n: float) -> str:
    """``c``'s bytes per ggml-rpc command (requests up, answers down) and requests, divided by ``n``, largest first."""
    cmds = sorted((k for k in COMMANDS.values() if c[k + " n"]), key=lambda k: -(c[k + " up"] + c[k + " down"]))
    return ", ".join(f"{k} {c[k + ' up'] / n:,.0f} B" + (f" + {c[k + ' down'] / n:,.0f} B down" if c[k + " down"] else "")
                     + f" ({c[k + ' n'] / n:.1f})" for k in cmds)


def plain_decode(model, meter: Meter, local=None, n: int = 10, rounds: int = 3) -> None:
    """Bytes and time per decoded token of a bare llama.cpp context on the split model, without and with an eval
    callback (kvlocal's query capture is one): what each request carries, averaged over ``n`` tokens after 300 in
    the cache, and the wall time per token, the median of ``rounds`` rounds of ``n`` tokens, each round followed by
    one on ``local`` (the whole model here: the wall-time ratio, its rounds interleaved so that a busy machine
    slows both alike). One thread in each context, as in each server: the split runs the same arithmetic, one
    process after the other."""
    from kvlocal.runtime import Context

    tokens = model.tokenize(facts(400))[:300]
    for name, cb in (("no eval callback", None), ("an eval callback that asks for nothing", lambda t, ask, ud: False)):
        ctxs = [Context(m, 1024, cb_eval=cb, n_threads=1) for m in (model, local) if m is not None]  # (as each server)
        walls: list[list[float]] = [[] for _ in ctxs]
        total = Counter()
        for ctx in ctxs:
            ctx.decode(tokens)
        for _ in range(rounds):
            for ctx, wall in zip(ctxs, walls):
                c0 = meter.snapshot()
                for t in tokens[:n]:
                    ctx.decode([t])
                c = meter.since(c0)
                wall.append(c["wall"] / n)
                if ctx is ctxs[0]:
                    total.update(c)
        k = n * rounds
        compute, transfer = waits(total)
        print(f"plain decode, {name}: {network(total) / k:,.0f} B per token: {by_command(total, k)}")
        print(f"    {np.median(walls[0]) * 1e3:.1f} ms per token" + (
            f" (the whole model here: {np.median(walls[1]) * 1e3:.1f} ms)" if local is not None else "")
            + f"; waiting for the servers' compute {compute / k * 1e3:.1f} ms, for transfers {transfer / k * 1e3:.1f} ms; "
            f"{total['round trips'] / k:.1f} round trips; a 1 Gbit/s LAN adds {network(total) / k / LINK_BYTES_PER_S * 1e3:.1f}"
            f" + {total['round trips'] / k * LINK_RTT_S * 1e3:.1f} ms", flush=True)
        for ctx in ctxs:
            ctx.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="known model name or GGUF path (repeatable; default smollm2-135m)")
    ap.add_argument("--tokens", type=int, nargs="*", default=[4096], help="prompt lengths (none: only --plain)")
    ap.add_argument("--budget", type=float, nargs="+", default=[0.1], help="budgets (1: the whole cache, no event)")
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--backends", nargs="+", default=["native", "state"])
    ap.add_argument("--plain", action="store_true", help="also a bare context's bytes per decoded token, without and "
                    "with an eval callback")
    ap.add_argument("--detail", action="store_true", help="also each event's, swap's and token's bytes by ggml-rpc "
                    "command (requests up, answers down, with the requests per step in brackets)")
    ap.add_argument("--recall", choices=("on", "off", "both"), default="both",
                    help="the recall tier (rows that leave the device go to the host): on, off or both (default)")
    ap.add_argument("--flash-attn", action="store_true", help="flash attention (llama.cpp then stores V untransposed: "
                    "a row's V is one piece, not head_dim elements with an index each)")
    ap.add_argument("--local", action="store_true", help="also each run with the whole model on this machine: the "
                    "wall-time ratio of each step")
    args = ap.parse_args(argv)
    from kvlocal.models import resolve
    from kvlocal.runtime import Model

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (timeout's signal) the servers are killed below too
    servers = start_servers()
    relays = [Relay(ep) for _, ep in servers]
    meter = Meter(relays)
    try:
        for name in args.model or ["smollm2-135m"]:
            path = resolve(name)
            local = Model(path)
            n_remote = local.n_layer * 2 // 3
            first_remote = local.n_layer + 1 - n_remote  # (llama.cpp counts the output layer as one more)
            if not args.local:
                local.close()
            model = Model(path, n_gpu_layers=n_remote, rpc=[r.endpoint for r in relays], tensor_split=(1, 1))
            if args.plain:
                plain_decode(model, meter, local if args.local else None)
            for n, budget in itertools.product(args.tokens, args.budget):
                text = model.tokenize(facts(n))
                tokens, question = text[:n], model.tokenize(" Which key does locker 17 hold?", add_special=False)
                for backend, recall in itertools.product(args.backends, {"on": [True], "off": [False]}.get(
                        args.recall, [False, True])):
                    label = f"{path.name[:24]:<24} {n:>5} {budget:>4} {backend + (' +tier' if recall else ''):<12}"
                    r = measure(model, backend, tokens, question, budget, args.n_gen, meter, recall, first_remote,
                                args.flash_attn)
                    here = measure(local, backend, tokens, question, budget, args.n_gen, Meter([]), recall,
                                   local.n_layer + 1, args.flash_attn) if args.local else None
                    report(label, r, here, args.detail)
            model.close()
            if args.local:
                local.close()
    finally:
        for r in relays:
            r.close()
        for proc, _ in servers:
            proc.kill()
            proc.wait(timeout=10)
    return 0


def report(label: str, r: dict, local: dict | None, detail: bool) -> None:
    """A run's bytes, times and swaps, each line starting with ``label`` (model, tokens, budget, backend)."""
    s = r["steps"]
    print(f"{'model':<24} {'tokens':>5} {'budget':>4} {'backend':<12} {'kept':>5} {'events':>6} {'B/event':>10} "
          f"{'B/observe':>10} {'swaps':>5} {'B/swap':>10} {'B/token':>8} {'prefill MiB':>11} {'host KV MiB':>11}")
    print(f"{label} {r['kept']:>5} {len(s['event']):>6} {mean(s['event'], 'up') + mean(s['event'], 'down'):>10,.0f} "
          f"{mean(s['observe'], 'up') + mean(s['observe'], 'down'):>10,.0f} {len(s['swap']):>5} "
          f"{mean(s['swap'], 'up') + mean(s['swap'], 'down'):>10,.0f} "
          f"{float(np.median([network(t) for t in s['token']])) if s['token'] else 0:>8,.0f} "
          f"{network(r['prefill']) / 2**20:>11.1f} {r['host_kv'] / 2**20:>11.1f}")
    print(f"{'':<24} {'':>5} {'':>4} {'':<12} {'step':<6} {'n':>4} {'MB':>8} {'wall ms':>8} {'local':>8} {'ratio':>5} "
          f"{'compute ms':>10} {'transfer ms':>11} {'trips':>6} {'+1Gbit ms':>9} {'+RTT ms':>7}")
    print("\n".join(time_rows(label, r, local)))
    for line in row_lines(label, r):
        print(line)
    for kind in ("event", "swap", "token") if detail else ():
        if s[kind]:
            total = sum(s[kind], Counter())
            print(f"    per {kind}: {by_command(total, len(s[kind]))}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
