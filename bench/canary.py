"""Canary decisions on the tiny model through a real reefd: how long they take, and how often they are wrong.

Scorer (the client's): an answer's similarity to the reference answer of its prompt (difflib ratio, 0..1), where
the references are what adapter `good` answers greedily, served by a scenario without a canary.

1. Decision time at `--rate` requests/s (default 10), each request a new session, every answer reported, with the
   issue's settings (share 0.1, min_reports 50, max_drop 0.05, confidence 0.95):
   - better: `good` on canary against the base model, greedy answers;
   - worse: another adapter on canary against `good` (promoted), greedy answers.
   Baseline, same run: the time the canary side needs to reach min_reports at that rate and share.
2. False rollbacks: `--runs` (default 20) scenarios at once, each with `good` promoted and the same adapter
   published again on canary (share 0.5), answers sampled at temperature 1: two identical releases. Counted: runs
   rolled back (should be at most 1 - confidence of them, 5%).

Run: python bench/canary.py [--rate 10] [--runs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from _harness import scratch_dir, start_reefd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.loras import make_lora

PROMPTS = [f"Question number {i}: what comes next?" for i in range(12)]
BASE = "defaults:\n  - model: tiny\n  - release: follow\n  - _self_\nserve:\n  default_max_tokens: 8\n"
CANARY = ("release:\n  canary: {{share: {share}, min_reports: 50, metric: score, max_drop: 0.05, confidence: 0.95, "
          "max_age_s: 3600}}\n")


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str, token: str) -> None:
        self.session, self.url, self.auth = session, url, {"Authorization": f"Bearer {token}"}

    async def ask(self, scenario: str, prompt: str, temperature: float) -> tuple[str, str]:
        body = {"model": scenario, "messages": [{"role": "user", "content": prompt}], "temperature": temperature}
        headers = {**self.auth, "x-reef-scenario": scenario, "x-reef-session": uuid.uuid4().hex}
        while True:  # a refusal at capacity is retried after its Retry-After, as the SDKs do
            async with self.session.post(self.url + "/v1/chat/completions", json=body, headers=headers) as r:
                data = await r.json()
                if r.status in (429, 503):
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                assert r.status == 200, data
                return data["choices"][0]["message"]["content"], r.headers["x-reef-agent-record-id"]

    async def report(self, scenario: str, receipt: str, score: float) -> None:
        async with self.session.post(self.url + "/reef/report", json={"score": score, "references": [receipt]},
                                     headers={**self.auth, "x-reef-scenario": scenario}) as r:
            assert r.status in (200, 201), await r.text()

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.session.request(method, self.url + path, json=body, headers=self.auth) as r:
            data = await r.json()
            assert r.status < 300, data
            return data

    async def head(self, scenario: str) -> dict[str, Any]:
        return dict((await self.call("GET", f"/reef/scenarios/{scenario}/releases"))["data"][0])

    async def publish(self, scenario: str, adapter: Path) -> str:
        import io
        import tarfile
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(adapter, arcname=".")
        url = self.url + f"/reef/scenarios/{scenario}/releases?kind=adapter"
        async with self.session.post(url, data=buf.getvalue(),
                                     headers={**self.auth, "Content-Type": "application/x-tar"}) as r:
            data = await r.json()
            assert r.status < 300, data
            return str(data["release"]["id"])

    async def promote_now(self, scenario: str, release: str) -> None:
        await self.call("POST", f"/reef/scenarios/{scenario}/promote", {"release": release})


def similarity(answer: str, reference: str) -> float:
    return difflib.SequenceMatcher(None, answer, reference).ratio()


async def until_decided(c: Client, scenario: str, on_trial: str, rate: float | None, concurrency: int,
                        temperature: float, refs: dict[str, str], timeout_s: float) -> tuple[dict[str, Any], float]:
    """Traffic until the head moves off `on_trial`: the decision release, and the seconds it took."""
    started = time.monotonic()
    decided: dict[str, Any] | None = None
    sent = 0

    async def one(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        answer, receipt = await c.ask(scenario, prompt, temperature)
        await c.report(scenario, receipt, similarity(answer, refs[prompt]))

    async def watch() -> None:
        nonlocal decided
        while decided is None and time.monotonic() - started < timeout_s:
            h = await c.head(scenario)
            if h["id"] != on_trial:
                decided = h
                return
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    running: set[asyncio.Task[None]] = set()
    while decided is None and time.monotonic() - started < timeout_s:
        if rate is not None:  # open loop at `rate` requests/s
            due = started + sent / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            task = asyncio.create_task(one(sent))
        else:  # closed loop: `concurrency` requests in flight
            while len(running) >= concurrency:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.create_task(one(sent))
        running.add(task)
        task.add_done_callback(running.discard)
        sent += 1
    await watcher
    await asyncio.gather(*running, return_exceptions=True)
    if decided is None:
        raise RuntimeError(f"{scenario}: no decision in {timeout_s} s")
    return decided, time.monotonic() - started


async def timed(c: Client, scenario: str, on_trial: str, rate: float, refs: dict[str, str]) -> dict[str, Any]:
    """The decision on `scenario`'s canary under `rate` requests/s, and how long it took."""
    floor_s = 50 / (rate * 0.1)  # the canary side's min_reports at this rate and share
    rel, took = await until_decided(c, scenario, on_trial, rate, 0, 0.0, refs, 1800)
    evidence = rel["meta"]["canary"]
    print(f"{scenario} adapter: {evidence['decision']} after {took:.1f} s ({took / floor_s:.2f}x the {floor_s:.0f} s "
          "the canary side needs for 50 reports)", flush=True)
    return {"decision": evidence["decision"], "seconds": round(took, 1),
            "vs_min_reports_time": round(took / floor_s, 2), "canary": evidence["canary"],
            "stable": evidence["stable"], "look": evidence["test"]["look"]}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    tmp = scratch_dir() / "canary"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    same = [f"same{i}" for i in range(args.runs)]
    extra = {"ref": BASE, "better": BASE + CANARY.format(share=0.1), "worse": BASE + CANARY.format(share=0.1),
             **{name: BASE + CANARY.format(share=0.5) for name in same}}
    d = start_reefd(tmp, extra)
    out: dict[str, Any] = {"bench": "canary", "rate": args.rate}
    try:
        model = d.state / "models" / "tiny"
        good = make_lora(model, tmp / "good", seed=11, scale=2.0)
        bad = make_lora(model, tmp / "bad", seed=12, scale=2.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            c = Client(session, d.url, d.token)
            await c.publish("ref", good)
            refs = {p: (await c.ask("ref", p, 0.0))[0] for p in PROMPTS}

            on_trial = await c.publish("better", good)
            out["better"] = await timed(c, "better", on_trial, args.rate, refs)

            first = await c.publish("worse", good)
            await c.promote_now("worse", first)
            on_trial = await c.publish("worse", bad)
            out["worse"] = await timed(c, "worse", on_trial, args.rate, refs)

            trials = {}
            for name in same:
                first = await c.publish(name, good)
                await c.promote_now(name, first)
                trials[name] = await c.publish(name, good)
            started = time.monotonic()
            results = await asyncio.gather(*(until_decided(c, name, trials[name], None, 2, 1.0, refs, 3600)
                                             for name in same))
            decisions = [r["meta"]["canary"] for r, _ in results]
            rollbacks = sum(e["decision"] == "rollback" for e in decisions)
            out["identical"] = {"runs": len(same), "rollbacks": rollbacks, "promotes": len(same) - rollbacks,
                                "seconds": round(time.monotonic() - started, 1),
                                "scores_per_side_median": sorted(min(e["canary"]["n"], e["stable"]["n"])
                                                                 for e in decisions)[len(decisions) // 2],
                                "looks": sorted(e["test"]["look"] for e in decisions),
                                "score_sd_median": sorted(e["canary"]["sd"] for e in decisions)[len(decisions) // 2],
                                "diffs": [e["diff"] for e in decisions],
                                "intervals": [e["interval"] for e in decisions]}
            print(f"identical adapters: {rollbacks}/{len(same)} rolled back (false rollbacks), "
                  f"{len(same) - rollbacks} promoted, in {out['identical']['seconds']} s", flush=True)
    finally:
        d.stop()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=20)
    print(json.dumps(asyncio.run(main(parser.parse_args()))), flush=True)
