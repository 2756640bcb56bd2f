"""Running the server: an engine, its loop and the application, under uvicorn.

uvicorn (the ASGI server Starlette is written for; HTTP parsing by h11) stops on SIGTERM or Ctrl-C
the graceful way: it stops accepting connections, lets open requests finish for up to
`shutdown_timeout_s` seconds and then cuts them (their streams close, aborting their requests), and
only then runs the application's shutdown, which stops the engine's loop.
"""

from __future__ import annotations

from collections.abc import Callable

import uvicorn

from mla_func.server.app import ServerSettings, build_app
from mla_func.server.engine_loop import EngineLoop
from mla_func.server.metrics import ServerMetrics
from mla_func.serving.engine import Engine


def serve(engine: Engine, *, model_name: str, host: str, port: int, max_waiting: int, request_timeout_s: float,
          shutdown_timeout_s: float, say: Callable[[str], None]) -> None:
    """Serve `engine` on host:port until SIGTERM or Ctrl-C.

    max_waiting: requests that may wait beyond the engine's max_num_seqs running ones (then 429).
    """
    metrics = ServerMetrics()
    settings = ServerSettings(model_name=model_name, max_model_len=engine.config.max_model_len,
                              tokenizer=engine.model.tokenizer, max_requests=engine.config.max_num_seqs + max_waiting,
                              request_timeout_s=request_timeout_s)
    app = build_app(EngineLoop(engine, metrics), metrics, settings, say)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=int(shutdown_timeout_s), http="h11")
    server = uvicorn.Server(config)
    say(f"listening on http://{host}:{port}")
    server.run()
