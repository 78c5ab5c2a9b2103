"""Serving an app with uvicorn on a socket bound up front: in the foreground, or on a thread."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

# Seconds uvicorn lets running requests finish after a stop signal before it cancels them.
GRACEFUL_SECONDS = 30


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); ``ValueError`` if it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.listen(128)
    return sock


def url_of(sock: socket.socket) -> str:
    """The ``http://host:port`` a bound socket serves."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_server(app, *, log_level: str = "warning") -> uvicorn.Server:
    """A uvicorn server of ``app`` (lifespan on: the app's shutdown closes its scheduler)."""
    config = uvicorn.Config(
        app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=GRACEFUL_SECONDS
    )
    return uvicorn.Server(config)


class BackgroundServer:
    """``app`` served on a thread while the ``with`` block runs (tests, the load test); ``url`` once up.

    Args:
        app: an ASGI app (``build_app``).
        host: the address to listen on.
        port: the port (0: a free one).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> BackgroundServer:
        sock = bind(self.host, self.port)
        self.url = url_of(sock)
        self.server = uvicorn_server(self.app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *_exc) -> None:
        """Stop: uvicorn's shutdown, then the app's (which closes the scheduler)."""
        self.server.should_exit = True
        self.thread.join(timeout=GRACEFUL_SECONDS + 10)
