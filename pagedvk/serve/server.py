"""uvicorn serving an app in a daemon thread: the server's tests and benchmarks/serve_load.py start one on a loopback
port (`pagedvk serve` runs uvicorn in the foreground instead)."""

from __future__ import annotations

import socket
import threading

from .app import require

uvicorn = require("uvicorn")


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
    """Serve `app` with uvicorn in a daemon thread; returns (server, thread, port) once it accepts connections. port
    0 takes a free one. Stop it with ``server.should_exit = True; thread.join()``."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="pagedvk-http", daemon=True)
    thread.start()
    for _ in range(int(timeout / 0.01)):
        if server.started or not thread.is_alive():
            break
        threading.Event().wait(0.01)
    if not server.started:
        raise RuntimeError(f"uvicorn did not start on {host}:{sock.getsockname()[1]} within {timeout} s")
    return server, thread, sock.getsockname()[1]
