"""`python -m reefd.worker`: flags, model load, the batcher thread, the HTTP site, SIGTERM.

Owns the process lifecycle (ready = listening; SIGTERM = stop accepting, drain briefly,
abort the rest, exit 0). Knows nothing about wire formats or sampling.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from reefd.worker.params import FAULTS

log = logging.getLogger("reefd.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m reefd.worker", description="Reef's embedded engine worker (a subset "
                                "of SGLang's HTTP contract, with dynamic batching).")
    p.add_argument("--model", required=True, type=Path, help="an HF model folder (see reefd.worker.prepare)")
    p.add_argument("--port", required=True, type=int, help="TCP port (0 picks a free one, logged on stderr)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--max-batch", type=int, default=8, help="most requests generated together")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: all cores)")
    p.add_argument("--context-length", type=int, default=None,
                   help="longest prompt + completion (default: the model's own)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--served-model-name", default=None, help="model name in OpenAI answers (default: folder name)")
    p.add_argument("--drain-timeout", type=float, default=2.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--log-level", default="INFO", help="DEBUG logs every finished request")
    p.add_argument("--fault", choices=FAULTS, default=None,
                   help="tests only: adapter loads or weight updates that answer success and serve something else")
    p.add_argument("--fault-file", type=Path, default=None,
                   help="tests only: a file naming the --fault each adapter takes, read at its first load (none "
                        "while it is empty or missing), so that a test switches faults between loads")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="stream events carry only the new ids, text and logprobs (SGLang's flag of that name)")
    return p.parse_args(argv)


def _version() -> str:
    try:
        return metadata.version("reefd")
    except metadata.PackageNotFoundError:
        return "0+unknown"


async def serve(args: argparse.Namespace) -> int:
    import torch  # the worker's own process: torch stays out of reefd itself
    from aiohttp import web
    from transformers import AutoTokenizer

    from reefd.worker.batcher import Batcher
    from reefd.worker.model import Model
    from reefd.worker.server import build_app
    from reefd.worker.wire import WorkerState

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    start = time.monotonic()
    engine = await asyncio.to_thread(Model, args.model, args.device, args.context_length)
    engine.fault, engine.fault_file = args.fault, args.fault_file
    batcher = Batcher(engine, args.max_batch, threads=threads)
    batcher.start()
    state = WorkerState(batcher=batcher, tokenizer=AutoTokenizer.from_pretrained(args.model, local_files_only=True),
                        model_path=str(args.model), version=_version(), incremental=args.incremental_streaming_output,
                        served_model_name=args.served_model_name or args.model.resolve().name)
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else args.port
    log.info("listening on http://%s:%d (model %s, context %d, max batch %d, %d threads, ready in %.1f s)", args.host,
             port, args.model, engine.context_length, args.max_batch, threads, time.monotonic() - start)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    await drain(state, site, runner, args.drain_timeout)
    return 0


async def drain(state: Any, site: Any, runner: Any, timeout: float) -> None:
    """Stop listening, let in-flight requests finish for `timeout` s, abort the rest, close."""
    batcher = state.batcher
    log.info("stopping: no new requests; %d in flight get %.1f s", batcher.busy, timeout)
    state.draining = True
    await site.stop()
    deadline = time.monotonic() + timeout
    while batcher.busy and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.to_thread(batcher.stop)  # aborts whatever is left; their handlers answer 503
    await runner.cleanup()
    log.info("stopped")


def _quiet_http2_probe(record: logging.LogRecord) -> bool:
    """sglang-router probes each new worker for gRPC (an HTTP/2 preface) before it settles on HTTP: that probe
    is expected, not an error worth a traceback."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and "PRI/Upgrade" in str(exc))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: never reach for a model hub
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_quiet_http2_probe)
    if not (args.model / "config.json").is_file():
        log.error("no model folder at %s (make one: python -m reefd.worker.prepare tiny --out DIR)", args.model)
        return 2
    try:
        return asyncio.run(serve(args))
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    except ValueError as exc:  # a flag that does not fit the model (e.g. --context-length)
        log.error("cannot start: %s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
