"""An in-process ``kvlocal serve``: the real app on a real Worker, served by uvicorn on a thread, for tests
that need the worker's inside (tests/server/test_server.py, tests/chat/test_tools.py). Waits are bounded."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

WAIT = 120  # seconds: the bound on starting and stopping; never an assertion on how long something took


@contextlib.contextmanager
def in_process_server(model, model_id: str, max_tokens: int = 16, **chat_options):
    """Yields (url, worker) for ``model`` (a loaded kvlocal Model) with ``chat_options`` (Chat's keywords)."""
    import uvicorn

    from kvlocal.server.app import create_app
    from kvlocal.server.worker import Worker

    worker = Worker(model, model_id, chat_options=dict(method="criticalkv", n_threads=1, **chat_options),
                    defaults={}, max_tokens=max_tokens)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(worker), log_level="warning", access_log=False, lifespan="off")
    userver = uvicorn.Server(config)
    thread = threading.Thread(target=userver.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not userver.started:
        if time.monotonic() > deadline or not thread.is_alive():
            userver.should_exit = True
            worker.close()
            pytest.fail(f"the in-process server did not start within {WAIT} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", worker
    finally:
        userver.should_exit = True
        thread.join(WAIT)
        worker.close()
