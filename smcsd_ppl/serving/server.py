"""Serving an app with uvicorn on a socket bound up front: in the foreground, or on a thread.

A stop signal drains before it stops: new requests get 503 at once, the running ones may
finish for up to the grace period, then whatever still runs is cancelled and answers with
the text it had settled and the finish reason ``cancelled``; then uvicorn shuts down.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

# Seconds running requests may take to finish after a stop signal before they are cancelled.
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


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains its app's engine on the first stop signal (a second one stops at once).

    Args:
        config: uvicorn's settings of the app (``build_app``'s).
        grace_seconds: how long running requests may take to finish.
    """

    def __init__(self, config: uvicorn.Config, grace_seconds: float = GRACEFUL_SECONDS) -> None:
        super().__init__(config)
        self.grace_seconds, self.draining = grace_seconds, False
        self.engine_died = False  # the server stopped because its engine's process ended
        service = getattr(getattr(config.app, "state", None), "service", None)
        died = getattr(getattr(service, "engine", None), "died", None)
        if died is not None:
            threading.Thread(target=self._watch, args=(died,), daemon=True, name="smcsd-watch").start()

    def _watch(self, died: threading.Event) -> None:
        """Stop serving once the engine's process has ended on its own (a supervisor restarts us)."""
        died.wait()
        self.engine_died = self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        """The first signal starts the drain; a second stops now, as uvicorn does."""
        service = getattr(getattr(self.config.app, "state", None), "service", None)
        if self.draining or service is None:
            super().handle_exit(sig, frame)
            return
        self.draining = service.closing = True  # from now on: 503
        threading.Thread(target=self._drain, args=(service.engine,), daemon=True, name="smcsd-drain").start()

    def _drain(self, engine) -> None:
        deadline = time.monotonic() + self.grace_seconds
        while engine.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        engine.close(cancel=True)  # what still runs answers with its settled text, "cancelled"
        self.should_exit = True


def uvicorn_server(
    app, *, log_level: str = "warning", grace_seconds: float = GRACEFUL_SECONDS
) -> DrainingServer:
    """A uvicorn server of ``app`` that drains on a stop signal (lifespan on: shutdown closes the engine)."""
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5)
    return DrainingServer(config, grace_seconds)


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
        """Stop: uvicorn's shutdown, then the app's (which closes the engine)."""
        self.server.should_exit = True
        self.thread.join(timeout=GRACEFUL_SECONDS + 10)
