"""Ctrl-C inside work that must finish or not happen at all (a compression event, a cache rewrite)."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_deferred(on_signal=None):
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block ends, then raise
    KeyboardInterrupt (in place of any error the block raised: the interrupted work is discarded).
    ``on_signal()`` runs when the signal arrives (e.g. to stop a computation early). Only the main
    thread receives signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []

    def handler(signum, frame):
        pending.append(signum)
        if on_signal is not None:
            on_signal()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    except BaseException:
        if not pending:
            raise
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt
