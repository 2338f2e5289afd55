"""`shardserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn, the [server] extra).

Start-up order: validate the engine options here (a bad flag is `error: ...`, exit 2), spawn the
engine-core process and wait for its model to load, then start uvicorn; the app's lifespan
connects the ZMQ sockets. Shutdown (SIGTERM, Ctrl-C): uvicorn stops taking requests and gives open
ones a short grace, then the lifespan stops the engine process, which stops its workers.
Exit status: 0 after SIGTERM, 130 after Ctrl-C (SIGINT), both after that cleanup.

`--port 0` lets the OS choose a free port (no other process can take it between choosing and
binding); the log line "serving ... on http://HOST:PORT" and `--port-file` tell the port.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path
from typing import Any

from shardserve.entrypoints.cli import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)

# uvicorn's grace for open connections at shutdown; the engine's stop takes the rest of the 5 s.
_GRACEFUL_S = 1.0


class _Terminated(Exception):
    """SIGTERM: a normal way to stop the server (exit status 0)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


class ServeCommand:
    name = "serve"
    help = "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/...)."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("server options")
        group.add_argument("--host", default="127.0.0.1", help="Address to bind (default: "
                           "127.0.0.1; 0.0.0.0 serves every interface).")
        group.add_argument("--port", type=int, default=8000, help="Port (default: 8000; 0: "
                           "one the OS chooses, see --port-file).")
        group.add_argument("--port-file", default=None, metavar="PATH", help="Once the server "
                           "accepts requests, write the port it listens on to PATH (for --port 0).")
        group.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY' "
                           "on /v1/* requests.")
        group.add_argument("--served-model-name", default=None, help="The model name clients "
                           "send (default: the --model value, or the default model's name).")
        group.add_argument("--uvicorn-log-level", default="info",
                           choices=["critical", "error", "warning", "info", "debug"])
        group.add_argument("--access-log", action="store_true",
                           help="Log every HTTP request (off by default).")
        add_engine_args(parser)

    def run(self, args: argparse.Namespace) -> int:
        try:
            import uvicorn

            from shardserve.entrypoints.server.app import build_app
            from shardserve.entrypoints.server.async_engine import AsyncEngineClient
        except ImportError as e:
            raise ValueError(f"{e}; install the server extra: pip install 'shardserve[server]'") \
                from e
        from shardserve.config import EngineConfig

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                            "%(message)s")
        config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
        if config.parallel_config.distributed_executor_backend == "external_launcher":
            raise ValueError(
                "--distributed-executor-backend external_launcher runs a whole engine in every "
                "torchrun rank, for offline LLM.generate; serve with 'mp' (one machine) or "
                "'ray' / 'ray_v2' (a cluster)"
            )
        served, aliases = served_names(args.model, args.served_model_name,
                                       config.model_config.path)
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        client = None
        try:
            client = AsyncEngineClient(config)
            app = build_app(client, served, aliases, args.api_key)
            uv_config = uvicorn.Config(app, host=args.host, port=args.port,
                                       log_level=args.uvicorn_log_level,
                                       access_log=args.access_log,
                                       timeout_graceful_shutdown=_GRACEFUL_S)
            _server_class()(uv_config, client.begin_shutdown, served, args.port_file).run()
        except _Terminated:
            logger.info("terminated")
        finally:
            if client is not None:
                client.shutdown_sync()  # no-op after the lifespan's shutdown
            signal.signal(signal.SIGTERM, previous)
        return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, telling the engine client as soon as a stop signal arrives."""

        def __init__(self, config: uvicorn.Config, on_exit: Any, served: str,
                     port_file: str | None) -> None:
            super().__init__(config)
            self._on_exit = on_exit
            self._served = served
            self._port_file = port_file

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if not self.started:
                return
            # The bound port, not the requested one: with --port 0 only the socket knows it.
            # (A host name with several addresses gets one socket each; the first is reported.)
            port = self.servers[0].sockets[0].getsockname()[1]
            logger.info("serving %s on http://%s:%d", self._served, self.config.host, port)
            if self._port_file:
                _write_atomically(self._port_file, f"{port}\n")

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                logger.info("signal %d: shutting down", sig)
            super().handle_exit(sig, frame)
            self._on_exit()

    return Server


def _write_atomically(path: str, text: str) -> None:
    """A reader polling for `path` never sees it half-written."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def served_names(model: str | None, served: str | None, path: Path) -> tuple[str, set[str]]:
    """The name /v1/models reports, and every name a request may use for this model."""
    name = served or model or path.stem
    return name, {name, str(path), path.name, path.stem, *([model] if model else [])}
