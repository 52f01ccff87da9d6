"""The real server in a test: uvicorn on a free localhost port, in a background thread."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import uvicorn

from fuselm.server.cli import listen, url_of


@contextmanager
def serving(app):
    """Run `app` with uvicorn in a background thread; yield its base URL (ending in /v1)."""
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
