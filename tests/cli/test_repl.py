"""The ``kvlocal chat`` REPL as a person at a terminal uses it: GNU readline on a real pseudo-terminal,
keystrokes (Enter, Ctrl-C, Ctrl-D) sent as bytes, the real SmolLM2-135M answering.

stdin and stdout share one pseudo-terminal (the controlling terminal of the chat's session, so Ctrl-C
is the terminal's SIGINT, as at a keyboard); stderr has a second one, so the replies (stdout) and the
banner, status lines and command output (stderr) can be told apart — and ``Term.log`` keeps both in
the order they arrived, as the person would have seen them on one screen."""

from __future__ import annotations

import sys

import pytest

if sys.platform == "win32":
    pytest.skip("pseudo-terminals are POSIX", allow_module_level=True)

import codecs
import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from pathlib import Path

from conftest import REPO

STEP = 240  # seconds one step may take: 2 slow shared cores
STATUS = re.compile(r"\[ prompt (?:[\d,]+|–) t/s \| gen (?:[\d,]+|–) t/s \| KV ([\d,]+) of ([\d,]+) tokens kept in [\d,.]+ MiB "
                    r"\((?:llama\.cpp's cache at -c \d+|a full cache for all [\d,]+): [\d,.]+ MiB\)[^\]\n]*\]")
# readline's prompt, waiting at the end of stdout (after a line, or the tty's echo of a Ctrl-C whose
# message went to stderr)
PROMPT = re.compile(r"(?:^|\n|\^C)> $")
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_UNFINISHED = re.compile(r"(?:\r|\x1b(?:\[[0-?]*[ -/]*)?)$")  # a CR or an escape sequence that more output may complete


def clean(raw: str) -> str:
    """Terminal output as text to search: escape sequences (bracketed paste, cursor moves) out, CR LF as
    LF, a CR at a line's start (readline's after Enter) out, and any other CR (readline's new prompt after
    Ctrl-C, a progress bar's redraw) as LF, so the text only grows as output comes. An unfinished tail
    waits for more."""
    text = _ANSI.sub("", _UNFINISHED.sub("", raw)).replace("\r\n", "\n")
    return re.sub(r"(?:^|(?<=\n))\r+", "", text).replace("\r", "\n")


def render(raw: str) -> str:
    """Terminal output as a screen shows it: a CR moves back to the line's start, what follows overwrites."""
    lines, line, col = [], [], 0
    for ch in _ANSI.sub("", raw):
        if ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            line[col:col + 1] = [ch]
            col += 1
    return "\n".join([*lines, "".join(line)])


def _pty(cols: int = 400) -> tuple[int, int]:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))  # wide: readline never wraps
    return master, slave


def _take_terminal() -> None:  # in the child, after setsid: the stdin/stdout terminal becomes the controlling one
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Term:
    """``kvlocal chat ARGS`` on pseudo-terminals; :meth:`expect` waits for a pattern in its output."""

    def __init__(self, *args: str, cwd: Path, cache: Path, one_screen: bool = False):
        """``one_screen``: stderr on the same terminal too (as a person sees it; "err" then stays empty)."""
        self.io, io_slave = _pty()
        self.er, er_slave = (None, io_slave) if one_screen else _pty()
        env = {**os.environ, "KVLOCAL_CACHE": str(cache), "TERM": "xterm", "COLUMNS": "400", "LINES": "50",
               "INPUTRC": os.devnull}  # KVLOCAL_CACHE: readline's history goes there; INPUTRC: not the user's
        # greedy: replies are compared across chats and processes (the REPL's mechanics are under test, not sampling)
        args = ("--temp", "0", "--repeat-penalty", "1", *args)
        self.proc = subprocess.Popen([sys.executable, "-m", "kvlocal", "chat", *args], stdin=io_slave, stdout=io_slave,
                                     stderr=er_slave, cwd=cwd, env=env, start_new_session=True,
                                     preexec_fn=_take_terminal, close_fds=True)
        os.close(io_slave)
        if not one_screen:
            os.close(er_slave)
        self.raw = {"out": "", "err": ""}
        self._decoders = {k: codecs.getincrementaldecoder("utf-8")(errors="replace") for k in self.raw}
        self.pos = {"out": 0, "err": 0}  # expect() searches past these (in the cleaned text)
        self.log: list[tuple[str, bytes]] = []  # (stream, bytes) in arrival order

    # -- output -----------------------------------------------------------------------------------------
    def text(self, stream: str) -> str:
        return clean(self.raw[stream])

    def _pump(self, timeout: float) -> bool:
        """Read whatever either terminal has within ``timeout``; False once both are closed."""
        fds = [fd for fd in (self.io, self.er) if fd is not None]
        if not fds:
            return False
        ready, _, _ = select.select(fds, [], [], timeout)
        for fd in ready:
            name = "out" if fd == self.io else "err"
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the child closed its side
                data = b""
            if data:
                self.raw[name] += self._decoders[name].decode(data)
                self.log.append((name, data))
            else:
                os.close(fd)
                if fd == self.io:
                    self.io = None
                else:
                    self.er = None
        return True

    def expect(self, pattern: str | re.Pattern, stream: str = "err", timeout: float = STEP) -> re.Match:
        """Wait until ``pattern`` appears in ``stream`` ("out": stdout, "err": stderr) past the last match;
        the search then goes on after this match."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            text = self.text(stream)
            m = rx.search(text, self.pos[stream])
            if m:
                self.pos[stream] = m.end()
                return m
            left = deadline - time.monotonic()
            if left <= 0 or (not self._pump(min(left, 1.0)) and self.proc.poll() is not None):
                raise AssertionError(f"no {rx.pattern!r} on {stream} within {timeout} s "
                                     f"(exit code {self.proc.poll()}); the terminal showed:\n{self.screen()}")

    def prompt(self, timeout: float = STEP) -> None:
        """Wait for readline's empty prompt."""
        self.expect(PROMPT, "out", timeout)

    def screen(self) -> str:
        """Both streams as one terminal would have shown them (interleaved as they were read)."""
        return render(b"".join(d for _, d in self.log).decode("utf-8", errors="replace"))

    # -- input ------------------------------------------------------------------------------------------
    def send(self, data: bytes | str) -> None:
        os.write(self.io, data.encode() if isinstance(data, str) else data)

    def interrupt_at_prompt(self) -> None:
        """Ctrl-C at the prompt, once readline waits for a key. CPython's input() looks for signals only
        when the select() inside readline is interrupted: a SIGINT that lands while readline still digests
        the previous keystroke (or draws the prompt) waits unseen for the next byte. No hand types that
        fast; a test does, so it first lets the chat's main thread go to sleep in select()."""
        time.sleep(0.3)
        stat = Path(f"/proc/{self.proc.pid}/stat")
        deadline, asleep = time.monotonic() + (30 if stat.exists() else 1), 0  # no /proc (macOS): 1 s
        while asleep < 3 and time.monotonic() < deadline:
            state = stat.read_text().rsplit(")", 1)[1].split()[0] if stat.exists() else "?"
            asleep = asleep + 1 if state == "S" else 0
            time.sleep(0.1)
        self.send(b"\x03")

    def line(self, text: str) -> None:
        self.send(text + "\r")  # Enter on a terminal in raw mode (readline's) is CR

    def ask(self, text: str, timeout: float = STEP) -> tuple[str, re.Match]:
        """Send a message at the prompt; returns (the reply as stdout showed it, the status line's match)."""
        self.line(text)
        echo = self.expect(re.escape(text.splitlines()[-1]) + r"\n", "out", timeout)
        start = echo.end()
        status = self.expect(STATUS, "err", timeout)
        self.prompt(timeout)
        return self.text("out")[start:self.pos["out"]].removesuffix("> ").removesuffix("\n"), status

    def wait(self, timeout: float = STEP) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._pump(0.2)
        while self._pump(0.2) and (self.io is not None or self.er is not None):  # the rest of the output
            if time.monotonic() > deadline + 10:
                break
        return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for fd in (self.io, self.er):
            if fd is not None:
                os.close(fd)
        self.io = self.er = None


@pytest.fixture
def term(tmp_path):
    """make(*args) -> a started Term (killed at the end of the test if it is still running)."""
    started: list[Term] = []

    def make(*args: str) -> Term:
        t = Term(*args, cwd=tmp_path, cache=tmp_path / "cache")
        started.append(t)
        return t

    yield make
    for t in started:
        t.close()


def _n(s: str) -> int:
    return int(s.replace(",", ""))


def _document(tmp_path: Path) -> Path:
    """About 6,000 characters of real prose (the GPL's preamble and first sections), cut at a line end."""
    text = (REPO / "kvlocal" / "data" / "gpl-3.0.txt").read_text()
    doc = tmp_path / "gpl.txt"
    doc.write_text(text[:text.rindex("\n", 0, 6000) + 1])
    return doc


def _statuses(t: Term) -> int:
    return len(STATUS.findall(t.text("err")))


@pytest.mark.slow(24)
def test_session(term, smollm2, tmp_path):
    """One sitting: a question, a document read and asked about, multi-line messages, the commands."""
    from kvlocal.chat import saved

    doc = _document(tmp_path)
    t = term(str(smollm2), "--budget", "256", "-n", "24")
    t.expect(r"kvlocal chat · SmolLM2-135M-Instruct\.Q4_1 · budget 256: 256 tokens in [\d,]+ MiB "
             r"\(llama\.cpp's cache at -c 8192: 180 MiB\) · criticalkv, recall on, state backend · greedy\n")
    t.expect(r"Type a message, /help for commands; Ctrl-C stops a reply, Ctrl-D exits\.")
    t.prompt()

    reply, status = t.ask("What is the capital of Germany?")
    assert "Berlin" in reply
    assert reply == reply.strip() and "[ prompt" not in t.text("out")  # stdout: the reply text only
    assert 0 < _n(status[2]) < 256

    t.line(f"/read {doc.name}")
    m = t.expect(r"\[read gpl\.txt: ([\d,]+) tokens, read whole in host memory; ask about it\]")
    read = _n(m[1])
    assert read > 1000
    status = t.expect(STATUS)
    kept, seen = _n(status[1]), _n(status[2])
    assert seen > read and kept < seen and kept <= 512, status[0]  # 512: the cells allocated for a 256 budget
    t.prompt()

    reply, status = t.ask("What is this text about?")
    assert reply.strip()
    assert _n(status[1]) < _n(status[2])

    # a trailing backslash continues the message on the next line: one message, one reply
    before = _statuses(t)
    t.line("Name three colors \\")
    t.expect(r"\.\.\. $", "out")
    reply, _ = t.ask("of the rainbow.")
    assert reply.strip() and _statuses(t) == before + 1

    # a """ block: every line up to the closing """ is one message
    t.line('"""')
    t.expect(r"\.\.\. $", "out")
    t.line("Say hello")
    t.expect(r"\.\.\. $", "out")
    t.line("in French.")
    t.expect(r"\.\.\. $", "out")
    reply, _ = t.ask('"""')
    assert reply.strip() and _statuses(t) == before + 2

    t.line("/stats")
    rows = t.expect(r"  model +SmolLM2-135M-Instruct\.Q4_1\.gguf; criticalkv, budget 256; sampling greedy\n"
                    r"  tokens_seen +([\d,]+): ([\d,]+) read, ([\d,]+) generated, ([\d,]+) end-of-reply\n"
                    r"  tokens_kept +([\d,]+) in the cache now\n"
                    r"  budget_cells +256 \(512 cells allocated: the budget, a chunk and the recent span\)\n"
                    r"  kv_bytes +[\d,.]+ MiB allocated for this cache \(K f16, V f16\)\n"
                    r"  ctx_size +8,192 tokens: the context the budget is a share of[^\n]*\n"
                    r"  kv_bytes_full +180\.0 MiB: llama\.cpp's own cache, uncompressed, for ctx_size\n"
                    r"  host_tier_bytes +[\d,.]+ MiB of host memory: the recall tier, [\d,]+ rows stored, "
                    r"[\d,]+ brought back \(a row may come back often\) by \d+ questions?[^\n]*\n"
                    r"  host_tier_cap +[\d,.]+ MiB of RAM \(--recall-mem\), [\d,.]+ MiB held; past it the oldest rows "
                    r"are dropped: 0 so far[^\n]*\n"
                    r"  reading +a turn longer than the free cells is read whole in host memory \(up to [\d,]+ "
                    r"cells\), then compressed once: \d+ turns? so far, at most [\d,.]+ MiB while read\n"
                    r"  compression +(\d+) events?, [\d.]+ s[^\n]*\n"
                    r"  speed +last turn: prompt (?:[\d,.]+|–) t/s, gen (?:[\d,.]+|–) t/s; all: read [\d.]+ s, generate [\d.]+ s\n"
                    r"  positions +moved back under the trained 8,192 0 times\n"
                    r"  rollback +last turn [\d,.]+ MiB, all [\d,.]+ MiB copied to the host to undo a turn[^\n]*\n"
                    r"  messages +(\d+)\n")
    assert _n(rows[1]) == _n(rows[2]) + _n(rows[3]) + _n(rows[4]) and _n(rows[5]) < _n(rows[1]) and int(rows[6]) > 0
    assert rows[7] == "8"  # 4 messages, each with one reply
    t.prompt()

    t.line("/help")
    t.expect(r"Type a message and press Enter")
    for command in ("/read FILE", "/budget B", "/method M", "/regen", "/save PATH", "/load PATH", "/clear", "/stats",
                    "/help", "/exit"):
        t.expect(re.escape(command))
    t.prompt()

    t.line("/frobnicate now")
    t.expect(r"\nunknown command /frobnicate: /help lists them\n")
    t.prompt()

    t.line("/save chat.kvl")
    t.expect(r"\[saved to chat\.kvl \([\d.]+ MiB\)\]")
    t.prompt()
    users = [m["content"] for m in saved.read(tmp_path / "chat.kvl").header["transcript"]["messages"]
             if m["role"] == "user"]
    assert users[0] == "What is the capital of Germany?"
    assert users[1].endswith("What is this text about?") and "GNU GENERAL PUBLIC LICENSE" in users[1]
    assert users[2:] == ["Name three colors \nof the rainbow.", "Say hello\nin French."]

    t.line("/exit")
    assert t.wait() == 0
    history = (tmp_path / "cache" / "chat_history").read_text()  # readline's history: in KVLOCAL_CACHE
    assert "What is the capital of Germany?" in history and "/exit" in history
    print(t.screen())


@pytest.mark.slow(4)
def test_ctrl_c_stops_a_reply_and_keeps_it(term, smollm2, tmp_path):
    """Ctrl-C during a reply stops it and keeps it; during a /read it cancels it; at the prompt it drops the
    line; Ctrl-D exits."""
    from kvlocal.chat import saved

    t = term(str(smollm2), "--budget", "256", "-n", "400")
    t.prompt()
    t.line("Write a long story about a dragon.")
    echo = t.expect(r"dragon\.\n", "out")
    t.expect(r"\S{3}(?:\s+\S+){5}", "out")  # a few words of the story have streamed
    t.send(b"\x03")
    t.expect(r"\n\[stopped: the reply so far stays in the chat\]\n")
    status = t.expect(STATUS)
    t.prompt()
    partial = t.text("out")[echo.end():t.pos["out"]].removesuffix("> ").strip().removesuffix("^C")  # the tty's echo
    assert partial
    assert int(status[2].replace(",", "")) < 200  # stopped well before 400 tokens

    reply, status = t.ask("What is the capital of Italy?")
    assert "Rome" in reply
    seen = status[2]

    # Ctrl-C while a document is read: cancelled, the chat as it was
    t.line(f"/read {_document(tmp_path).name}")
    t.expect(r"reading gpl\.txt: +\d+%")  # its progress bar: the reading has begun
    t.send(b"\x03")
    t.expect(r"\n\[cancelled: the chat is as it was\]\n")
    t.prompt()

    # Ctrl-C at the prompt: what was typed is dropped, a hint, the prompt again
    t.send(b"something half-typed")
    t.expect(r"half-typed$", "out")
    t.interrupt_at_prompt()
    t.expect(r"\(Ctrl-D or /exit quits\)\n")
    t.prompt()
    t.interrupt_at_prompt()  # and on an empty line
    t.expect(r"\(Ctrl-D or /exit quits\)\n")
    t.prompt()

    t.line("/stats")
    t.expect(rf"  tokens_seen +{seen}:")  # nothing of the cancelled document
    t.expect(r"  messages +4\n")  # the story's question, the story so far, the question, its answer
    t.prompt()
    t.line("/save s.kvl")
    t.expect(r"\[saved to s\.kvl")
    t.prompt()
    messages = saved.read(tmp_path / "s.kvl").header["transcript"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert partial in messages[1]["content"]  # (a token decoded as Ctrl-C came may not have been shown)
    t.send(b"\x04")  # Ctrl-D at an empty prompt
    assert t.wait() == 0
    assert "Traceback" not in t.screen()


def test_a_saved_chat_gives_the_same_next_reply_in_a_new_process(term, smollm2, tmp_path):
    """/save, then --load (and /load) in another process: the identical next reply; a cut file is refused."""
    q1, q2 = "What is the capital of Germany?", "And what is the capital of Italy?"
    a = term(str(smollm2), "--budget", "256", "-n", "24")
    a.prompt()
    a.ask(q1)
    a.line("/save s.kvl")
    a.expect(r"\[saved to s\.kvl \([\d.]+ MiB\)\]")
    a.prompt()
    r2, status_a = a.ask(q2)
    assert r2.strip()
    a.line("/exit")
    assert a.wait() == 0

    saved_file = tmp_path / "s.kvl"
    data = saved_file.read_bytes()
    (tmp_path / "cut.kvl").write_bytes(data[:len(data) - 1000])

    b = term(str(smollm2), "--load", "s.kvl")
    b.expect(r"kvlocal chat · SmolLM2-135M-Instruct\.Q4_1 · budget 256: 256 tokens")
    b.prompt()
    reply, status_b = b.ask(q2)
    assert reply == r2
    assert status_b.groups() == status_a.groups()  # the same cache: tokens kept and seen

    b.line("/load cut.kvl")
    refusal = b.expect(r"\nkvlocal: (cut\.kvl is truncated or was modified[^\n]*)\n")
    assert "cannot be loaded" in refusal[1]
    b.prompt()
    b.line("/stats")
    b.expect(r"  messages +4\n")  # the session goes on as it was
    b.prompt()

    b.line("/load s.kvl")  # the command loads it as --load did
    b.expect(r"\[loaded s\.kvl: 2 messages, [\d,]+ tokens seen\]")
    b.expect(STATUS)
    b.prompt()
    reply, _ = b.ask(q2)
    assert reply == r2
    b.line("/exit")
    assert b.wait() == 0
    assert "Traceback" not in b.screen()
