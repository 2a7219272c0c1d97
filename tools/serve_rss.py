"""A long conversation with ``kvlocal serve`` and the server's resident memory every few turns: does it flatten once
the recall tier's RAM cap (``--recall-mem``) is reached?

    python -m tools.serve_rss smollm2-135m --turns 120 --every 10 --recall-mem 32M
    python -m tools.serve_rss smollm2-135m --turns 120 --every 10                      # the default cap
    python -m tools.serve_rss smollm2-135m --turns 6 --every 2 --serve-args "--budget 256"

Starts ``python -m kvlocal serve MODEL --port 0 --temp 0 --repeat-penalty 1`` (greedy, so that runs compare; more
flags in ``--serve-args``) and holds one conversation of ``--turns`` user messages, each a ``--chars`` slice of
kvlocal's sample prose (in turn, from the start again when it runs out) and a question, sending the whole history
each turn as a client does (the server continues its cached conversation: docs/server.md § Reusing conversations),
each reply at most ``--max-tokens``. Every ``--every`` turns (and after the first) a row: the server process's
resident memory (``VmRSS`` from /proc: Linux), the tokens the conversation has seen, the recall tier's host bytes
(``host_tier_bytes``), the RAM held under the cap by every conversation's tier (``host_tier_cap_used``), the rows
dropped for the cap (``host_tier_dropped_rows``) and the seconds since the first turn. ``--out FILE``: the rows as
JSON lines. One run on one machine: RSS includes the model's mapped weights and llama.cpp's buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvlocal.eval.tasks import sample_text

WAIT = 300  # seconds: the bound on the server's start and on one reply
QUESTION = "\n\nWhat happens in this passage, in one sentence?"


def resident_mib(pid: int) -> float:
    """The process's resident memory (VmRSS) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.MULTILINE).group(1)) / 1024


def messages_of(turns: int, chars: int) -> list[str]:
    """The user messages: consecutive ``chars`` slices of the sample prose (wrapping around), each with a question."""
    text = " ".join(sample_text().split())
    return [(text + " " + text)[(i * chars) % len(text):][:chars] + QUESTION for i in range(turns)]


class Server:
    """``kvlocal serve`` in a subprocess; its stderr goes to a file, read for the URL it prints."""

    def __init__(self, model: str, args: list[str]):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve_rss-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvlocal", "serve", model, "--port", "0", "--temp", "0",
                                      "--repeat-penalty", "1", *args], stdout=subprocess.DEVNULL, stderr=self.log,
                                     cwd=Path(__file__).resolve().parent.parent)
        deadline = time.monotonic() + WAIT
        while not (m := re.search(r"· (http://\S+:\d+) ", Path(self.log.name).read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"serve_rss: the server did not start:\n{Path(self.log.name).read_text()}")
            time.sleep(0.2)
        self.url = m.group(1)

    def chat(self, messages: list[dict], max_tokens: int) -> dict:
        body = json.dumps({"messages": messages, "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(self.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=WAIT) as r:
            return json.load(r)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def run(model: str, turns: int, every: int, chars: int, max_tokens: int, serve_args: list[str]) -> list[dict]:
    """The rows (module docstring) of one conversation."""
    server = Server(model, serve_args)
    rows, history, t0 = [], [], time.perf_counter()
    try:
        rows.append(dict(turn=0, rss_mib=resident_mib(server.proc.pid)))  # loaded, no conversation yet
        for turn, text in enumerate(messages_of(turns, chars), 1):
            history.append({"role": "user", "content": text})
            r = server.chat(history, max_tokens)
            history.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
            if turn == 1 or turn % every == 0 or turn == turns:
                kv = r["kv"]
                rows.append(dict(turn=turn, rss_mib=resident_mib(server.proc.pid), tokens_seen=kv["tokens_seen"],
                                 cache_reused=kv["cache_reused"], host_tier_bytes=kv["host_tier_bytes"],
                                 host_tier_cap=kv["host_tier_cap"], host_tier_cap_used=kv["host_tier_cap_used"],
                                 host_tier_dropped_rows=kv["host_tier_dropped_rows"],
                                 seconds=time.perf_counter() - t0))
    except OSError as e:  # the server went away or timed out: say what its log says
        raise SystemExit(f"serve_rss: turn {len(history) // 2}: {e}; the server's log ends:\n"
                         f"{Path(server.log.name).read_text()[-3000:]}") from None
    finally:
        server.stop()
    return rows


def table(rows: list[dict]) -> str:
    mib = 2**20
    cap = next((r["host_tier_cap"] for r in rows if "host_tier_cap" in r), None)
    lines = [f"recall cap: {'none' if cap is None else f'{cap / mib:,.1f} MiB'}",
             "turn  tokens_seen  rss MiB  tier MiB  cap used MiB  dropped rows  reused     s"]
    for r in rows:
        if r["turn"] == 0:
            lines.append(f"{0:>4}  {'-':>11}  {r['rss_mib']:>7.1f}  (the server loaded, no conversation)")
            continue
        lines.append(f"{r['turn']:>4}  {r['tokens_seen']:>11,}  {r['rss_mib']:>7.1f}  {r['host_tier_bytes'] / mib:>8.1f}"
                     f"  {r['host_tier_cap_used'] / mib:>12.1f}  {r['host_tier_dropped_rows']:>12,}  "
                     f"{'yes' if r['cache_reused'] else 'no':>6}  {r['seconds']:>4.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--turns", type=int, default=120)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--chars", type=int, default=300, help="characters of prose in each user message (default 300)")
    ap.add_argument("--max-tokens", type=int, default=48, help="most tokens of each reply (default 48)")
    ap.add_argument("--recall-mem", default=None, help="the server's --recall-mem (default: its own default)")
    ap.add_argument("--serve-args", default="", help="more flags for kvlocal serve, one string (e.g. \"--budget 256\")")
    ap.add_argument("--out", default=None, help="write the rows as JSON lines to this file")
    args = ap.parse_args(argv)
    if args.turns < 1 or args.every < 1:
        raise SystemExit("serve_rss: --turns and --every must be at least 1")
    serve_args = (["--recall-mem", args.recall_mem] if args.recall_mem else []) + shlex.split(args.serve_args)
    rows = run(args.model, args.turns, args.every, args.chars, args.max_tokens, serve_args)
    print(table(rows), flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
