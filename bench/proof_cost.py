"""What the release proof adds to a swap: publish → serving with `release.proof` on, against the same publishes with
it off, in the same run; and the proof as reefd asks it (one teacher-forced pass per probe prompt) beside the
proof it replaced (each probe prompt decoded greedily, one token at a time), on the same process.

A real reefd serves two scenarios on two engines of the same model, one proving its releases and one not. The
bench publishes real LoRA adapters to each in turn (and, with --weights, full-weights copies of the model). Per
swap it reports the publish call's time on both sides and the proof itself (the engine's `last_proof`: every
probe prompt answered by the process and compared). Then it asks the process that just proved the release what
each proof asks, as reefd asks it (the base weights' probes beside an adapter's, at once), `--repeats` times
each, in turn: teacher-forced (SGLangClient.teacher_forced) and decoded (bench/probes.py greedy, the old proof).
Publishing with the proof on also pays the reference fingerprint of the new candidate (reported apart: it is made
once, when a candidate is written, not on a swap).
Goal: the proof adds at most 10% of the swap time, or 100 ms, whichever is larger.
Run: python bench/proof_cost.py --model tiny|smollm2 [--weights]; bench/hot_swap.py runs it after its own swaps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from typing import Any

import aiohttp
from _harness import scratch_dir
from hot_swap import adapters, daemon_for, tar_bytes
from probes import greedy

from reefd.engines.proof import Fingerprint
from reefd.engines.sglang_client import SGLangClient
from tests.loras import make_weights


def scenario(model: str, on: bool, max_tokens: int | None) -> str:
    tokens = f"    max_tokens: {max_tokens}\n" if max_tokens else ""
    return (f"defaults:\n  - model: {model}\n  - release: follow\n  - _self_\n"
            f"model:\n  name: {model}-{'on' if on else 'off'}\nrelease:\n  proof:\n    enabled: {str(on).lower()}\n"
            + tokens)


def publish(daemon: Any, name: str, kind: str, tar: bytes) -> tuple[float, dict[str, Any]]:
    req = urllib.request.Request(f"{daemon.url}/reef/scenarios/{name}/releases?kind={kind}", data=tar,
                                 headers={**daemon.headers(), "Content-Type": "application/x-tar"}, method="POST")
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        answer = json.loads(r.read())
    elapsed = time.perf_counter() - started
    if answer["serving"] != answer["release"]["id"]:
        raise RuntimeError(f"{name}: published {answer['release']['id']} but serving {answer['serving']}")
    return elapsed, dict(answer["release"])


async def both_proofs(url: str, fp: Fingerprint, adapter: str | None, repeats: int) -> dict[str, Any]:
    """Seconds (median of `repeats`) of each proof's requests to the process at `url`, sent at once as reefd
    sends them (an adapter's probes beside the base weights'; the release's probe set for both rows), in turn;
    and whether the teacher-forced answers pass the fingerprint and the decoded ones repeat its tokens, and how many
    prefills the worker ran for one teacher-forced proof (its /server_info stats)."""
    rows = [None, adapter] if adapter is not None else [None]
    probes = [(a, p, t) for a in rows for p, t in zip(fp.prompts, fp.tokens, strict=True)]
    times: dict[str, list[float]] = {"teacher_forced": [], "decoded": []}
    passes: list[int] = []
    async with aiohttp.ClientSession() as session:
        client = SGLangClient(session, url)

        async def prefills() -> int:
            async with session.get(f"{url}/server_info") as r:
                return int((await r.json())["stats"]["prefills"])

        for _ in range(repeats):
            before = await prefills()
            started = time.perf_counter()
            forced = await asyncio.gather(*(client.teacher_forced(p, t, a) for a, p, t in probes))
            times["teacher_forced"].append(time.perf_counter() - started)
            passes.append(await prefills() - before)
            started = time.perf_counter()
            decoded = await asyncio.gather(*(greedy(client, p, len(t), a) for a, p, t in probes))
            times["decoded"].append(time.perf_counter() - started)
    mine = slice(len(probes) - len(fp.prompts), None)  # the release's own row
    return {**{name: statistics.median(values) for name, values in times.items()},
            "prefills": statistics.median(passes), "problem": fp.mismatch(forced[mine]),
            "decoded_as_reference": sum(ids == t for (ids, _), t in zip(decoded[mine], fp.tokens, strict=True))}


def last_proof(daemon: Any, name: str) -> dict[str, Any]:
    req = urllib.request.Request(f"{daemon.url}/reef/status", headers=daemon.headers())
    with urllib.request.urlopen(req, timeout=60) as r:
        status = json.loads(r.read())
    engine = next(s for s in status["scenarios"] if s["name"] == name)["engine"]
    return dict(engine["last_proof"] or {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--weights", action="store_true", help="full-weights releases instead of adapters")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="each proof's requests asked this many times a round")
    ap.add_argument("--max-tokens", type=int, default=None, help="release.proof.max_tokens (default: reefd's)")
    args = ap.parse_args()
    run(args.model, args.weights, args.rounds, args.max_tokens, args.repeats)


def run(model: str, weights: bool, rounds: int = 4, max_tokens: int | None = None, repeats: int = 5) -> None:
    """Measure and print (lines, then a JSON line); bench/hot_swap.py calls it after its own run."""
    tmp = scratch_dir()
    on, off = f"{model}-on", f"{model}-off"
    daemon = daemon_for(model, tmp, {on: scenario(model, True, max_tokens), off: scenario(model, False, None)})
    daemon.start()
    try:
        if weights:
            base = daemon.state / "models" / model
            tars = {str(i): tar_bytes(make_weights(base, tmp / f"w{i}", seed=i, scale=0.05)) for i in range(2)}
        else:
            tars = adapters(daemon, model, tmp / "loras")
        kind = "weights" if weights else "adapter"
        rows = []
        for i in range(rounds):
            tar = tars[sorted(tars)[i % len(tars)]]
            plain, _ = publish(daemon, off, kind, tar)
            proven, release = publish(daemon, on, kind, tar)
            proof = last_proof(daemon, on)
            assert proof.get("problem") is None, proof
            fp = Fingerprint.from_json(release["meta"]["proof"])
            assert fp is not None, release["meta"]
            side = asyncio.run(both_proofs(proof["url"], fp, None if weights else release["id"], repeats))
            assert side["problem"] is None, side
            rows.append({"swap_s": plain, "proven_s": proven, "proof_s": proof["s"], **side})
    finally:
        daemon.stop()
    report(model, kind, rows, max_tokens)


def report(model: str, kind: str, rows: list[dict[str, Any]], max_tokens: int | None) -> None:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    swap_s, proof_s, forced_s, decoded_s = med("swap_s"), med("proof_s"), med("teacher_forced"), med("decoded")
    reference_s = statistics.median(r["proven_s"] - r["swap_s"] - r["proof_s"] for r in rows)
    budget = max(0.1 * swap_s, 0.1)
    print(f"proof cost ({model}, {kind} releases, {len(rows)} rounds): publish -> serving without the proof "
          f"{swap_s:.3f} s (median); the proof {proof_s * 1000:.0f} ms per process ({proof_s / swap_s:.2f}x the "
          f"swap; budget {budget * 1000:.0f} ms: {'met' if proof_s <= budget else 'MISSED'}); the candidate's "
          f"reference fingerprint, once per candidate: {reference_s:.3f} s")
    print(f"  on the process, as reefd asks them: teacher-forced {forced_s * 1000:.0f} ms (in {med('prefills'):g} "
          f"prefills), decoded (the old proof) {decoded_s * 1000:.0f} ms: {decoded_s / forced_s:.1f}x faster; the "
          f"old proof would take {decoded_s / swap_s:.2f}x the swap")
    print(json.dumps({"bench": "proof_cost", "model": model, "kind": kind, "max_tokens": max_tokens,
                      "swap_s": round(swap_s, 4), "proof_s": round(proof_s, 4),
                      "proof_over_swap": round(proof_s / swap_s, 3), "teacher_forced_s": round(forced_s, 4),
                      "decoded_s": round(decoded_s, 4), "decoded_over_teacher_forced": round(decoded_s / forced_s, 2),
                      "decoded_over_swap": round(decoded_s / swap_s, 3), "reference_s": round(reference_s, 4),
                      "budget_s": round(budget, 4), "met": proof_s <= budget, "rounds": rows}))


if __name__ == "__main__":
    main()
