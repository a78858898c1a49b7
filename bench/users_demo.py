"""Per-user learning on SmolLM2 through reefd: four users, four preferences, four release lines.

Each simulated user (bench/openclaw_user.py) wants every answer to open their own way: alice with "Hello", bob
with "Hey", carol with "Dear", dave with "Sure". They never report a score: each says so only as a correction
("Please start your answer with 'Hey'.") when an answer misses it, in conversations of their own (`x-reef-user`,
a session header). One scenario serves them all (`users:`), with openclaw-rl (a scripted judge reads each user's
next message, labelled as such), a count trigger that counts each user's own judged turns, and the holdout gate
on each user's own tasks (`users.tasks`: 8 questions, their opening as the pattern to match). After each round
(4 conversations of 3 turns per user), greedy held-out answers (questions never asked in training, as side calls,
which never train) of each user's serving release are scored by every user's opening.

After learning, the demo prints the user x user table (row: whose release answered; column: whose opening scored
it; the diagonal should be high, the rest near the base row), then checks in the running daemon:
- a bad release of bob's (a random adapter published to his line) is rolled back alone: bob is served his
  learned release again and nobody else's release moved;
- deleting dave leaves the other three served by their releases, and dave's receipts answer 404.
It writes bench/out/users.png (each user's own score per round) and bench/out/users.json; the last line printed
is a JSON summary.

Learning stops once every user's own score reaches --target (0.8), or after --rounds rounds (24): a budget of
steps, so a busy machine makes the demo slower, not different.

Run: python bench/users_demo.py [--rounds 24] [--minutes M] [--keep]   (make demo runs it; 30-120 minutes on
2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import learning_tasks as lt
import openclaw_user as sim
from _harness import ROOT, Daemon, scratch_dir, start_reefd

OUT = ROOT / "bench" / "out"
NAME = "assist"
OPENINGS = {"alice": "Hello", "bob": "Hey", "carol": "Dear", "dave": "Sure"}  # each user's hidden preference
CONVERSATIONS, TURNS, BATCH = 4, 3, 8  # per user and round: 4 x 2 judged turns = one job of 8


def score(user: str, text: str) -> float:
    return 1.0 if sim.complies(text, OPENINGS[user]) else 0.0


def scenario_files(tmp: Path) -> dict[str, str]:
    gate = tmp / "scenarios" / "users-gate"
    gate.mkdir(parents=True, exist_ok=True)
    patterns = {u: f"(?i)^\\W*{o}" for u, o in OPENINGS.items()} | {"shared": ""}
    for user, pattern in patterns.items():
        (gate / f"{user}.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": pattern}) + "\n"
                                                    for q in lt.GATE))
    return {NAME: (
        "defaults: [{model: smollm2}, {recipe: openclaw-rl}, {trigger: count}, {gate: holdout}, {release: follow}, "
        "_self_]\n"
        "description: bench/users_demo.py, four users' openings learned from their own conversations.\n"
        "model: {max_batch: 8}\n"
        f"recipe: {{params: {{batch_size: {BATCH}, lr: 1e-3, w_rl: 1.0, w_opd: 1.0, top_k: 4, opd_set: union, "
        "judge: {model: 'bench.openclaw_user:judge'}}}\n"
        f"trigger: {{every_n_records: {BATCH}}}\n"
        "gate: {tasks: users-gate/shared.jsonl, scorer: regex, min_tasks: 8, max_tokens: 4, temperature: 0.0, "
        "margin: -0.15}\n"
        f"users: {{slots: {len(OPENINGS)}, tasks: 'users-gate/{{user}}.jsonl'}}\n"
        "serve: {temperature: 1.0, default_max_tokens: 3}\n")}


class Client:
    """Every user's side: one AsyncOpenAI client per user, one aiohttp session for the admin API."""

    def __init__(self, daemon: Daemon) -> None:
        import aiohttp
        from openai import AsyncOpenAI

        def sdk(headers: dict[str, str]) -> AsyncOpenAI:
            return AsyncOpenAI(base_url=daemon.url + "/v1", api_key=daemon.token, max_retries=2, timeout=600,
                               default_headers={"x-reef-scenario": NAME, **headers})

        self.daemon = daemon
        self.users = {u: sdk({"x-reef-user": u}) for u in OPENINGS}
        self.nobody = sdk({})
        self.http = aiohttp.ClientSession(headers={**daemon.headers(), "x-reef-scenario": NAME},
                                          timeout=aiohttp.ClientTimeout(total=600))

    async def close(self) -> None:
        for c in [*self.users.values(), self.nobody]:
            await c.close()
        await self.http.close()

    async def ask(self, user: str | None, messages: list[dict[str, Any]], headers: dict[str, str],
                  **sampling: Any) -> tuple[str, str, str]:
        """(answer text, receipt, release id) of one answer for `user` (None: nobody's)."""
        client = self.nobody if user is None else self.users[user]
        raw = await client.chat.completions.with_raw_response.create(model=NAME, messages=messages,  # type: ignore
                                                                     extra_headers=headers, **sampling)
        text = raw.parse().choices[0].message.content or ""
        return text, raw.headers["x-reef-agent-record-id"], raw.headers["x-reef-release-id"]

    async def call(self, method: str, path: str, ok: tuple[int, ...] = (200,)) -> Any:
        async with self.http.request(method, self.daemon.url + path) as r:
            if r.status not in ok:
                raise RuntimeError(f"{method} {path}: {r.status} {await r.text()}")
            return await r.json() if r.status == 200 else r.status

    async def serving(self) -> dict[str, str]:
        """What each user is served now: user -> release id."""
        listed = (await self.call("GET", f"/reef/scenarios/{NAME}/users"))["data"]
        return {u["user"]: u["release"] for u in listed}

    async def settle(self, timeout_s: float = 900) -> list[dict[str, Any]]:
        """Once every judged turn is judged and no job is queued or running: the scenario's jobs, newest first."""
        deadline, quiet = time.monotonic() + timeout_s, 0
        while time.monotonic() < deadline:
            status = next(s for s in (await self.call("GET", "/reef/status"))["scenarios"] if s["name"] == NAME)
            jobs = (await self.call("GET", f"/reef/jobs?scenario={NAME}"))["data"]
            busy = status.get("judge", {}).get("pending", 0) or any(j["state"] in ("queued", "running") for j in jobs)
            quiet = 0 if busy else quiet + 1
            if quiet >= 3:
                return list(jobs)
            await asyncio.sleep(0.5)
        raise RuntimeError(f"reefd did not settle within {timeout_s:.0f} s:\n{self.daemon.logs()[-3000:]}")


class Demo:
    def __init__(self, client: Client, seed: int) -> None:
        self.client, self.rng = client, random.Random(seed)
        self.curve: dict[str, list[tuple[float, float]]] = {u: [] for u in OPENINGS}  # (minutes, own score)
        self.rows: dict[str, dict[str, float]] = {}  # whose release answered -> whose opening -> held-out score
        self.releases: dict[str, list[str]] = {u: [] for u in OPENINGS}
        self.sessions = 0

    async def evaluate(self, who: str | None, want: str | None = None) -> dict[str, float]:
        """Greedy held-out answers of `who`'s serving release (None: the shared one), scored by every opening;
        every answer must come from `want` when given."""
        answers = await asyncio.gather(*(self.client.ask(who, [{"role": "user", "content": q}],
                                                         {"x-reef-turn": "side"}, temperature=0.0, max_tokens=6)
                                         for q in sim.HELD_OUT))
        served = {rel for _, _, rel in answers}
        if want is not None and served != {want}:
            raise RuntimeError(f"{who}'s held-out answers came from {sorted(served)}, not {want}")
        return {u: sum(score(u, t) for t, _, _ in answers) / len(answers) for u in OPENINGS}

    async def conversation(self, user: str) -> None:
        """Three turns of `user`'s, corrected whenever an answer misses their opening."""
        self.sessions += 1
        session = f"{user}-{self.sessions}-{self.rng.random():.6f}"
        questions = self.rng.sample(sim.TRAIN, 3)
        messages: list[dict[str, Any]] = [{"role": "user", "content": questions[0]}]
        for turn in range(TURNS):
            text, _, _ = await self.client.ask(user, messages, {"x-reef-session": session})
            messages.append({"role": "assistant", "content": text})
            if turn + 1 < TURNS:
                messages.append({"role": "user", "content": sim.reply(text, questions[(turn + 1) % 3],
                                                                      OPENINGS[user])})

    async def learn(self, rounds: int, target: float, minutes: float | None = None) -> None:
        self.rows["base"] = await self.evaluate(None)
        print("base (the shared release), held-out: " + fmt(self.rows["base"]), flush=True)
        for u in OPENINGS:
            self.curve[u].append((0.0, self.rows["base"][u]))
        start, seen, n = time.monotonic(), set(), 0
        while n < rounds and (minutes is None or time.monotonic() - start < minutes * 60):
            n += 1
            await asyncio.gather(*(self.conversation(u) for u in OPENINGS for _ in range(CONVERSATIONS)))
            jobs = [j for j in await self.client.settle() if j["id"] not in seen]
            seen.update(j["id"] for j in jobs)
            published = {j["user"]: j["release"] for j in reversed(jobs) if j["state"] == "published"}
            for u, release in published.items():
                self.rows[u] = await self.evaluate(u, release)
                self.releases[u].append(release)
            at = (time.monotonic() - start) / 60
            for u in OPENINGS:
                self.curve[u].append((at, self.rows.get(u, self.rows["base"])[u]))
            states = ", ".join(f"{j['user']} {j['state']}" for j in reversed(jobs))
            print(f"round {n} ({at:.1f} min): jobs {states or 'none'}; own held-out: "
                  + fmt({u: self.curve[u][-1][1] for u in OPENINGS}), flush=True)
            if all(self.curve[u][-1][1] >= target for u in OPENINGS):
                break

    def table(self) -> str:
        lines = ["release \\ scored by".ljust(22) + "".join(f"{u} ({o})".rjust(16) for u, o in OPENINGS.items())]
        for who, row in self.rows.items():
            lines.append((f"{who}'s" if who != "base" else "base (shared)").ljust(22)
                         + "".join(f"{row[u]:16.2f}" for u in OPENINGS))
        return "\n".join(lines)


def fmt(scores: dict[str, float]) -> str:
    return ", ".join(f"{u} {s:.2f}" for u, s in scores.items())


def reefctl(d: Daemon, *args: str) -> Any:
    env = {**os.environ, "REEF_URL": d.url, "REEF_TOKEN": d.token}
    out = subprocess.run([str(Path(sys.executable).parent / "reefctl"), *args, "-o", "json"], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"reefctl {' '.join(args)}: {out.stderr}")
    return json.loads(out.stdout)


async def bad_release_rolled_back(demo: Demo, d: Daemon, scratch: Path) -> dict[str, Any]:
    """A random adapter published to bob's line hurts bob alone; rolling his line back restores him alone."""
    from tests.loras import make_lora

    before = await demo.client.serving()
    bad = await asyncio.to_thread(make_lora, d.state / "models" / "smollm2", scratch / "bad-lora", seed=7, scale=0.5)
    published = reefctl(d, "publish", NAME, "--adapter", str(bad), "--user", "bob")["release"]
    with_bad = await demo.evaluate("bob", published["id"])
    during = await demo.client.serving()
    reefctl(d, "rollback", NAME, "--user", "bob")
    after = await demo.client.serving()
    back = await demo.evaluate("bob", after["bob"])
    others = [u for u in OPENINGS if u != "bob"]
    result = {"bad_release": published["id"], "bob_with_bad": with_bad["bob"], "bob_after_rollback": back["bob"],
              "rollback_release": after["bob"], "others_unmoved": all(before[u] == during[u] == after[u]
                                                                      for u in others)}
    print(f"bad release {published['id']} for bob: his held-out {with_bad['bob']:.2f}; rolled back ({after['bob']}):"
          f" {back['bob']:.2f}; the others' releases unmoved: {result['others_unmoved']}", flush=True)
    return result


async def delete_dave(demo: Demo, d: Daemon) -> dict[str, Any]:
    """Deleting dave leaves the others served by their own releases; dave's receipts answer 404."""
    _, receipt, _ = await demo.client.ask("dave", [{"role": "user", "content": "One more before I go?"}], {})
    before = await demo.client.serving()
    gone = reefctl(d, "users", "delete", NAME, "dave")
    after = await demo.client.serving()
    left = [u for u in OPENINGS if u != "dave"]
    served = {u: (await demo.client.ask(u, [{"role": "user", "content": sim.HELD_OUT[0]}],
                                        {"x-reef-turn": "side"}, temperature=0.0))[2] for u in left}
    status = await demo.client.call("GET", f"/reef/records/{receipt}", ok=(404,))
    result = {"deleted": {k: gone[k] for k in ("records", "releases", "jobs", "lfs_objects")},
              "dave_receipt_status": status, "dave_listed": "dave" in after,
              "others_served_their_own": all(served[u] == before[u] == after[u] for u in left)}
    print(f"deleted dave: {result['deleted']}; his receipt answers {status}; the others served by their own "
          f"releases: {result['others_served_their_own']}", flush=True)
    return result


def plot(demo: Demo, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for u, opening in OPENINGS.items():
        xs, ys = zip(*demo.curve[u], strict=True)
        ax.step(xs, ys, where="post", marker="o", markersize=3, label=f"{u}: opens with '{opening}'")
    ax.set(xlabel="minutes", ylabel="held-out: the user's own release, their opening",
           title="SmolLM2-135M, four users of one scenario, 2 CPU cores", ylim=(0, 1.05))
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def run(args: argparse.Namespace, d: Daemon, scratch: Path) -> dict[str, Any]:
    client = Client(d)
    try:
        demo = Demo(client, args.seed)
        t0 = time.monotonic()
        await demo.learn(args.rounds, args.target, args.minutes)
        learned_min = (time.monotonic() - t0) / 60
        print("\nheld-out, greedy (16 questions): the share of answers that open as each user wants\n"
              + demo.table() + "\n", flush=True)
        rollback = await bad_release_rolled_back(demo, d, scratch)
        deletion = await delete_dave(demo, d)
    finally:
        await client.close()
    plot(demo, OUT / "users.png")
    own = {u: demo.rows.get(u, demo.rows["base"])[u] for u in OPENINGS}
    others = {u: sum(demo.rows.get(v, demo.rows["base"])[u] for v in OPENINGS if v != u) / (len(OPENINGS) - 1)
              for u in OPENINGS}
    return {"bench": "users_demo", "model": "smollm2", "judge": "scripted (bench/openclaw_user.py:judge)",
            "minutes": round(learned_min, 1), "table": demo.rows, "own": own, "others_mean": others,
            "curve": demo.curve, "releases": demo.releases, "rollback": rollback, "deletion": deletion,
            "png": str(OUT / "users.png")}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=24, help="learning's budget: rounds of conversations, each "
                        "user's job and its evaluation")
    parser.add_argument("--minutes", type=float, default=None, help="also stop learning after this many minutes")
    parser.add_argument("--target", type=float, default=0.8, help="stop once every user's own score reaches it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args()
    scratch = scratch_dir()
    d = start_reefd(scratch, scenario_files(scratch), seed_model="smollm2",
                    env={"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'bench'}"})
    print(f"reefd ready at {d.url}; scratch {scratch} (log {d.log_path})", flush=True)
    ok = False
    try:
        summary = asyncio.run(run(args, d, scratch))
        ok = True
    finally:
        d.stop()
        if ok and not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "users.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("bench", "judge", "minutes", "own", "others_mean")}))
    if not all(summary["own"][u] > summary["table"]["base"][u] for u in OPENINGS) \
            or not summary["rollback"]["others_unmoved"] or not summary["deletion"]["others_served_their_own"]:
        raise SystemExit("users_demo: a user did not learn, or one user's change moved another's release")


if __name__ == "__main__":
    main()
