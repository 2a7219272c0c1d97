"""What crosses the network when a compressed run's layers live on rpc-servers: bytes per compression event, per
recall swap and per decoded token, native against state backend (docs/distributed.md).

    LLAMA_CPP_LIB_PATH=<an RPC build> python -m tools.rpc_bytes --model smollm2-135m --tokens 4096 8192

Two ``kvlocal rpc-server`` processes on 127.0.0.1 hold the last two thirds of the model's layers and its output
layer (``-ngl`` = 2/3 of the layers, half on each; llama.cpp counts the output as one more layer); between
kvlocal and each server runs a byte-counting TCP relay (:class:`Relay`, threads in this process), so every byte
of ggml-rpc's protocol is counted, both ways. A run: the prompt's prefill (events at every chunk past the
budget), a question that re-selects with the recall tier, then greedy decoding. The engine's ``_compress``,
``_observe`` and ``_reselect`` are wrapped to read the counters around them:

- *event*: a compression event's own traffic (scores, the plan, rows a method reads, the compaction), without the
  decode of its observation probe (listed apart: ``observe``, a forward pass of the probe's tokens);
- *swap*: a recall re-selection (the question's and the answer's first tokens'), without its probe's decode;
- *token*: a decoded token in which no event and no swap ran (the graph's activations at the device boundaries
  and ggml-rpc's own commands).
"""

from __future__ import annotations

import argparse
import itertools
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {0: "ALLOC_BUFFER", 1: "GET_ALIGNMENT", 2: "GET_MAX_SIZE", 3: "BUFFER_GET_BASE", 4: "FREE_BUFFER",
            5: "BUFFER_CLEAR", 6: "SET_TENSOR", 7: "SET_TENSOR_HASH", 8: "GET_TENSOR", 9: "COPY_TENSOR",
            10: "GRAPH_COMPUTE", 11: "GET_DEVICE_MEMORY", 12: "INIT_TENSOR", 13: "GET_ALLOC_SIZE", 14: "HELLO",
            15: "DEVICE_COUNT", 16: "GRAPH_RECOMPUTE", 17: "MEMSET_TENSOR"}  # ggml-rpc's enum rpc_cmd


class Relay:
    """A TCP relay from a loopback port to ``target`` that counts the bytes it forwards each way."""

    def __init__(self, target: str):
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.up = self.down = 0  # kvlocal -> server, server -> kvlocal
        self.cmds: Counter = Counter()  # kvlocal -> server bytes per ggml-rpc command (its requests are framed)
        self._header, self._left, self._cmd = b"", 0, None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def total(self) -> int:
        return self.up + self.down

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
                setattr(self, way, getattr(self, way) + len(data))
                if way == "up":
                    self._frame(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _frame(self, data: bytes) -> None:
        """Follow the request stream: | command (1 byte) | size (8 bytes) | payload |, counting each command's bytes."""
        i = 0
        while i < len(data):
            if self._left:
                n = min(self._left, len(data) - i)
                self.cmds[self._cmd] += n
                self._left -= n
                i += n
                continue
            need = 9 - len(self._header)
            self._header += data[i:i + need]
            i += need
            if len(self._header) == 9:
                self._cmd = COMMANDS.get(self._header[0], str(self._header[0]))
                self._left = struct.unpack("<Q", self._header[1:])[0]
                self.cmds[self._cmd] += 9
                self.cmds[self._cmd + " (count)"] += 1
                self._header = b""

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
        proc = subprocess.Popen([sys.executable, "-m", "kvlocal", "rpc-server", "--port", str(port), "--threads",
                                 str(threads)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                preexec_fn=die_with_parent)
        out.append((proc, f"127.0.0.1:{port}"))
        end = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > end or proc.poll() is not None:
                    raise RuntimeError(f"rpc-server on port {port} did not start")
                time.sleep(0.1)
    return out


class Meter:
    """The relays' bytes around the engine's steps."""

    def __init__(self, relays: list[Relay]):
        self.relays = relays
        self.spans: dict[str, list[int]] = {"event": [], "observe": [], "swap": []}
        self.requests: dict[str, Counter] = {"event": Counter(), "swap": Counter()}  # kvlocal -> server, by command
        self._inner = 0  # bytes of observation decodes inside the current event or swap

    def total(self) -> int:
        return sum(r.total for r in self.relays)

    def cmds(self) -> Counter:
        out = Counter(down=sum(r.down for r in self.relays))
        for r in self.relays:
            out.update(r.cmds)
        return out

    def wrap(self, eng) -> None:
        for name, kind in (("_compress", "event"), ("_reselect", "swap"), ("_observe", "observe")):
            setattr(eng, name, self._measured(getattr(eng, name), kind))

    def _measured(self, fn, kind: str):
        def run(*args, **kw):
            b0, inner0, c0 = self.total(), self._inner, self.cmds()
            out = fn(*args, **kw)
            if kind in self.requests:  # (observation decodes inside included)
                c = self.cmds()
                c.subtract(c0)
                self.requests[kind].update(c)
            n = self.total() - b0
            if kind == "observe":
                self._inner += n
                self.spans["observe"].append(n)
            else:  # the probe's decode is the observation's, not the event's or the swap's own
                self.spans[kind].append(n - (self._inner - inner0))
            return out
        return run


def facts(n_tokens: int) -> str:
    """Numbered facts, about ``n_tokens`` tokens of them or more (12 tokens or so each): the tests' kind of text."""
    colours = ["red", "blue", "green", "gold"]
    return " ".join(f"Locker {i} holds a {colours[i % 4]} key numbered {i * 37 % 1000}." for i in range(n_tokens // 8))


def measure(model, backend: str, tokens: list[int], question: list[int], budget: float, n_gen: int,
            meter: Meter, recall: bool) -> dict:
    from kvlocal.engine import Engine

    eng = Engine(model, budget, "criticalkv", max_tokens=len(tokens) + len(question) + n_gen + 8, chunk=512,
                 backend=backend, recall=recall)
    meter.spans = {k: [] for k in meter.spans}
    meter.requests = {k: Counter() for k in meter.requests}
    meter.wrap(eng)
    b0 = meter.total()
    eng.prefill(tokens)
    prefill = meter.total() - b0
    eng.append(question, recall=recall)
    per_token = []
    gen = eng.generate(n_gen, stop_at_eog=False)
    while True:
        n_ev, n_sw, b = len(meter.spans["event"]), len(meter.spans["swap"]), meter.total()
        if next(gen, None) is None:
            break
        if len(meter.spans["event"]) == n_ev and len(meter.spans["swap"]) == n_sw:
            per_token.append(meter.total() - b)
    s = meter.spans
    out = {"backend": eng.backend + (" +tier" if recall else ""), "tokens": len(tokens), "kept": eng.live_cells(),
           "prefill": prefill,
           "events": len(s["event"]), "event": np.mean(s["event"]) if s["event"] else 0,
           "observe": np.mean(s["observe"]) if s["observe"] else 0,
           "swaps": len(s["swap"]), "swap": np.mean(s["swap"]) if s["swap"] else 0,
           "rows_in": eng.stats.recall_rows_in, "token": np.median(per_token) if per_token else 0,
           "host_kv": eng.stats.host_kv_bytes,
           "detail": {k: {c: v / max(len(s[k]), 1) for c, v in meter.requests[k].items() if v}
                      for k in meter.requests}}
    eng.close()
    return out


def plain_decode(model, meter: Meter, n: int = 10) -> None:
    """Bytes per decoded token of a bare llama.cpp context on the split model, without and with an eval callback
    (kvlocal's query capture is one): what each request carries, averaged over ``n`` tokens after 300 in the cache."""
    from kvlocal.runtime import Context

    tokens = model.tokenize(facts(400))[:300]
    for name, cb in (("no eval callback", None), ("an eval callback that asks for nothing", lambda t, ask, ud: False)):
        ctx = Context(model, 1024, cb_eval=cb)
        ctx.decode(tokens)
        b0, c0 = meter.total(), meter.cmds()
        for t in tokens[:n]:
            ctx.decode([t])
        c = meter.cmds()
        c.subtract(c0)
        print(f"plain decode, {name}: {(meter.total() - b0) / n:,.0f} B per token: " + ", ".join(
            f"{k} {v / n:,.0f} B ({c.get(k + ' (count)', 0) / n:.1f})" for k, v in sorted(c.items(), key=lambda x: -x[1])
            if v and not k.endswith("(count)")), flush=True)
        ctx.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="known model name or GGUF path (repeatable; default smollm2-135m)")
    ap.add_argument("--tokens", type=int, nargs="*", default=[4096], help="prompt lengths (none: only --plain)")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--backends", nargs="+", default=["native", "state"])
    ap.add_argument("--plain", action="store_true", help="also a bare context's bytes per decoded token, without and "
                    "with an eval callback")
    ap.add_argument("--detail", action="store_true", help="also each event's and swap's bytes by ggml-rpc command "
                    "(kvlocal -> server; `down`: every answer, server -> kvlocal)")
    ap.add_argument("--recall", choices=("on", "off", "both"), default="both",
                    help="the recall tier (rows that leave the device go to the host): on, off or both (default)")
    args = ap.parse_args(argv)
    from kvlocal.models import resolve
    from kvlocal.runtime import Model

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (timeout's signal) the servers are killed below too
    servers = start_servers()
    relays = [Relay(ep) for _, ep in servers]
    meter = Meter(relays)
    try:
        print(f"{'model':<34} {'tokens':>6} {'backend':<12} {'kept':>5} {'events':>6} {'B/event':>10} {'B/observe':>10} "
              f"{'swaps':>5} {'B/swap':>10} {'rows/swap':>9} {'B/token':>8} {'prefill MiB':>11} {'host KV MiB':>11}")
        for name in args.model or ["smollm2-135m"]:
            path = resolve(name)
            probe = Model(path)
            n_remote = probe.n_layer * 2 // 3
            probe.close()
            model = Model(path, n_gpu_layers=n_remote, rpc=[r.endpoint for r in relays], tensor_split=(1, 1))
            if args.plain:
                plain_decode(model, meter)
            for n in args.tokens:
                text = model.tokenize(facts(n))
                tokens, question = text[:n], model.tokenize(" Which key does locker 17 hold?", add_special=False)
                for backend, recall in itertools.product(args.backends, {"on": [True], "off": [False]}.get(
                        args.recall, [False, True])):
                    r = measure(model, backend, tokens, question, args.budget, args.n_gen, meter, recall)
                    print(f"{path.name[:34]:<34} {n:>6} {r['backend']:<12} {r['kept']:>5} {r['events']:>6} "
                          f"{r['event']:>10,.0f} {r['observe']:>10,.0f} {r['swaps']:>5} {r['swap']:>10,.0f} "
                          f"{r['rows_in'] / max(r['swaps'], 1):>9,.0f} {r['token']:>8,.0f} "
                          f"{r['prefill'] / 2**20:>11.1f} {r['host_kv'] / 2**20:>11.1f}", flush=True)
                    for kind, d in r["detail"].items():
                        if args.detail and d:
                            print(f"    per {kind}: " + ", ".join(
                                f"{c} {v:,.0f} B ({d.get(c + ' (count)', 0):.0f})" for c, v in
                                sorted(d.items(), key=lambda x: -x[1]) if not c.endswith("(count)")))
            model.close()
    finally:
        for r in relays:
            r.close()
        for proc, _ in servers:
            proc.kill()
            proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
