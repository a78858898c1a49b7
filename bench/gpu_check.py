"""GPU check driver: drive one engine (reefd.worker, a real SGLang or a real vLLM) on this host and record what it
does.

Run by bench/gpu_check.sh, which decides which parts run, bounds each with `timeout` and calls `report` at
the end. `run` starts the engine on 127.0.0.1 (its own process group, killed on exit), then measures
generated tokens/s at batch 1 and batch 8, times a LoRA load/unload and a weight update from disk, and
checks that each one really changes (and restores) what the model says. Figures are saved after every
step, so a part cut short by its timeout still reports what it measured. Installs and downloads nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.loras: the same LoRA helper the test suite uses

from engine_batching import PROMPTS  # noqa: E402  (the same prompts as the CPU batching bench)
from probes import greedy  # noqa: E402

PROBE = "The three most important things about coral reefs are"  # the greedy prompt each change is judged on
PROBE_TOKENS = 24
LORA_NAME = "gpu-check"
ENGINES = ("worker", "sglang", "vllm")
VERSION = "gpu-check"
NOISE = 0.05  # perturbed weights: w + N(0, 1) * NOISE * std(w), enough to move a greedy answer


def say(line: str) -> None:
    print(line, flush=True)


# ---- the engine process --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when this driver dies, even by SIGKILL (Linux prctl)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def vllm_launch(model: Path, port: int, device: str, batch: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's server as reefd launches it for `engine: vllm` (REEF_VLLM_PYTHON: a Python with vLLM; on a GPU
    host `pip install vllm` in an environment of its own), in the GPU's own dtype; extra flags from
    REEF_GPU_CHECK_VLLM_ARGS."""
    from reefd.engines.kind_configs import VLLMConfig
    from reefd.engines.vllm import launch_argv, launch_env

    cfg = VLLMConfig(max_batch=batch, dtype="float32" if device == "cpu" else "auto", enforce_eager=device == "cpu",
                     kv_cache_gib=2, max_lora_rank=64,
                     launch_args=shlex.split(os.environ.get("REEF_GPU_CHECK_VLLM_ARGS", "")))
    if cfg.launcher() is None:
        raise RuntimeError("REEF_VLLM_PYTHON is not set")
    return launch_argv(cfg, model, port, "base", 4096), launch_env(cfg)


def engine_argv(engine: str, model: Path, port: int, device: str, batch: int) -> list[str]:
    if engine == "worker":
        return [sys.executable, "-m", "reefd.worker", "--model", str(model), "--host", "127.0.0.1",
                "--port", str(port), "--max-batch", str(batch), "--device", device]
    # Dynamic LoRA loading with no adapter at start needs the largest rank and the target modules up front.
    extra = shlex.split(os.environ.get("REEF_GPU_CHECK_SGLANG_ARGS", ""))
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--enable-lora", "--max-lora-rank", "64", "--lora-target-modules", "all",
            "--max-loras-per-batch", "2", "--mem-fraction-static", "0.5", "--cuda-graph-max-bs", str(batch),
            "--log-level", "warning", *extra]


def start_engine(argv: list[str], log: Path, pgid_file: Path, env: dict[str, str] | None = None
                 ) -> subprocess.Popen[bytes]:
    """The engine in a new session (its own process group, so its children die with it); the group id is
    written where gpu_check.sh's exit trap finds it if this driver is killed outright."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                start_new_session=True, preexec_fn=die_with_parent, env={**os.environ, **(env or {})})
    pgid_file.write_text(f"{proc.pid}\n")
    return proc


def stop_engine(proc: subprocess.Popen[bytes], pgid_file: Path) -> None:
    """SIGTERM to the whole group, 8 s to drain, then SIGKILL to whatever is left of it (SGLang's scheduler
    and detokenizer processes can outlive their launcher). Short enough to end within `timeout -k 15`."""
    for sig, wait_s in ((signal.SIGTERM, 8.0), (signal.SIGKILL, 3.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
    pgid_file.unlink(missing_ok=True)


# ---- what the checks load: a LoRA adapter and a perturbed copy of the model ------------------------------
def lora_for(model: Path, artifacts: Path) -> Path:
    """A non-zero PEFT LoRA (r=4 on q/v, seeded) for `model`; made once and shared by both parts."""
    from transformers.utils import logging as hf_logging

    from tests.loras import make_lora

    out = artifacts / "lora"
    if not (out / "adapter_config.json").is_file():
        tmp = artifacts / "lora.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        hf_logging.disable_progress_bar()
        with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
            warnings.simplefilter("ignore", FutureWarning)
            make_lora(model, tmp, seed=7, scale=1.0)
        tmp.rename(out)
    return out


def perturbed_copy(model: Path, artifacts: Path) -> Path:
    """The model folder with every float tensor nudged by seeded noise (NOISE x its std), via safetensors."""
    import torch
    from safetensors.torch import load_file, save_file

    out = artifacts / "perturbed"
    if (out / "config.json").is_file():
        return out
    tmp = artifacts / "perturbed.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(11)
    for src in sorted(model.iterdir()):
        if src.suffix != ".safetensors":
            if src.is_file():
                shutil.copy2(src, tmp / src.name)
            continue
        tensors = load_file(src)
        for name, t in tensors.items():
            if t.is_floating_point() and t.numel() > 1:
                noise = torch.randn(t.shape, generator=gen) * (NOISE * t.float().std())
                tensors[name] = (t.float() + noise).to(t.dtype)
        save_file(tensors, tmp / src.name, metadata={"format": "pt"})
    tmp.rename(out)
    return out


# ---- HTTP ------------------------------------------------------------------------------------------------
class Engine:
    """One engine process, through reefd's own client for its kind: SGLang's routes (the worker, SGLang) or
    vLLM's. Prompts go as token ids, as reefd sends them."""

    def __init__(self, session: Any, port: int, kind: str, model: Path) -> None:
        from tokenizers import Tokenizer

        from reefd.engines.sglang_client import SGLangClient
        from reefd.engines.vllm import eos_ids
        from reefd.engines.vllm_client import VLLMClient

        self.session, self.kind = session, kind
        self.base = f"http://127.0.0.1:{port}"
        self.tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.client = VLLMClient(session, self.base, "base", eos_ids(model)) if kind == "vllm" else \
            SGLangClient(session, self.base)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    async def get(self, route: str) -> tuple[int, Any]:
        async with self.session.get(self.base + route) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text

    async def generate(self, text: str, tokens: int, lora: str | None = None) -> int:
        """Generated tokens of one sampled answer to `text` (ignore_eos: all `tokens` of them)."""
        payload: dict[str, Any] = {"input_ids": self.ids(text), "return_logprob": True, "sampling_params": {
            "max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}}
        if lora is not None:
            payload["lora_path"] = lora
        async for answer in self.client.generate(payload, 300.0):
            return int(answer["meta_info"]["completion_tokens"])
        raise RuntimeError("the engine ended without an answer")

    async def probe(self, lora: str | None = None) -> list[int]:
        """The greedy answer every change is judged on (token ids)."""
        return (await greedy(self.client, self.ids(PROBE), PROBE_TOKENS, lora))[0]

    async def weight_version(self) -> tuple[str | None, str | None]:
        """The served weight version and the route that told it. SGLang's releases moved it between
        /get_weight_version and /model_info (its /get_server_info may hold the stale --weight-version
        flag, so it comes last); reefd.worker reports it in /get_server_info; vLLM in /weight_info."""
        routes = ("/weight_info",) if self.kind == "vllm" else \
            ("/get_weight_version", "/model_info", "/get_model_info", "/get_server_info")
        for route in routes:
            try:
                status, body = await self.get(route)
            except Exception:
                continue
            if status == 200 and isinstance(body, dict) and "weight_version" in body:
                return body["weight_version"], route
        return None, None


async def wait_ready(engine: Engine, proc: subprocess.Popen[bytes], log: Path) -> float:
    """Seconds until the engine generates a token (SGLang's /health_generate; a 1-token completion on vLLM)."""
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the engine exited with {proc.returncode} before it was ready:\n{tail}")
        with contextlib.suppress(Exception):
            if await engine.client.healthy(timeout_s=10):
                return time.monotonic() - start
        await asyncio.sleep(0.5)


# ---- the checks ------------------------------------------------------------------------------------------
class Part:
    """One engine's figures, saved as JSON after every step (gpu_check.sh reads them even after a timeout)."""

    def __init__(self, path: Path, **figures: Any) -> None:
        self.path = path
        self.figures: dict[str, Any] = {**figures, "failures": []}
        self.save()

    def set(self, **figures: Any) -> None:
        self.figures.update(figures)
        self.save()

    def fail(self, what: str) -> None:
        say(f"  FAILED: {what}")
        self.figures["failures"].append(what)
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.figures))


async def throughput(engine: Engine, part: Part, tokens: int, batch: int, rounds: int) -> None:
    """Generated tokens/s of one request alone, and of `batch` concurrent ones (median of `rounds`)."""

    async def run(n: int) -> float:
        start = time.perf_counter()
        generated = sum(await asyncio.gather(*(engine.generate(PROMPTS[i % len(PROMPTS)], tokens)
                                               for i in range(n))))
        return generated / (time.perf_counter() - start)

    await run(1)
    await run(batch)  # warm-up: first-call allocations, kernels, CUDA graphs
    one = statistics.median([await run(1) for _ in range(rounds)])
    many = statistics.median([await run(batch) for _ in range(rounds)])
    part.set(tok_s_batch1=round(one, 1), tok_s_batch8=round(many, 1), batch_ratio=round(many / one, 2))
    say(f"  throughput ({tokens} new tokens): batch 1 {one:.1f} tok/s, batch {batch} {many:.1f} tok/s, "
        f"ratio {many / one:.2f}x")


async def release_proof(engine: Engine, lora: str) -> float:
    """What reefd's release proof costs this process after an adapter load: its built-in probe prompts, each with
    8 tokens after it (the process's own greedy ones, standing for a reference's), teacher-forced, the base
    weights' beside the adapter's, sent at once as reefd sends them (median of 3)."""
    from reefd.engines.proof import PROBE_TEXTS

    prompts = [engine.ids(text) for text in PROBE_TEXTS]
    tokens = [(await greedy(engine.client, prompt, 8, lora))[0] for prompt in prompts]

    async def once() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(engine.client.teacher_forced(p, t, a) for a in (None, lora)
                               for p, t in zip(prompts, tokens, strict=True)))
        return time.perf_counter() - start

    return sorted([await once() for _ in range(3)])[1]


async def lora_swap(engine: Engine, part: Part, lora: Path, base: str) -> None:
    """Load a LoRA while serving, check it changes the greedy answer, unload it, check the base is back."""
    start = time.perf_counter()
    await engine.client.load_lora_adapter(LORA_NAME, lora)
    load_s = time.perf_counter() - start
    adapted = await engine.probe(LORA_NAME)
    proof_s = await release_proof(engine, LORA_NAME)
    start = time.perf_counter()
    await engine.client.unload_lora_adapter(LORA_NAME)
    unload_s = time.perf_counter() - start
    after = await engine.probe()
    part.set(lora_load_s=round(load_s, 3), lora_unload_s=round(unload_s, 3), lora_changes_output=adapted != base,
             lora_unload_restores_output=after == base, proof_s=round(proof_s, 4))
    say(f"  release proof after the load (reefd's probe set, teacher-forced, at once): {proof_s * 1000:.0f} ms")
    say(f"  LoRA hot swap: load {load_s * 1000:.0f} ms, unload {unload_s * 1000:.0f} ms, "
        f"output with adapter {'differs' if adapted != base else 'SAME'} from base")
    if adapted == base:
        part.fail("a generate with lora_path gave the base model's answer")
    if after != base:
        part.fail("after unloading the adapter the answer is not the base model's")


async def weight_update(engine: Engine, part: Part, model: Path, perturbed: Path, base: str) -> None:
    """update_weights_from_disk to the perturbed copy (version "gpu-check"), then back to the original."""
    start = time.perf_counter()
    await engine.client.update_weights_from_disk(perturbed, VERSION)
    update_s = time.perf_counter() - start
    version, route = await engine.weight_version()
    changed = await engine.probe()
    start = time.perf_counter()
    await engine.client.update_weights_from_disk(model, "original")
    restore_s = time.perf_counter() - start
    restored = await engine.probe()
    part.set(update_s=round(update_s, 3), weight_version=version, weight_version_route=route,
             update_changes_output=changed != base,
             restore_s=round(restore_s, 3), restore_gives_base_output=restored == base)
    say(f"  weight update from disk: {update_s:.2f} s (weight_version {version!r} in {route}), output "
        f"{'changed' if changed != base else 'UNCHANGED'}; back to the original in {restore_s:.2f} s, output "
        f"{'is the base one again' if restored == base else 'DIFFERS from the base one'}")
    if version != VERSION:
        part.fail(f"weight_version is {version!r} after the update, not {VERSION!r}")
    if changed == base:
        part.fail("the greedy answer did not change after loading perturbed weights")
    if restored != base:
        part.fail("the greedy answer differs from the base one after updating back to the original weights")


async def checks(engine: Engine, proc: subprocess.Popen[bytes], part: Part, args: argparse.Namespace,
                 log: Path) -> None:
    ready_s = await wait_ready(engine, proc, log)
    status, info = await engine.get("/get_server_info")
    device = info.get("device") if status == 200 and isinstance(info, dict) else None
    part.set(ready_s=round(ready_s, 1), device=device)
    say(f"  ready in {ready_s:.1f} s" + (f" on {device}" if device else ""))
    if args.engine == "worker" and not str(device).startswith(args.device):
        part.fail(f"the worker serves on {device!r}, not {args.device!r}")
    base = await engine.probe()  # the greedy answer every change is compared with
    steps = [
        ("throughput", lambda: throughput(engine, part, args.tokens, args.batch, args.rounds)),
        ("lora", lambda: lora_swap(engine, part, lora_for(args.model, args.artifacts), base)),
        ("weights", lambda: weight_update(engine, part, args.model, perturbed_copy(args.model, args.artifacts), base)),
    ]
    for name, step in steps:
        try:
            await step()
        except Exception as exc:  # one broken step is reported; the others still run
            part.fail(f"{name}: {type(exc).__name__}: {exc}")


def cmd_run(args: argparse.Namespace) -> int:
    import aiohttp

    for sig in (signal.SIGTERM, signal.SIGHUP):  # `timeout` sends SIGTERM: run the finally below
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    parent = os.getppid()
    die_with_parent()  # this driver too: its `timeout` gone (killed by hand) means stop, engine included
    if os.getppid() != parent:
        return 143
    args.artifacts.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = args.log or args.artifacts / f"{args.engine}.log"
    part = Part(args.json, engine=args.engine, model=str(args.model), tokens=args.tokens, batch=args.batch)
    say(f"{args.engine}: starting on {args.device}, port {port} (log {log})")
    pgid_file = args.artifacts / f"{args.engine}.pgid"
    argv, env = vllm_launch(args.model, port, args.device, args.batch) if args.engine == "vllm" else \
        (engine_argv(args.engine, args.model, port, args.device, args.batch), {})
    proc = start_engine(argv, log, pgid_file, env)

    async def main() -> None:
        timeout = aiohttp.ClientTimeout(total=300, sock_connect=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await checks(Engine(session, port, args.engine, args.model), proc, part, args, log)

    try:
        asyncio.run(main())
    except Exception as exc:
        part.fail(f"{type(exc).__name__}: {exc}")
    finally:
        stop_engine(proc, pgid_file)
    return 1 if part.figures["failures"] else 0


# ---- the report ------------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    """Merge the parts' figures and the skips into one JSON line (also written to --out)."""
    result: dict[str, Any] = {"bench": "gpu_check", "mode": args.mode, "gpu": args.gpu or None,
                              "model": str(args.model)}
    ok = True
    for name in ENGINES:
        figures_file, rc_file = args.work / f"{name}.json", args.work / f"{name}.rc"
        if not rc_file.is_file():
            continue
        figures = json.loads(figures_file.read_text()) if figures_file.is_file() else {"failures": []}
        rc = int(rc_file.read_text().strip() or 1)
        if rc == 124:
            figures["failures"].append("timed out (the part's time limit in gpu_check.sh)")
        elif rc == 137:
            figures["failures"].append("killed (SIGKILL: past its time limit and its grace, or by hand)")
        elif rc != 0 and not figures["failures"]:
            figures["failures"].append(f"the driver exited with {rc}")
        figures["ok"] = not figures["failures"]
        ok = ok and figures["ok"]
        result[name] = figures
    worker = result.get("worker", {})
    for name in ENGINES[1:]:
        other = result.get(name, {})
        if worker.get("tok_s_batch8") and other.get("tok_s_batch8"):
            result[f"{name}_vs_worker_batch8"] = round(other["tok_s_batch8"] / worker["tok_s_batch8"], 2)
    skipped_file = args.work / "skipped"
    result["skipped"] = skipped_file.read_text().splitlines() if skipped_file.is_file() else []
    result["ok"] = ok
    say("summary:")
    for name in ENGINES:
        if name in result:
            state = "ok" if result[name]["ok"] else "FAILED: " + "; ".join(result[name]["failures"])
            say(f"{name}: {state}")
    for reason in result["skipped"]:
        say(f"skipped: {reason}")
    line = json.dumps(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(line + "\n")
    say(line)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="start one engine and check it")
    run.add_argument("--engine", choices=ENGINES, required=True)
    run.add_argument("--model", type=Path, required=True)
    run.add_argument("--device", default="cuda", help="cuda or cpu (the worker's --device; SGLang uses cuda)")
    run.add_argument("--tokens", type=int, default=128, help="new tokens per throughput request (ignore_eos)")
    run.add_argument("--batch", type=int, default=8, help="concurrent requests of the batched measurement")
    run.add_argument("--rounds", type=int, default=3, help="throughput rounds; medians are reported")
    run.add_argument("--artifacts", type=Path, required=True, help="scratch folder: LoRA, perturbed model")
    run.add_argument("--json", type=Path, required=True, help="where this part's figures are saved")
    run.add_argument("--log", type=Path, default=None, help="the engine's log (default: in --artifacts)")
    report = sub.add_parser("report", help="merge the parts into one JSON line")
    report.add_argument("--work", type=Path, required=True)
    report.add_argument("--mode", required=True)
    report.add_argument("--gpu", default="")
    report.add_argument("--model", type=Path, required=True)
    report.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gpu_check.json")
    args = p.parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
