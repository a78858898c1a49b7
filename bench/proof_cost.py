"""What the release proof adds to a swap: publish → serving with `release.proof` on, against the same publishes with
it off, in the same run.

A real reefd serves two scenarios on two engines of the same model, one proving its releases and one not. The
bench publishes real LoRA adapters to each in turn (and, with --weights, full-weights copies of the model). Per
swap it reports the publish call's time on both sides and the proof itself (the engine's `last_proof`: every
probe prompt answered by the process and compared). Publishing with the proof on also pays the reference
fingerprint of the new candidate (reported apart: it is made once, when a candidate is written, not on a swap).
Goal: the proof adds at most 10% of the swap time, or 100 ms, whichever is larger.
Run: python bench/proof_cost.py --model tiny|smollm2 [--weights]; bench/hot_swap.py runs it after its own swaps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from typing import Any

from _harness import scratch_dir
from hot_swap import adapters, daemon_for, tar_bytes

from tests.loras import make_weights


def scenario(model: str, on: bool, max_tokens: int | None) -> str:
    tokens = f"    max_tokens: {max_tokens}\n" if max_tokens else ""
    return (f"defaults:\n  - model: {model}\n  - release: follow\n  - _self_\n"
            f"model:\n  name: {model}-{'on' if on else 'off'}\nrelease:\n  proof:\n    enabled: {str(on).lower()}\n"
            + tokens)


def publish(daemon: Any, name: str, kind: str, tar: bytes) -> float:
    req = urllib.request.Request(f"{daemon.url}/reef/scenarios/{name}/releases?kind={kind}", data=tar,
                                 headers={**daemon.headers(), "Content-Type": "application/x-tar"}, method="POST")
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        answer = json.loads(r.read())
    elapsed = time.perf_counter() - started
    if answer["serving"] != answer["release"]["id"]:
        raise RuntimeError(f"{name}: published {answer['release']['id']} but serving {answer['serving']}")
    return elapsed


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
    ap.add_argument("--max-tokens", type=int, default=None, help="release.proof.max_tokens (default: reefd's)")
    args = ap.parse_args()
    run(args.model, args.weights, args.rounds, args.max_tokens)


def run(model: str, weights: bool, rounds: int = 4, max_tokens: int | None = None) -> None:
    """Measure and print (a line, then a JSON line); bench/hot_swap.py calls it after its own run."""
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
            plain = publish(daemon, off, kind, tar)
            proven = publish(daemon, on, kind, tar)
            proof = last_proof(daemon, on)
            assert proof.get("problem") is None, proof
            rows.append({"swap_s": plain, "proven_s": proven, "proof_s": proof["s"]})
    finally:
        daemon.stop()
    swap_s = statistics.median(r["swap_s"] for r in rows)
    proof_s = statistics.median(r["proof_s"] for r in rows)
    reference_s = statistics.median(r["proven_s"] - r["swap_s"] - r["proof_s"] for r in rows)
    budget = max(0.1 * swap_s, 0.1)
    print(f"proof cost ({model}, {kind} releases, {rounds} rounds): publish -> serving without the proof "
          f"{swap_s:.3f} s (median); the proof {proof_s * 1000:.0f} ms per process ({proof_s / swap_s:.2f}x the "
          f"swap; budget {budget * 1000:.0f} ms: {'met' if proof_s <= budget else 'MISSED'}); the candidate's "
          f"reference fingerprint, once per candidate: {reference_s:.3f} s")
    print(json.dumps({"bench": "proof_cost", "model": model, "kind": kind, "max_tokens": max_tokens,
                      "swap_s": round(swap_s, 4),
                      "proof_s": round(proof_s, 4), "proof_over_swap": round(proof_s / swap_s, 3),
                      "reference_s": round(reference_s, 4), "budget_s": round(budget, 4),
                      "met": proof_s <= budget, "rounds": rows}))


if __name__ == "__main__":
    main()
