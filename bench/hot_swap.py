"""Hot swap: publish → first answer from the new release under load, against restarting reefd with it.

A real reefd serves `tiny` (tiny model) or `hello` (SmolLM2). 8 clients (4 streaming) send greedy 4-token
chats without pause while the bench publishes 3 real LoRA adapters in turn and rolls back twice (7 swaps). Per
swap: the publish call's latency, and the time from sending it to the first completed answer whose
`x-reef-release-id` is the new release. Every answer counts: non-200, streams without `data: [DONE]` (or with
an error event) and client exceptions are failures.
Baseline, measured in the same run: the alternative to a hot swap is restarting with the new weights. The
bench stops reefd (SIGTERM) with the last release at the head and starts it again, timing from the stop to
the first answer from that release: a fresh engine process, model load and adapter restore. (Killing only
the engine worker was not chosen: the supervisor's crash backoff, 1 s and doubling, would add a fixed wait
that a planned restart does not have.) Goals: median publish → first answer ≤ 1 s (tiny), ≤ 2 s (smollm2);
0 failed requests. Run: python bench/hot_swap.py --model tiny|smollm2

With --weights: full-weights releases (two noisy copies of the model, then a rollback) under the same load, with
1 replica (new requests are held while the weights load) and then 2 behind sglang-router (a rolling swap). Per
swap: publish → first answer from the new weights, the engine's hold, and how much longer than the normal
latency the answers sent during the swap took. Goals: 0 failed; with 2 replicas no answer more than 100 ms
beyond the normal latency. Run: python bench/hot_swap.py --weights --model tiny|smollm2

--engines worker,vllm runs the same swaps on each engine in turn (vLLM's server from its own environment,
REEF_VLLM_PYTHON), for figures side by side.

Then (unless --no-proof) what the release proof adds to the same kind of swap, with it on against off in one
run (bench/proof_cost.py): goal at most 10% of the swap time, or 100 ms, whichever is larger.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import tarfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from _harness import ROOT, Daemon, link_smollm2, median, on_engine, scratch_dir

from tests.conftest import make_scenarios
from tests.loras import make_lora, untie

GOAL_S = {"tiny": 1.0, "smollm2": 2.0}
SCENARIO = {"tiny": "tiny", "smollm2": "hello"}
STEPS = ("a", "b", "rollback", "c", "a", "rollback", "b")  # 5 publishes alternating 3 adapters, 2 rollbacks
MESSAGES = [{"role": "user", "content": "Which release are you?"}]
TIMEOUT = aiohttp.ClientTimeout(total=120)


@dataclass
class Load:
    """Clients that chat without pause until stopped; the first completion time of each release they saw."""

    url: str
    headers: dict[str, str]
    body: dict[str, Any]
    first: dict[str, float] = field(default_factory=dict)
    answers: list[tuple[float, float]] = field(default_factory=list)  # (sent, latency) of every good answer
    completed: int = 0
    failed_status: int = 0
    broken_streams: int = 0
    exceptions: int = 0
    samples: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def fail(self, kind: str, detail: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.samples) < 5:
            self.samples.append(f"{kind}: {detail[:300]}")

    async def client(self, stream: bool) -> None:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            while not self.stop.is_set():
                sent = time.perf_counter()
                try:
                    async with session.post(self.url, json={**self.body, "stream": stream},
                                            headers=self.headers) as r:
                        raw = await r.read()
                        done = time.perf_counter()
                        release = r.headers.get("x-reef-release-id")
                        if r.status != 200 or not release:
                            self.fail("failed_status", f"{r.status} {release} {raw!r}")
                        elif stream and not stream_ok(raw):
                            self.fail("broken_streams", raw.decode(errors="replace")[-300:])
                        else:
                            self.completed += 1
                            self.answers.append((sent, done - sent))
                            self.first.setdefault(release, done)
                            continue
                except Exception as exc:  # every failure counts
                    self.fail("exceptions", repr(exc))
                await asyncio.sleep(0.05)  # a failing daemon is not hammered in a tight loop

    def counts(self) -> dict[str, int]:
        return {"completed": self.completed, "failed_status": self.failed_status,
                "broken_streams": self.broken_streams, "exceptions": self.exceptions}


def stream_ok(raw: bytes) -> bool:
    """An SSE body whose last event is `data: [DONE]` and none of whose events is an error."""
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return False
    try:
        return not any("error" in json.loads(e) for e in events[:-1])
    except ValueError:
        return False


def tar_bytes(folder: Path) -> bytes:
    """An uncompressed tar of the folder's contents (names relative to it), as reefctl publish sends."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)
    return buf.getvalue()


def daemon_for(model: str, tmp: Path, extra: dict[str, str] | None = None, engine: str = "worker") -> Daemon:
    """A reefd (not started yet) serving the model's scenario (or the `extra` ones) on `engine`, in a state
    folder of its own."""
    state = tmp / "state"
    if model == "smollm2":
        link_smollm2(state)
    if engine != "worker":
        extra = extra or {SCENARIO[model]: (ROOT / "scenarios" / f"{SCENARIO[model]}.yaml").read_text()}
        extra = {name: on_engine(text, engine) for name, text in extra.items()}
    names = () if extra else (SCENARIO[model],)
    return Daemon(scenarios=make_scenarios(tmp / "scenarios", names=names, extra=extra), state=state,
                  log_path=tmp / "reefd.log")


def adapters(daemon: Daemon, model: str, out: Path) -> dict[str, bytes]:
    """Three real LoRA adapters for the daemon's own model folder, tarred before anything is timed."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
    base = daemon.state / "models" / model
    extra: dict[str, Any] = {"r": 8, "lora_alpha": 16} if model == "smollm2" else {}
    return {name: tar_bytes(make_lora(base, out / name, seed=seed, scale=2.0, **extra))
            for name, seed in (("a", 1), ("b", 2), ("c", 3))}


async def swap(session: aiohttp.ClientSession, daemon: Daemon, scenario: str, step: str,
               tars: dict[str, bytes], load: Load) -> dict[str, Any]:
    """One publish or rollback: its call's latency and the time to the first answer from the new release."""
    path = f"/reef/scenarios/{scenario}/" + ("rollback" if step == "rollback" else "releases?kind=adapter")
    headers = {**daemon.headers(), "Content-Type": "application/json" if step == "rollback" else "application/x-tar"}
    data = b"{}" if step == "rollback" else tars[step]
    t0 = time.perf_counter()
    async with session.post(daemon.url + path, data=data, headers=headers) as r:
        answer = await r.json()
        called = time.perf_counter() - t0
        if r.status not in (200, 201):
            raise RuntimeError(f"{step}: {r.status} {answer}")
    release = answer["release"]["id"]
    if answer["serving"] != release:
        raise RuntimeError(f"{step}: published {release} but serving {answer['serving']}: {answer}")
    deadline = t0 + 60
    while release not in load.first:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{step}: no answer from {release} within 60 s")
        await asyncio.sleep(0.005)
    return {"step": step, "release": release, "publish_call_s": called, "first_answer_s": load.first[release] - t0}


async def hot_swaps(daemon: Daemon, scenario: str, tars: dict[str, bytes], clients: int,
                    gap_s: float) -> tuple[list[dict[str, Any]], Load]:
    body = {"model": scenario, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    load = Load(daemon.url + "/v1/chat/completions", {**daemon.headers(), "x-reef-scenario": scenario}, body)
    tasks = [asyncio.create_task(load.client(stream=i % 2 == 1)) for i in range(clients)]
    swaps: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            await asyncio.sleep(gap_s)  # the clients are up and answering from the base release
            for step in STEPS:
                swaps.append(await swap(session, daemon, scenario, step, tars, load))
                await asyncio.sleep(gap_s)  # requests on the old release drain; its adapter is unloaded
    finally:
        load.stop.set()
        await asyncio.gather(*tasks)
    return swaps, load


async def restart(daemon: Daemon, scenario: str, head: str) -> dict[str, float]:
    """Stop reefd and start it again; the time from the stop to the first answer from `head`."""
    body = {"model": scenario, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    headers = {**daemon.headers(), "x-reef-scenario": scenario}
    t0 = time.perf_counter()
    daemon.stop()
    stopped = time.perf_counter() - t0
    daemon.start(wait_ready=False)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        while time.perf_counter() - t0 < 300:
            assert daemon.proc is not None
            if daemon.proc.poll() is not None:
                raise RuntimeError(f"reefd exited with {daemon.proc.returncode}:\n{daemon.logs()}")
            try:
                async with session.post(daemon.url + "/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()
                    if r.status == 200 and r.headers.get("x-reef-release-id") == head:
                        return {"stop_s": stopped, "first_answer_s": time.perf_counter() - t0}
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.02)
    raise RuntimeError(f"no answer from {head} within 300 s of the restart:\n{daemon.logs()}")


def report(model: str, engine: str, scenario: str, swaps: list[dict[str, Any]], load: Load, clients: int,
           restarts: list[dict[str, float]]) -> None:
    first = [s["first_answer_s"] for s in swaps]
    called = [s["publish_call_s"] for s in swaps]
    restart_s = median([r["first_answer_s"] for r in restarts])
    goal, failed = GOAL_S[model], load.failed_status + load.broken_streams + load.exceptions
    ratio = restart_s / median(first)
    print(f"hot swap ({model} on {engine}, scenario {scenario}, {len(swaps)} swaps): publish -> first answer from "
          f"the new release median {median(first):.3f} s, max {max(first):.3f} s "
          f"({'meets' if median(first) <= goal else 'misses'} the {goal:g} s goal); "
          f"publish call median {median(called):.3f} s, max {max(called):.3f} s")
    for s in swaps:
        print(f"  {s['step']:>8} -> {s['release']}: publish call {s['publish_call_s']:.3f} s, "
              f"first answer {s['first_answer_s']:.3f} s")
    print(f"under load ({clients} clients, {clients // 2} streaming): {load.completed} answers, "
          f"{load.failed_status} non-200, {load.broken_streams} broken streams, {load.exceptions} exceptions "
          f"({'meets' if failed == 0 else 'misses'} the 0 failures goal)")
    for sample in load.samples:
        print(f"  failure: {sample}")
    print(f"restart reefd -> first answer (baseline): median {restart_s:.3f} s over {len(restarts)} "
          f"(stop {median([r['stop_s'] for r in restarts]):.3f} s); ratio restart / hot swap {ratio:.1f}x")
    print(json.dumps({
        "bench": "hot_swap", "model": model, "engine": engine, "scenario": scenario, "swaps": len(swaps),
        "clients": clients,
        "first_answer_s": {"median": round(median(first), 4), "max": round(max(first), 4),
                           "each": [round(x, 4) for x in first]},
        "publish_call_s": {"median": round(median(called), 4), "max": round(max(called), 4)},
        "load": load.counts(), "failed": failed,
        "restart_first_answer_s": {"median": round(restart_s, 4),
                                   "each": [round(r["first_answer_s"], 4) for r in restarts]},
        "ratio": round(ratio, 2), "goal": {"first_answer_s": goal, "failed": 0},
    }))


# ---------------------------------------------------------------- full-weights releases

def weights_scenario(model: str, replicas: int, path: Path | None = None) -> str:
    folder = f"  path: {path}\n" if path is not None else ""
    return (f"defaults:\n  - model: {model}\n  - _self_\nmodel:\n  replicas: {replicas}\n{folder}"
            "serve:\n  temperature: 0.0\n")


async def weight_swaps(daemon: Daemon, tars: dict[str, bytes], clients: int, gap_s: float
                       ) -> tuple[list[dict[str, Any]], Load]:
    """Publish two weights releases and roll back once under load. Per swap: the publish call, the time to the
    first answer from the new release, and how much longer than normal the answers took that were in flight
    while the engine swapped (its own window, from the engine's report) and while the whole publish ran (upload,
    checks, LFS store and the swap, all on the same cores as the engines here). Normal: the median latency of
    the answers that overlap no publish."""
    body = {"model": "w", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    load = Load(daemon.url + "/v1/chat/completions", {**daemon.headers(), "x-reef-scenario": "w"}, body)
    tasks = [asyncio.create_task(load.client(stream=i % 2 == 1)) for i in range(clients)]
    offset = time.time() - time.perf_counter()  # wall clock (the engine's report) to perf_counter
    raw: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            await asyncio.sleep(gap_s)
            for step in ("a", "b", "rollback"):
                t0 = time.perf_counter()
                path = "/reef/scenarios/w/" + ("rollback" if step == "rollback" else "releases?kind=weights")
                headers = {**daemon.headers(),
                           "Content-Type": "application/json" if step == "rollback" else "application/x-tar"}
                async with session.post(daemon.url + path, data=b"{}" if step == "rollback" else tars[step],
                                        headers=headers) as r:
                    answer = await r.json()
                    called = time.perf_counter() - t0
                    if r.status not in (200, 201):
                        raise RuntimeError(f"{step}: {r.status} {answer}")
                release = answer["release"]["id"]
                deadline = t0 + 120
                while release not in load.first:
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"{step}: no answer from {release} within 120 s")
                    await asyncio.sleep(0.005)
                async with session.get(daemon.url + "/reef/status", headers=daemon.headers()) as r:
                    swap = (await r.json())["scenarios"][0]["engine"]["last_swap"]
                end = swap["at"] - offset
                raw.append({"step": step, "release": release, "t0": t0, "called": called, "swap": swap,
                            "window": (end - swap["total_s"], end)})
                await asyncio.sleep(gap_s)
    finally:
        load.stop.set()
        await asyncio.gather(*tasks)

    def overlapping(lo: float, hi: float) -> list[float]:
        return [lat for sent, lat in load.answers if sent <= hi and sent + lat >= lo]

    publishes = [(s["t0"], s["t0"] + s["called"]) for s in raw]
    normal = median([lat for sent, lat in load.answers
                     if not any(sent <= hi and sent + lat >= lo for lo, hi in publishes)] or [0.0])
    swaps = []
    for s in raw:
        in_swap, in_publish = overlapping(*s["window"]), overlapping(s["t0"], s["t0"] + s["called"])
        swaps.append({"step": s["step"], "release": s["release"], "publish_call_s": s["called"],
                      "first_answer_s": load.first[s["release"]] - s["t0"], "normal_latency_s": normal,
                      "answers_in_swap": len(in_swap),
                      "max_excess_in_swap_s": max((lat - normal for lat in in_swap), default=0.0),
                      "max_excess_in_publish_s": max((lat - normal for lat in in_publish), default=0.0),
                      "engine_held_s": s["swap"]["held_s"], "swap": s["swap"]})
    return swaps, load


def prepared(model: str, tmp: Path) -> Path:
    """The model's folder: SmolLM2 where `make run` keeps it, the tiny model made in `tmp`."""
    from reefd.worker.prepare import prepare

    home = Path(os.environ.get("REEF_STATE") or Path.home() / ".local" / "state" / "reefd")
    return prepare(model, home / "models" / model if model == "smollm2" else tmp / "source")


def weights_bench(model: str, clients: int, gap_s: float, engine: str = "worker", untied: bool = False,
                  replica_counts: tuple[int, ...] = (1, 2)) -> None:
    """The weights swap with 1 replica (new requests held while the weights load) and with 2 (a rolling swap),
    in one run; the 1-replica run is the baseline of the ratio."""
    from tests.loras import make_weights

    warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
    runs: dict[int, tuple[list[dict[str, Any]], Load]] = {}
    for replicas in replica_counts:
        tmp = scratch_dir()
        folder = untie(prepared(model, tmp), tmp / "untied") if untied else None
        daemon = daemon_for(model, tmp, {"w": weights_scenario(model, replicas, folder)}, engine)
        try:
            daemon.start()
            if replicas == 2:
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    status = json.loads(daemon.get("/reef/status")[1])["scenarios"][0]["engine"]
                    if all(r["in_router"] for r in status.get("replicas") or []):
                        break
                    time.sleep(0.2)
            base = folder or daemon.state / "models" / model
            tars = {name: tar_bytes(make_weights(base, tmp / "weights" / name, seed=seed, scale=0.05))
                    for name, seed in (("a", 1), ("b", 2))}
            runs[replicas] = asyncio.run(weight_swaps(daemon, tars, clients, gap_s))
        finally:
            if daemon.proc is not None and daemon.proc.poll() is None:
                daemon.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    out: dict[str, Any] = {"bench": "hot_swap_weights", "model": model, "engine": engine, "untied": untied,
                           "clients": clients}
    for replicas, (swaps, load) in runs.items():
        failed = load.failed_status + load.broken_streams + load.exceptions
        first = [s["first_answer_s"] for s in swaps]
        in_swap = max(s["max_excess_in_swap_s"] for s in swaps)
        in_publish = max(s["max_excess_in_publish_s"] for s in swaps)
        held = max(s["engine_held_s"] for s in swaps)
        print(f"weights swap ({model} on {engine}, {replicas} replica{'s' if replicas > 1 else ''}, {clients} "
              f"clients): publish -> first answer median {median(first):.3f} s, max {max(first):.3f} s; requests "
              f"held by reefd at most {held:.3f} s; answers in flight during the engine swap took at most "
              f"{in_swap * 1000:.0f} ms beyond the normal {swaps[0]['normal_latency_s'] * 1000:.0f} ms "
              f"({in_publish * 1000:.0f} ms during the whole publish); {load.completed} answers, {failed} failed")
        for s in swaps:
            print(f"  {s['step']:>8} -> {s['release']}: publish call {s['publish_call_s']:.3f} s, first answer "
                  f"{s['first_answer_s']:.3f} s, {s['answers_in_swap']} answers in the swap, max excess "
                  f"{s['max_excess_in_swap_s'] * 1000:.0f} ms, swap {s['swap']}")
        for sample in load.samples:
            print(f"  failure: {sample}")
        out[f"replicas_{replicas}"] = {
            "first_answer_s": {"median": round(median(first), 4), "max": round(max(first), 4)},
            "held_s_max": held, "max_excess_in_swap_s": round(in_swap, 4),
            "max_excess_in_publish_s": round(in_publish, 4), "normal_latency_s": round(swaps[0]["normal_latency_s"], 4),
            "answers": load.completed, "failed": failed, "swaps": [
                {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items() if k != "swap"}
                for s in swaps]}
    out["goal"] = {"failed": 0, "replicas_2_max_excess_s": 0.1}
    if "replicas_1" in out and "replicas_2" in out:
        one, two = out["replicas_1"]["max_excess_in_swap_s"], out["replicas_2"]["max_excess_in_swap_s"]
        out["ratio_excess_1_over_2"] = round(one / two, 2) if two > 0 else None
        print(f"max excess latency in the engine swap: 1 replica {one * 1000:.0f} ms vs 2 replicas {two * 1000:.0f} "
              f"ms (ratio {out['ratio_excess_1_over_2']}; {'meets' if two <= 0.1 else 'misses'} the 100 ms goal "
              "with 2)")
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", action="store_true",
                    help="full-weights releases instead of adapters: 1 replica, then 2 (a rolling swap)")
    ap.add_argument("--model", choices=sorted(GOAL_S), default="tiny")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients; every second one streams")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds of load before and after each swap")
    ap.add_argument("--restarts", type=int, default=3, help="baseline restarts; the median is reported")
    ap.add_argument("--no-proof", action="store_true", help="skip what the release proof adds (bench/proof_cost.py)")
    ap.add_argument("--replicas", default="1,2", help="--weights: the replica counts to run, in turn")
    ap.add_argument("--untied", action="store_true", help="--weights on a copy of the model with an output layer "
                    "of its own (vLLM 0.32 does not reload tied embeddings in place), on every engine alike")
    ap.add_argument("--engines", default="worker", help="engines to run the swaps on, one after the other "
                                                        "(worker,vllm: side by side in one run)")
    args = ap.parse_args()
    for engine in args.engines.split(","):
        if args.weights:
            weights_bench(args.model, args.clients, args.gap, engine, args.untied,
                          tuple(int(n) for n in args.replicas.split(",")))
        else:
            adapter_bench(args, engine)
    if not args.no_proof:  # what the proof adds to the same kind of swap, with it on against off
        import proof_cost  # imports this module: loaded only now

        proof_cost.run(args.model, args.weights)


def adapter_bench(args: argparse.Namespace, engine: str) -> None:
    scenario, tmp = SCENARIO[args.model], scratch_dir()
    daemon = daemon_for(args.model, tmp, engine=engine)
    try:
        daemon.start()
        tars = adapters(daemon, args.model, tmp / "adapters")
        swaps, load = asyncio.run(hot_swaps(daemon, scenario, tars, args.clients, args.gap))
        restarts = [asyncio.run(restart(daemon, scenario, swaps[-1]["release"])) for _ in range(args.restarts)]
        report(args.model, engine, scenario, swaps, load, args.clients, restarts)
    except Exception:  # what reefd did (not the engine's own lines), before its folder goes
        own = [line for line in daemon.log_path.read_text(errors="replace").splitlines() if not line.startswith("(")]
        print("reefd's log, its end:\n" + "\n".join(own[-80:]))
        raise
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
