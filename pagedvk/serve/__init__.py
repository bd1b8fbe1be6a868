"""Layer 8, `pagedvk serve`: an OpenAI-compatible HTTP server (FastAPI and uvicorn, the `serve` extra) over an LLMEngine that
steps in a thread of its own (worker), the endpoints and their shapes (app, protocol), and a sample's text with stop
strings (text).

    runner = pagedvk.ModelRunner(pagedvk.load_model(path), max_batch=8, max_context=2048)
    worker = EngineWorker(LLMEngine(runner)).start()
    uvicorn.run(create_app(worker, "smollm2"), host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import importlib
import socket
import threading

for _name in ("fastapi", "uvicorn"):   # the `serve` extra, not installed with the base package
    try:
        importlib.import_module(_name)
    except ImportError as e:
        raise ImportError(f"pagedvk.serve needs the {_name!r} package: pip install 'pagedvk[serve]'") from e

import uvicorn  # noqa: E402

from .app import create_app  # noqa: E402
from .worker import EngineWorker, QueueFullError  # noqa: E402

__all__ = ["EngineWorker", "QueueFullError", "create_app", "serve_in_thread"]


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
    """Serve `app` with uvicorn in a daemon thread (tests, benchmarks); returns (server, thread, port) once it
    accepts connections. port 0 takes a free one. Stop it with ``server.should_exit = True; thread.join()``."""
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
