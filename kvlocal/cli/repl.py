"""``kvlocal chat``: the terminal chat (a REPL in llama-cli's spirit) on :class:`kvlocal.Chat`.

Replies stream to stdout; everything else (banner, progress bars, the status line after each reply,
command output) goes to stderr, so ``kvlocal chat < questions.txt > answers.txt`` keeps only the
answers. Line editing and history come from GNU readline (history in the cache folder). Piped input
works the same way: one message per line, commands included, each echoed to stderr.
"""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path
from typing import Callable, Iterator

from kvlocal.chat import Chat
from kvlocal.chat.conversation import Turn
from kvlocal.chat.texts import full_cache_text, mib_text, rate_text
from kvlocal.errors import UsageError, worded

HELP = """\
Type a message and press Enter. A reply streams as it is generated; the status line after it shows
what the KV cache holds: tokens kept of tokens seen, the memory they take, and what llama.cpp's own
cache for the same context (-c) would take. A reply that keeps repeating itself is stopped (--loop-guard).

  multi-line   end a line with \\ to continue it, or put \"\"\" alone on a line to start and end a block
               (a paste into a terminal with bracketed paste arrives as one message)
  Ctrl-C       stop a reply (what was written stays in the chat); cancel reading a document
  Ctrl-D       exit

  /read FILE     read a text file into the chat now (whole, then compressed); then ask about it
  /budget B      change the KV budget (0.1 = a tenth of the context, 2048 = cells): the chat is re-read
  /method M      change the compression method: {methods}
  /regen         take back the last reply and generate it again
  /save PATH     save the chat with its compressed cache to one file
  /load PATH     load a saved chat (same model): the next reply is the one the saved chat would give
  /clear         start over (the system message stays)
  /stats         memory, speed and compression figures
  /help          this text
  /exit          quit

A chat never stops for length. Past the model's trained context, positions are moved back under it
(StreamingLLM's "positions within the cache": older kept tokens are renumbered in order, the recent
ones keep their exact distances); the status line counts these moves."""


def help_text() -> str:
    """:data:`HELP` with the methods of the registry (:data:`kvlocal.compress.METHODS`) listed under ``/method``."""
    import textwrap

    from kvlocal.compress import methods_help

    lines = textwrap.wrap(methods_help(), width=110 - 49)
    return HELP.replace("{methods}", ("\n" + " " * 49).join(lines))


def _progress(desc: str):
    """A tqdm bar on stderr as a ``progress(done, total)`` callback, and a function that closes it."""
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            # disable=None: no bar when stderr is not a terminal (a log stays readable)
            bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False, dynamic_ncols=True, disable=None)
        bar.update(done - bar.n)

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close


class Repl:
    def __init__(self, chat: Chat, interactive: bool, out=sys.stdout, err=sys.stderr):
        self.chat, self.interactive, self.out, self.err = chat, interactive, out, err
        self.commands: dict[str, Callable[[str], bool | None]] = {
            "/help": self.help, "/exit": self.exit, "/quit": self.exit, "/clear": self.clear, "/stats": self.stats,
            "/read": self.read, "/budget": self.budget, "/method": self.method, "/save": self.save,
            "/load": self.load, "/regen": self.regen,
        }

    # -- input ----------------------------------------------------------------------------------------
    def messages(self, read_line: Callable[[str], str]) -> Iterator[str]:
        """Complete messages from lines: ``\\`` continuations and ``\"\"\"`` blocks joined; Ctrl-C at the
        prompt drops what was typed. Ends at end of input."""
        while True:
            try:
                line = read_line("> ")
                if line.strip() == '"""':
                    parts = []
                    while (line := read_line("... ")).strip() != '"""':
                        parts.append(line)
                    yield "\n".join(parts)
                    continue
                parts = [line]
                while parts[-1].endswith("\\"):
                    parts[-1] = parts[-1][:-1]
                    parts.append(read_line("... "))
                yield "\n".join(parts)
            except KeyboardInterrupt:
                self.say("\n(Ctrl-D or /exit quits)")
            except EOFError:
                return

    # -- loop -----------------------------------------------------------------------------------------
    def run(self, read_line: Callable[[str], str]) -> int:
        for text in self.messages(read_line):
            if self.dispatch(text) is False:
                return 0
        if self.interactive:
            self.say("")
        return 0

    def dispatch(self, text: str) -> bool | None:
        """Run one message or command; False: the chat ends. Errors and Ctrl-C are reported, never raised."""
        if not text.strip():
            return None
        word, _, rest = text.strip().partition(" ")
        try:
            if word in self.commands:
                return self.commands[word](rest.strip())
            if word.startswith("/") and len(word) > 1 and "\n" not in text:
                self.say(f"unknown command {word}: /help lists them")
            else:
                self.reply(lambda: self.chat.send(text))
        except UsageError as e:  # a setting named as its flag (kvlocal.errors)
            from kvlocal.settings import flag_name

            self.say(f"kvlocal: {worded(e, flag_name)}")
        except KeyboardInterrupt:
            self.say("\n[cancelled: the chat is as it was]")
        return None

    def reply(self, start: Callable[[], Iterator[str]]) -> None:
        """Stream a reply (a turn of the conversation core, :class:`~kvlocal.chat.conversation.Turn`) to stdout, then
        the status line. Ctrl-C: stop it, keeping what was written."""
        n_messages = len(self.chat.messages)
        pieces = start()  # lazy: the message is read at the first step (/regen takes the last reply back now)
        turn = Turn(self.chat, lambda: pieces)
        try:
            for piece in turn:
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:
            turn.close()  # keeps the reply so far in the chat
            if len(self.chat.messages) == n_messages:  # stopped while the message was read: undone
                raise
            self.out.write("\n")
            self.say("[stopped: the reply so far stays in the chat]")
        else:
            self.out.write("\n")
            note = {"loop": f"[stopped: the reply kept repeating itself (--loop-guard {self.chat.settings.loop_guard}; "
                            f"0 turns the guard off); /regen draws another]",
                    "length": f"[stopped at the reply limit of {self.chat.settings.max_reply} tokens (-n)]"}
            if turn.result.finish_reason in note:
                self.say(note[turn.result.finish_reason])
        self.out.flush()
        self.say(self.chat.status_line())

    def say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    # -- commands (a False return ends the chat) --------------------------------------------------------
    def help(self, arg: str) -> None:
        self.say(help_text())

    def exit(self, arg: str) -> bool:
        return False

    def clear(self, arg: str) -> None:
        self.chat.clear()
        self.say("[a new chat]")

    def stats(self, arg: str) -> None:
        """The figures under the names the server's ``kv`` object and ``kvlocal run --json`` give them."""
        s, e, f = self.chat.stats, self.chat.engine.stats, self.chat.engine.kv_figures()
        mib = 2**20
        rows = [
            ("model", f"{self.chat.model.path.name}; {s.method}, budget {s.budget}; sampling {self.chat.sampler.describe()}"),
            ("tokens_seen", f"{f['tokens_seen']:,}: {e.prompt_tokens:,} read, {e.generated_tokens:,} generated, "
                            f"{e.end_tokens:,} end-of-reply"),
            ("tokens_kept", f"{f['tokens_kept']:,} in the cache now"
                            + (f", {s.kv_cells_pinned:,} of them the system message's (never evicted)"
                               if s.kv_cells_pinned else "")),
            ("budget_cells", f"{f['budget_cells']:,} ({s.kv_cells_allocated:,} cells allocated: the budget, a chunk "
                             f"and the recent span)"),
            ("kv_bytes", f"{f['kv_bytes'] / mib:,.1f} MiB allocated for this cache (K {self.chat.settings.cache_type_k}, "
                         f"V {self.chat.settings.cache_type_v})"),
            ("ctx_size", f"{f['ctx_size']:,} tokens: the context the budget is a share of (-c; default the model's "
                         f"trained {self.chat.model.n_ctx_train:,})"),
            ("kv_bytes_full", f"{f['kv_bytes_full'] / mib:,.1f} MiB: llama.cpp's own cache, uncompressed, for "
                              + ("ctx_size" if f["tokens_seen"] <= f["ctx_size"]
                                 else f"all {f['tokens_seen']:,} tokens seen (more than ctx_size)")),
            ("host_tier_bytes", (f"{f['host_tier_bytes'] / mib:,.1f} MiB of host memory: the recall tier, "
                                 f"{e.recall_rows_out:,} rows stored, {e.recall_rows_in:,} brought back (a row may come "
                                 f"back often) by {_count(e.recall_events, 'question')} ({e.recall_seconds:.2f} s) and "
                                 f"{e.recall_steps - e.recall_steps_confident} of {_count(e.recall_steps, 'answer token')} "
                                 f"({e.recall_step_seconds:.2f} s; the others' decodes were sure)"
                                 + (f", {e.recall_dropped_rows:,} forgotten (positions moved back, or an event "
                                    f"past the cap)" if e.recall_dropped_rows else ""))
                                if self.chat.engine.tier is not None else "0: recall off"),
            ("host_tier_cap", _tier_cap_text(f, self.chat.settings.recall_dir)
                              if self.chat.engine.tier is not None else "none: recall off"),
            ("reading", _reading_text(e, self.chat.engine.read_cells)),
            ("compression", f"{_count(s.compression_events, 'event')}, {e.compression_seconds:.2f} s"
                            + "".join(f", {k} {v:.2f} s" for k, v in e.compression_breakdown.items())
                            + f"; {e.backend} backend, {e.host_kv_bytes / mib:,.1f} MiB of K/V moved by its events"),
            ("speed", f"last turn: prompt {rate_text(s.prompt_tokens_per_s, 1)} t/s, "
                      f"gen {rate_text(s.gen_tokens_per_s, 1)} t/s; "
                      f"all: read {e.prefill_seconds:.1f} s, generate {e.decode_seconds:.1f} s"),
            ("positions", f"moved back under the trained {self.chat.model.n_ctx_train:,} {_count(s.repositions, 'time')}"),
            ("rollback", f"last turn {s.rollback_bytes / mib:,.1f} MiB, all {s.rollback_bytes_total / mib:,.1f} MiB copied "
                         f"to the host to undo a turn (Ctrl-C, /regen): the cells, only before an event rewrites them"),
            ("messages", f"{len(self.chat.messages)}"),
        ]
        self.say("\n".join(f"  {k:<16} {v}" for k, v in rows))

    def read(self, arg: str) -> None:
        if not arg:
            raise UsageError("/read needs a file: /read notes.txt")
        path = Path(_one_path(arg)).expanduser()
        update, close = _progress(f"reading {path.name}")
        e = self.chat.engine.stats
        before = e.reading_contexts
        try:
            n = self.chat.read(path, progress=update)
        finally:
            close()
        whole = ", read whole in host memory" if e.reading_contexts > before else ""  # (its bytes: /stats)
        self.say(f"[read {path.name}: {n:,} tokens{whole}; ask about it]")
        self.say(self.chat.status_line())

    def budget(self, arg: str) -> None:
        if not arg:
            raise UsageError(f"/budget needs a value (now {self.chat.settings.budget}): /budget 0.25 or /budget 2048")
        self._reconfigure(budget=arg)

    def method(self, arg: str) -> None:
        from kvlocal.compress import METHODS

        if arg not in METHODS:
            raise UsageError(f"/method takes one of {', '.join(METHODS)} (now {self.chat.settings.method})")
        self._reconfigure(method=arg)

    def _reconfigure(self, **change) -> None:
        update, close = _progress("re-reading the chat")
        try:
            self.chat.reconfigure(progress=update, **change)
        finally:
            close()
        self.say(f"[{self.chat.settings.method}, budget {self.chat.settings.budget}: {self.chat.engine.budget_cells:,} cells]")

    def regen(self, arg: str) -> None:
        self.reply(self.chat.regen)

    def save(self, arg: str) -> None:
        if not arg:
            raise UsageError("/save needs a file name: /save notes.kvl")
        path = Path(_one_path(arg)).expanduser()
        size = self.chat.save(path)
        self.say(f"[saved to {path} ({size / 2**20:.1f} MiB)]")

    def load(self, arg: str) -> None:
        if not arg:
            raise UsageError("/load needs a file saved with /save: /load notes.kvl")
        path = Path(_one_path(arg)).expanduser()
        chat = Chat.load(path, model=self.chat.model, sampler=self.chat.sampler, n_threads=self.chat._threads)
        self.chat.close()
        self.chat = chat
        self.say(f"[loaded {path}: {len(chat.messages)} messages, {chat.stats.tokens_seen:,} tokens seen]")
        self.say(chat.status_line())


def banner(chat: Chat, info) -> str:
    """What the chat is doing, in one line: the model, the budget in tokens and MiB against llama.cpp's own cache
    for the same context, the method, recall, the backend and the sampling."""
    s, e = chat.stats, chat.engine
    stock = "" if info.patched else f" · {info.describe()}"
    sp = chat.sampler
    sampling = "greedy" if sp.temp <= 0 else f"temp {sp.temp:g}" + ("" if sp.seed is None else f", seed {sp.seed}")
    budget = "no budget (--method full)" if s.method == "full" else f"budget {s.budget}"
    return (f"kvlocal chat · {chat.model.path.stem} · {budget}: {s.budget_cells:,} tokens in {mib_text(s.kv_bytes)} "
            f"({full_cache_text(s)}) · {s.method}, "
            f"recall {'on' if e.tier is not None else 'off'}, {e.backend} backend · {sampling}{stock}")


def _reading_text(e, read_cells: int | None) -> str:
    """/stats' line on how long turns are read (``--read-cells``; kvlocal/engine/reading.py)."""
    if read_cells == 0:
        return "chunk by chunk in the budget's cells (--read-cells 0)"
    cap = "no cap" if read_cells is None else f"up to {read_cells:,} cells"
    text = (f"a turn longer than the free cells is read whole in host memory ({cap}), then compressed once: "
            f"{_count(e.reading_contexts, 'turn')} so far, at most {e.reading_bytes_peak / 2**20:,.1f} MiB while read")
    return text + (f"; {e.reading_refused} read chunk by chunk (no memory for it)" if e.reading_refused else "")


def _tier_cap_text(f: dict, spill_dir: str | None) -> str:
    """``/stats``' row of the recall tier's RAM cap (``Engine.kv_figures``): the cap, what it holds, what happens
    past it and how much did."""
    mib = 2**20
    if f["host_tier_past_cap"] is None:
        return "none (--recall-mem none): the tier's RAM grows with every row evicted"
    head = f"{f['host_tier_cap'] / mib:,.1f} MiB of RAM (--recall-mem), {f['host_tier_cap_used'] / mib:,.1f} MiB held"
    if f["host_tier_past_cap"] == "spill":
        return f"{head}; past it rows go to a file in {spill_dir}: {f['host_tier_file_bytes'] / mib:,.1f} MiB there"
    return (f"{head}; past it the oldest rows are dropped: {f['host_tier_dropped_rows']:,} so far "
            f"(--recall-dir: to a file instead)")


def _count(n: int, noun: str) -> str:
    """``1 question``, ``2 questions``, ``0 times``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _one_path(arg: str) -> str:
    """A command's file argument: quoted (shell rules) or the rest of the line as it is."""
    try:
        parts = shlex.split(arg)
    except ValueError:
        parts = [arg]
    return parts[0] if len(parts) == 1 else arg


def _readline_input():
    """``input`` with GNU readline: editing, history in the cache folder, bracketed paste."""
    try:
        import readline
    except ImportError:  # Windows without pyreadline: plain input
        return input
    from kvlocal.models import cache_dir

    history = cache_dir() / "chat_history"
    try:
        readline.read_history_file(history)
    except OSError:
        pass
    readline.set_history_length(1000)
    readline.parse_and_bind("set enable-bracketed-paste on")

    import atexit

    def save_history():
        try:
            history.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(history)
        except OSError:
            pass

    atexit.register(save_history)
    return input


def _stdin_lines(prompt: str) -> str:
    """Piped input: each line is echoed to stderr after the prompt, so ``2>&1`` reads as a transcript
    while stdout alone keeps only the replies."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    print(prompt + line.rstrip("\n"), file=sys.stderr, flush=True)
    return line.rstrip("\n")


def run(args) -> int:
    """``kvlocal chat``: build the chat from the command line, read ``--file`` documents, loop."""
    from kvlocal.options import input_file, sampler_from_args, settings_from_args
    from kvlocal.models import resolve
    from kvlocal.runtime import runtime_info

    runtime, settings = settings_from_args(args, max_reply=args.n_predict)  # checked: SettingError names the field
    sampler_from_args(args).close()  # the sampling flags checked before a model loads (UsageError names the flag)
    for f in args.file or []:
        input_file("--file", f)
    path = resolve(args.model)
    info = runtime_info()
    model = runtime.load(path)
    try:
        sampler = sampler_from_args(args, model)  # the model's own sampling where its GGUF declares one
        if args.load:
            chat = Chat.load(args.load, model=model, sampler=sampler, n_threads=runtime.n_threads)
        else:
            chat = Chat(model, settings=settings, sampler=sampler, runtime=runtime)
        with chat:
            interactive = sys.stdin.isatty()
            repl = Repl(chat, interactive)
            repl.say(banner(chat, info))
            if interactive:
                # Ctrl-C stops a reply even where the parent ignored SIGINT (a shell's background job, a launcher):
                # an ignored disposition is inherited, and Python then installs no KeyboardInterrupt for it
                signal.signal(signal.SIGINT, signal.default_int_handler)
                repl.say("Type a message, /help for commands; Ctrl-C stops a reply, Ctrl-D exits.")
            for f in args.file or []:
                repl.dispatch(f"/read {shlex.quote(f)}")
            code = repl.run(_readline_input() if interactive else _stdin_lines)
            repl.chat.close()
            return code
    finally:
        model.close()
