"""Running the server: the engine (in a process of its own, or on a thread), the application, under uvicorn.

uvicorn (the ASGI server Starlette is written for; HTTP parsing by h11) stops on SIGTERM or Ctrl-C
the graceful way: it stops accepting connections, lets open requests finish for up to
`shutdown_timeout_s` seconds and then cuts them (their streams close, aborting their requests), and
only then runs the application's shutdown, which stops the engine.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from mla_func.server.app import ServerSettings, build_app
from mla_func.server.engine_loop import EngineLoop, EngineRunner
from mla_func.server.engine_process import EngineProcess, EngineRecipe
from mla_func.server.metrics import ServerMetrics
from mla_func.serving.engine import Engine

__all__ = ["Listen", "serve"]


@dataclass(frozen=True, slots=True)
class Listen:
    """The HTTP side's settings.

    model_name:         the name requests must give as "model"
    host, port:         where to listen
    max_waiting:        requests that may wait beyond the engine's max_num_seqs running ones (then 429)
    request_timeout_s:  a request still running after this many seconds is aborted (504)
    shutdown_timeout_s: on SIGTERM or Ctrl-C, how long open requests may take to finish before they are cut
    """

    model_name: str
    host: str
    port: int
    max_waiting: int
    request_timeout_s: float
    shutdown_timeout_s: float


def serve(engine: EngineRecipe | Engine, listen: Listen, say: Callable[[str], None], *,
          start_timeout_s: float = 1800.0) -> None:
    """Serve the engine on listen.host:port until SIGTERM or Ctrl-C.

    engine: an `EngineRecipe` is built and run in a process of its own (`EngineProcess`, what `mla-func
        serve` runs), which waits at most `start_timeout_s` seconds for it (EngineStartError); an `Engine`
        already built runs on a thread of this process (`EngineLoop`), sharing its GIL with the HTTP side.
        As for any process started with `spawn`, a script that serves a recipe does so under
        `if __name__ == "__main__":` (the engine's process imports the script's main module).
    """
    metrics = ServerMetrics()
    if isinstance(engine, Engine):
        _serve(EngineLoop(engine, metrics), metrics, listen, say)
        return
    with EngineProcess.launch(engine, metrics, timeout_s=start_timeout_s, say=say) as runner:
        _serve(runner, metrics, listen, say)


def _serve(runner: EngineRunner, metrics: ServerMetrics, listen: Listen, say: Callable[[str], None]) -> None:
    info = runner.info
    settings = ServerSettings(model_name=listen.model_name, max_model_len=info.max_model_len,
                              tokenizer=info.tokenizer, max_requests=info.max_num_seqs + listen.max_waiting,
                              request_timeout_s=listen.request_timeout_s)
    app = build_app(runner, metrics, settings, say)
    config = uvicorn.Config(app, host=listen.host, port=listen.port, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=int(listen.shutdown_timeout_s), http="h11")
    server = uvicorn.Server(config)
    # What lives as long as the server (modules, the application) leaves the collector's walks, which the
    # per-token garbage of many streams sets off.
    gc.freeze()
    say(f"listening on http://{listen.host}:{listen.port}")
    server.run()
