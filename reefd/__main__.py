"""`reefd`: flags and environment, config check, signals, sd_notify, and running the app.

Exit codes: 0 clean stop, 1 runtime failure (port in use, …), 2 bad configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from reefd import __version__, config, loop
from reefd.app import Settings, build_app, metrics_app
from reefd.cli.client import state_dir  # reefctl's STATE: the same folder
from reefd.ops import malloc, systemd
from reefd.ops.auth import KEYRING, load_tokens
from reefd.ops.tokens import TokensFileError, path_for
from reefd.ops.tokens import read as read_tokens_file
from reefd.tinker.service import Limits

log = logging.getLogger("reefd")


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reefd", description="Reef daemon: serve agents, record every turn, learn.")
    p.add_argument("command", nargs="?", choices=["serve", "schema"], default="serve",
                   help="serve (default), or schema: print the scenario JSON Schema")
    p.add_argument("--scenarios", type=Path, default=Path(os.environ.get("REEF_SCENARIOS", "scenarios")),
                   help="scenario folder (env REEF_SCENARIOS; default ./scenarios)")
    p.add_argument("--state", type=Path, default=state_dir(os.environ),
                   help="state folder (env REEF_STATE; default $STATE_DIRECTORY or ~/.local/state/reefd)")
    p.add_argument("--listen", type=parse_listen, default=os.environ.get("REEF_LISTEN", "127.0.0.1:8900"),
                   help="HOST:PORT to listen on (env REEF_LISTEN; default 127.0.0.1:8900)")
    p.add_argument("--check", action="store_true", help="compose and validate every scenario, then exit")
    p.add_argument("--version", action="version", version=f"reefd {__version__}")
    return p


async def serve(settings: Settings, host: str, port: int, scenarios_dir: Path) -> int:
    app = build_app(settings)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=settings.shutdown_timeout_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        await runner.cleanup()
        return 1
    log.info("listening on http://%s:%d (scenarios: %s)", host, port, ", ".join(sorted(settings.scenarios)))
    try:
        scraper = await _metrics_site(app)
    except OSError as exc:
        log.error("cannot serve metrics on REEF_METRICS_LISTEN: %s", exc.strerror or exc)
        await runner.cleanup()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    def on_hup() -> None:
        task = asyncio.create_task(_reload(app, scenarios_dir))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    ready = asyncio.create_task(_announce_ready(app))
    interval = systemd.watchdog_interval()
    dog = asyncio.create_task(systemd.watchdog(interval)) if interval is not None else None
    await stop.wait()
    log.info("stopping: draining in-flight requests (up to %.0f s)", settings.shutdown_timeout_s)
    await systemd.notify_async("STOPPING=1")
    ready.cancel()
    if scraper is not None:
        await scraper.cleanup()
    await runner.cleanup()
    if dog is not None:
        dog.cancel()
    log.info("stopped")
    return 0


async def _metrics_site(app: web.Application) -> web.AppRunner | None:
    """REEF_METRICS_LISTEN=HOST:PORT: `/metrics` alone, without the token, for a scraper on loopback."""
    listen = os.environ.get("REEF_METRICS_LISTEN")
    if not listen:
        return None
    host, port = parse_listen(listen)
    runner = web.AppRunner(metrics_app(app), handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    log.info("metrics on http://%s:%d/metrics (no token)", host, port)
    return runner


async def _reload(app: web.Application, scenarios_dir: Path) -> None:
    """SIGHUP (`systemctl reload reefd`): re-read the tokens file, then the scenarios folder and apply the
    difference. Either one that cannot be used keeps what was in force before."""
    await systemd.notify_async("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}",
                               "STATUS=reloading scenarios")
    keyring = app[KEYRING]
    try:
        held = await asyncio.to_thread(keyring.reload)
        log.info("reloaded the tokens file %s (scoped tokens: %d)", keyring.file, held)
    except TokensFileError as exc:
        log.error("tokens file refused, still accepting the previous tokens: %s", exc)
    try:
        scenarios = await asyncio.to_thread(config.load_all, scenarios_dir)  # off the event loop
        await loop.reload(app, scenarios)
        log.info("reloaded scenarios: %s", ", ".join(sorted(scenarios)))
    except config.ConfigError as exc:
        log.error("reload refused, still serving the previous scenarios: %s", exc)
    except Exception:
        log.exception("reload failed, still serving the previous scenarios")
    finally:
        await systemd.notify_async("READY=1", _serving(app))


async def _announce_ready(app: web.Application) -> None:
    """READY=1 once every scenario is ready (`Registry.ready`); or, past the start-up deadline, with a STATUS=
    naming those that are not (so `systemctl start` never hangs on a broken model or release)."""
    registry = app[loop.REGISTRY]
    deadline = time.monotonic() + max((s.cfg.model.startup_timeout_s for s in registry.scenarios.values()), default=0)
    while not registry.ready and time.monotonic() < deadline:
        await systemd.notify_async("STATUS=starting engines", "EXTEND_TIMEOUT_USEC=30000000")
        await asyncio.sleep(1)
    down = registry.unready()
    if down:
        log.error("scenarios not ready after the start-up deadline (engine down, or not serving what their chain "
                  "declares; reefctl status says why): %s", ", ".join(down))
        await systemd.notify_async("READY=1", f"{_serving(app)}; not ready: {', '.join(down)}")
        return
    log.info("ready: every scenario's engine answers")
    await systemd.notify_async("READY=1", _serving(app))


def _serving(app: web.Application) -> str:
    """The STATUS= line while serving: `systemctl status reefd` shows it."""
    n = len(app[loop.REGISTRY].scenarios)
    return f"STATUS=serving {n} scenario{'' if n == 1 else 's'}"


class _MalformedRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a NUL in a header, a broken chunk) at ERROR with a traceback. The
    client sent it and got its 400: that is one WARNING line, with no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            why = (exc.message or type(exc).__name__).splitlines()[0].strip()
            record.msg, record.args = "%s: malformed HTTP request, answered 400: %s", (record.getMessage(), why)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("REEF_LOG_LEVEL", "INFO").upper(),
                        format="reefd: %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("aiohttp.server").addFilter(_MalformedRequests())
    if args.command == "schema":
        print(json.dumps(config.json_schema(), indent=2))
        return 0
    warned: dict[str, list[str]] = {}  # moved keys: --check prints them, serving logs them
    try:
        scenarios = config.load_all(args.scenarios, warned if args.check else None)
    except config.ConfigError as exc:
        for name, warnings in warned.items():
            for warning in warnings:
                print(f"{name}: warning: {warning}", file=sys.stderr)
        print(exc, file=sys.stderr)
        return 2
    if args.check:  # warnings alone still pass
        for name, cfg in sorted(scenarios.items()):
            print(f"{name}: ok (model {cfg.model.name}, engine {cfg.model.engine})")
            for warning in warned[name]:
                print(f"{name}: warning: {warning}")
        return 0
    host, port = args.listen
    if os.environ.get("REEF_METRICS_LISTEN"):
        try:
            parse_listen(os.environ["REEF_METRICS_LISTEN"])
        except argparse.ArgumentTypeError as exc:
            print(f"REEF_METRICS_LISTEN: {exc}", file=sys.stderr)
            return 2
    records = os.environ.get("REEF_RECORDS", "pieces")
    if records not in ("pieces", "whole"):
        print(f"REEF_RECORDS: {records!r} is not one of 'pieces' (the default), 'whole'", file=sys.stderr)
        return 2
    try:
        limits = Limits(sessions=_positive("REEF_TINKER_SESSIONS", Limits.sessions),
                        models=_positive("REEF_TINKER_MODELS", Limits.models))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    malloc.return_big_buffers()
    args.state.mkdir(mode=0o700, parents=True, exist_ok=True)  # records and the token live here
    tokens_file = path_for(args.state)
    try:
        read_tokens_file(tokens_file)
    except TokensFileError as exc:
        print(exc, file=sys.stderr)
        return 2
    settings = Settings(state_dir=args.state, tokens=load_tokens(args.state), tokens_file=tokens_file,
                        scenarios=scenarios, scenarios_dir=args.scenarios,
                        max_jobs=int(os.environ.get("REEF_MAX_JOBS", "1")), records_whole=records == "whole",
                        tinker=limits)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve(settings, host, port, args.scenarios))


def _positive(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name}: {raw!r} is not a whole number of at least 1")
    return int(raw)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (it is a dependency; REEF_LOOP=asyncio opts out)."""
    if os.environ.get("REEF_LOOP") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main())
