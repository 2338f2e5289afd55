"""`shardserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn, the [server] extra).

Start-up order: validate the engine options here (a bad flag is `error: ...`, exit 2), spawn the
engine-core process and wait for its model to load, then start uvicorn; the app's lifespan
connects the ZMQ sockets. Shutdown: on SIGTERM the server drains: new requests get 503, open
ones run on for up to --shutdown-timeout seconds, then the rest end with an error; uvicorn then
stops and the lifespan stops the engine process, which stops its workers. A second SIGTERM, or
Ctrl-C, ends every open request at once. When the engine dies, open requests get the error and
the server exits with status 1 (a supervisor restarts it) unless --keep-alive-on-engine-death.
Exit status: 0 after SIGTERM, 130 after Ctrl-C (SIGINT), 1 after the engine died.

SIGTERM sent to every process of the server at once (`kill -TERM -PGID`, systemd's default
KillMode=control-group) drains the same way: the engine processes and mp workers leave it to the
server (process_setup.py); Ray's actors do not (Ray's own SIGTERM handler ends them).

`--port 0` lets the OS choose a free port (no other process can take it between choosing and
binding); the log line "serving ... on http://HOST:PORT" and `--port-file` tell the port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardserve.entrypoints.cli import add_engine_args, engine_kwargs
from shardserve.entrypoints.server.limits import add_limit_args

logger = logging.getLogger(__name__)

# Drain: beyond --shutdown-timeout, when the client has ended every open request with an
# error, this long for those last events to be written out (and uvicorn's own grace).
_FLUSH_S = 2.0
# After the engine dies: time for the error to reach open clients before uvicorn stops, and
# the longest uvicorn may then take before it is forced.
_DEATH_EXIT_S, _DEATH_FORCE_S = 0.5, 5.0


class _Terminated(Exception):
    """SIGTERM: a normal way to stop the server (exit status 0)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


@contextlib.contextmanager
def _terminated_by_sigterm() -> Iterator[None]:
    """SIGTERM raises _Terminated inside the block (the caller exits 0); the previous handler
    is back afterwards."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
                           "on /v1/* requests (default: $SHARDSERVE_API_KEY, which keeps the key "
                           "out of `ps`; an empty key is refused).")
        group.add_argument("--disable-fastapi-docs", action="store_true", help="Serve no "
                           "/docs, /redoc or /openapi.json.")
        group.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                           help="On SIGTERM: stop taking requests and let open ones finish for "
                           "up to S seconds, then abort the rest (default: 30). A second "
                           "SIGTERM, or Ctrl-C, stops at once.")
        group.add_argument("--keep-alive-on-engine-death", action="store_true", help="Keep "
                           "serving (503) after the engine dies instead of exiting with "
                           "status 1 so that a supervisor restarts the server.")
        group.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                           help="Answer 503 with Retry-After once N engine requests are "
                           "waiting beyond those the engine runs at once (default: no limit).")
        group.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                           help="A Jinja chat template for /v1/chat/completions instead of the "
                           "model's own: a file's path, or the template itself.")
        group.add_argument("--enable-auto-tool-choice", action="store_true", help="Let the "
                           "model decide when to call tools (tool_choice auto); needs "
                           "--tool-call-parser.")
        group.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                           help="How tool calls are read from free text: hermes "
                           "(<tool_call>{...}</tool_call>, the SmolLM2 / Qwen2 / Hermes "
                           "format).")
        group.add_argument("--stream-interval", type=_positive_int, default=1, metavar="N",
                           help="Streamed responses send a request's first token at once, "
                           "then every N tokens in one event, and the rest at its end "
                           "(default: 1, every token). A larger N costs the front end less "
                           "work per token, which on a small machine goes to the model.")
        group.add_argument("--served-model-name", default=None, help="The model name clients "
                           "send (default: the --model value, or the default model's name).")
        group.add_argument("--headless", action="store_true", help="Run only this node's "
                           "workers for a multi-node engine (with --nnodes, --node-rank >= 1, "
                           "--master-addr, --master-port and the SHARDSERVE_CLUSTER_SECRET node 0 "
                           "printed); no HTTP server. Exits when node 0 stops or is gone.")
        group.add_argument("--lora-modules", nargs="+", default=None, metavar="ADAPTER",
                           help="LoRA adapters to serve (needs --enable-lora), each as "
                           "name=path or '{\"name\": ..., \"path\": ..., \"base_model_name\": "
                           "...}'; a request whose model is the name runs with it.")
        group.add_argument("--allow-runtime-lora-updating", action="store_true", help="Serve "
                           "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (need "
                           "--enable-lora and --api-key).")
        group.add_argument("--profiler-dir", default=None, metavar="DIR", help="Serve POST "
                           "/start_profile and /stop_profile (need --api-key): torch's profiler "
                           "on every rank and engine core, a Chrome trace each in DIR.")
        group.add_argument("--profiler-config", default=None, metavar="JSON", help="vLLM's "
                           "form of --profiler-dir: '{\"profiler\": \"torch\", "
                           "\"torch_profiler_dir\": DIR, \"torch_profiler_record_shapes\": "
                           "false, \"torch_profiler_with_stack\": false, "
                           "\"torch_profiler_with_memory\": false}'.")
        group.add_argument("--uvicorn-log-level", default="info",
                           choices=["critical", "error", "warning", "info", "debug"])
        group.add_argument("--access-log", action="store_true",
                           help="Log every HTTP request (off by default).")
        add_limit_args(parser)
        add_engine_args(parser)
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="The model, as `vllm serve MODEL` takes it (same as --model).")

    def run(self, args: argparse.Namespace) -> int:
        if args.headless:
            return _run_headless(args)
        try:
            import uvicorn

            from shardserve.engine.async_engine import AsyncEngineClient
            from shardserve.entrypoints.server.app import build_app
            from shardserve.entrypoints.server.limits import ServerLimits
            from shardserve.entrypoints.server.metrics import ServerMetrics
        except ImportError as e:
            raise ValueError(f"{e}; install the server extra: pip install 'shardserve[server]'") \
                from e
        from shardserve.engine.config_builder import engine_config_from_kwargs
        from shardserve.worker.profiler import ProfilerConfig

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                            "%(message)s")
        api_key = _api_key(args.api_key)
        args.model = _model_arg(args.model_tag, args.model)
        chat_template = _chat_template(args.chat_template)
        limits = ServerLimits.from_args(args)
        config = _with_server_recovery(engine_config_from_kwargs(args.model,
                                                                  **engine_kwargs(args)))
        if config.parallel_config.distributed_executor_backend == "external_launcher":
            raise ValueError(
                "--distributed-executor-backend external_launcher runs a whole engine in every "
                "torchrun rank, for offline LLM.generate; serve with 'mp' (one machine) or "
                "'ray' / 'ray_v2' (a cluster)"
            )
        served, aliases = served_names(args.model, args.served_model_name,
                                       config.model_config.path)
        lora_modules = _lora_modules(args, config)
        profiler = ProfilerConfig.parse(args.profiler_config, args.profiler_dir)
        client, status = None, 0
        with _terminated_by_sigterm():
            try:
                client = AsyncEngineClient(config, max_queued=args.max_queued_requests,
                                       stream_interval=args.stream_interval,
                                           metrics=ServerMetrics())
                app = build_app(client, served, aliases, api_key,
                                docs=not args.disable_fastapi_docs, limits=limits,
                                chat_template=chat_template,
                                tool_parser=_tool_parser(args), lora_modules=lora_modules,
                                allow_runtime_lora=args.allow_runtime_lora_updating,
                                profiler=profiler)
                uv_config = uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.uvicorn_log_level,
                                           access_log=args.access_log,
                                           timeout_graceful_shutdown=_FLUSH_S)
                server = _server_class()(uv_config, client, args, served)
                server.run()
                status = server.exit_status
            except _Terminated:
                logger.info("terminated")
                status = 0
            finally:
                if client is not None:
                    client.shutdown_sync()  # no-op after the lifespan's shutdown
        return status


def _run_headless(args: argparse.Namespace) -> int:
    from shardserve import envs
    from shardserve.engine.config_builder import engine_config_from_kwargs
    from shardserve.executor.multinode.headless import run_headless

    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    args.model = _model_arg(args.model_tag, args.model)
    config = engine_config_from_kwargs(args.model, **engine_kwargs(args))
    with _terminated_by_sigterm():
        try:
            return run_headless(config.parallel_config)
        except _Terminated:
            logger.info("terminated")
            return 0


def _with_server_recovery(config: Any) -> Any:
    """The server restarts a dead replica (5 times within 10 minutes) unless told otherwise
    (--max-engine-restarts); LLM and AsyncLLM do not by default."""
    from dataclasses import replace

    from shardserve.config.recovery import SERVER_MAX_ENGINE_RESTARTS

    recovery = config.recovery_config
    if recovery.max_engine_restarts is not None:
        return config
    return replace(config, recovery_config=replace(
        recovery, max_engine_restarts=SERVER_MAX_ENGINE_RESTARTS))


def _tool_parser(args: argparse.Namespace) -> str | None:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def _lora_modules(args: argparse.Namespace, config: Any) -> list[Any]:
    """--lora-modules (LoRAModule each), every adapter checked against the model before the
    engine starts (a bad one is `error: ...`, not a failed start minutes later); both LoRA
    flags need --enable-lora."""
    from shardserve.entrypoints.server.lora_serving import parse_lora_modules
    from shardserve.lora.peft_adapter import LoRAError, load_peft_adapter

    for flag, given in (("--lora-modules", args.lora_modules),
                        ("--allow-runtime-lora-updating", args.allow_runtime_lora_updating)):
        if given and config.lora_config is None:
            raise ValueError(f"{flag} needs --enable-lora (and --max-lora-rank at least the "
                             f"adapters' rank)")
    modules = parse_lora_modules(args.lora_modules)
    for m in modules:
        try:  # every shape checked, no weight read (layers=())
            load_peft_adapter(m.path, config.model_config.arch, config.lora_config.max_lora_rank,
                              layers=())
        except LoRAError as e:
            raise ValueError(f"--lora-modules {m.name}={m.path}: {e}") from e
    return modules


def _model_arg(positional: str | None, flag: str | None) -> str | None:
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"the model is given twice, as {positional!r} and --model {flag!r}; "
                         f"give one")
    return positional if positional is not None else flag


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it names no file (a template
    has Jinja tags; a missing file's path does not, and is refused)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template "
                     f"either; give a template file's path or the template text")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _api_key(flag: str | None) -> str | None:
    """--api-key, else SHARDSERVE_API_KEY; an empty one would silently disable the check."""
    from shardserve import envs

    key, source = (flag, "--api-key") if flag is not None else (envs.api_key(),
                                                                "SHARDSERVE_API_KEY")
    if key is not None and not key.strip():
        raise ValueError(f"{source} is empty; give a non-empty key, or unset it to serve "
                         f"without authentication")
    return key


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, draining the engine client on a stop signal and exiting when the
        engine dies."""

        def __init__(self, config: uvicorn.Config, client: Any, args: argparse.Namespace,
                     served: str) -> None:
            super().__init__(config)
            self._client = client
            self._served = served
            self._port_file = args.port_file
            self._shutdown_timeout = args.shutdown_timeout
            self.exit_status = 0
            self._draining = False
            if not args.keep_alive_on_engine_death:
                client.on_dead = self._on_engine_death

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
            self._captured_signals.append(sig)  # uvicorn re-raises it after its shutdown
            if self.should_exit:  # a third signal: stop waiting for anything
                self.force_exit = True
                return
            if sig == signal.SIGINT or self._draining:  # Ctrl-C, or a second signal
                logger.info("signal %d: stopping now", sig)
                # Every open request ends now with an error event, so uvicorn's wait for the
                # connections to close is short.
                self.should_exit = True
                self._client.begin_shutdown()
                return
            # Keep listening while draining, so that a new request gets a 503, not a refused
            # connection; uvicorn is told to stop once nothing is open.
            logger.info("signal %d: draining (up to %g s for %d open requests)", sig,
                        self._shutdown_timeout, self._client.num_open_requests)
            self._draining = True
            self._client.begin_drain(self._shutdown_timeout)
            loop = self._client.loop
            if loop is None:
                self.should_exit = True
                return
            loop.call_soon_threadsafe(lambda: loop.create_task(self._exit_when_drained()))

        async def _exit_when_drained(self) -> None:
            deadline = time.monotonic() + self._shutdown_timeout + _FLUSH_S
            while self._client.num_open_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self.should_exit = True

        def _on_engine_death(self, error: str) -> None:
            """In the event loop, after every open request got the error: stop serving."""
            logger.error("exiting (status 1) because %s", error)
            self.exit_status = 1
            loop = asyncio.get_running_loop()
            loop.call_later(_DEATH_EXIT_S, setattr, self, "should_exit", True)
            loop.call_later(_DEATH_EXIT_S + _DEATH_FORCE_S, setattr, self, "force_exit", True)

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
