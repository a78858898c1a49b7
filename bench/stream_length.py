"""Long streams: time per token and reefd's memory from the first thousand tokens to the 32 thousandth.

One streamed answer of `--tokens` tokens (default 32768) from the tiny model, through a real reefd and its worker,
read with the official `openai` SDK. Every thousand tokens it notes the time the window took, the CPU time reefd
and the worker spent on it, and reefd's RSS. The answer must end with its finish reason, and its record must be on
disk with every token.

Baseline, measured in the same run: the bare model (no reefd, no worker, no HTTP) decoding the same lengths with
the same KV cache, one thread, the floor any server on this model has. Attention reads the whole context for each
new token, so even the bare model's time per token grows with the length (on the tiny model, where attention is
most of the work at 32k); the bench prints the ratios (last eighth of the answer / first eighth) of the end-to-end
time, the bare model and reefd's own CPU time per token. Goal: reefd's CPU time per token flat (ratio <= 1.2),
and reefd's RSS flat.

With --engines worker,vllm the same stream runs through each engine in turn (its CPU counts its child processes:
vLLM's engine core), against one bare-model baseline; --model smollm2 --tokens 2048 --window 256 fits SmolLM2's
context.

Run: python bench/stream_length.py [--tokens 32768] [--window 1024] [--model tiny|smollm2] [--engines worker,vllm]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from _harness import on_engine, os, rss_mb, scratch_dir, start_reefd, tree_cpu_s

GOAL = 1.2


def bare_model(model: Path, tokens: int, window: int) -> list[float]:
    """Seconds per token of each window when the model alone decodes `tokens` tokens, one thread."""
    import torch

    from reefd.worker.model import Model

    torch.set_num_threads(1)
    engine = Model(model, device="cpu")
    pre = engine.prefill([[1, 5, 9]])
    cache, mask = engine.cache_from(pre.kv), pre.mask
    positions, token = torch.tensor([3]), torch.tensor([7])
    out, start = [], time.perf_counter()
    with torch.inference_mode():
        for i in range(tokens):
            mask = torch.cat([mask, mask.new_ones((1, 1))], dim=1)
            logits, cache = engine.decode_step(cache, mask, token, positions)
            positions, token = positions + 1, logits.argmax(-1)
            if (i + 1) % window == 0:
                now = time.perf_counter()
                out.append((now - start) / window)
                start = now
    return out


def cpu_s(pid: int) -> float:
    """CPU-seconds `pid` used so far (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Arrival = tuple[float, int, float, float, float]  # time, characters so far, reefd RSS MB, reefd and worker CPU s


def per_window(model: Path, ids: list[int], arrivals: list[Arrival], began: Arrival,
               window: int) -> list[tuple[float, float, float, float]]:
    """(seconds per token, reefd CPU s per token, worker CPU s per token, reefd RSS MB) of each window of `window`
    tokens, from when the client saw the text of the window's last token (the record's ids, decoded as the worker
    decodes them, give each token's text)."""
    from transformers import AutoTokenizer

    from reefd.worker.detok import TextTracker

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    tracker = TextTracker(lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)), [])
    ends: list[int] = []  # characters of text once token k+1 is decoded
    for k in range(1, len(ids) + 1):
        tracker.update(ids[:k])
        ends.append(len(tracker.text))
    out, prev, i = [], began, 0
    for k in range(window, len(ids) + 1, window):
        while i < len(arrivals) - 1 and arrivals[i][1] < ends[k - 1]:
            i += 1
        now = arrivals[i]
        out.append(((now[0] - prev[0]) / window, (now[3] - prev[3]) / window, (now[4] - prev[4]) / window, now[2]))
        prev = now
    return out


def scenario(model: str, engine: str) -> str:
    """One request at a time; the worker on one thread (the bare model's)."""
    text = f"defaults:\n  - model: {model}\n  - _self_\nmodel:\n  max_batch: 1\n"
    if engine == "worker":
        return text + '  launch_args: ["--threads", "1"]\n'
    return on_engine(text, engine)


def stream(engine: str, model: str, tokens: int, window: int, baseline: bool) -> dict[str, Any]:
    """One long stream through reefd on `engine`: per window, time, reefd's and the engine's CPU, reefd's RSS;
    with `baseline`, then the bare model's time per token on the same folder (while it is still there)."""
    from openai import OpenAI

    tmp = scratch_dir()
    daemon = start_reefd(tmp, {"long": scenario(model, engine)}, seed_model=model)
    try:
        folder = tmp / "state" / "models" / model
        client = OpenAI(base_url=daemon.url + "/v1", api_key=daemon.token, max_retries=0, timeout=3600)
        rss0 = rss_mb(daemon.proc.pid)  # type: ignore[union-attr]
        status, body = daemon.get("/reef/status")
        worker = next(sc for sc in json.loads(body)["scenarios"] if sc["name"] == "long")["engine"]["pid"]

        def sample(chars: int) -> Arrival:
            pid = daemon.proc.pid  # type: ignore[union-attr]
            return time.perf_counter(), chars, rss_mb(pid), cpu_s(pid), tree_cpu_s(worker)

        arrivals: list[Arrival] = []
        chars, used, finish = 0, 0, None
        began = sample(0)
        raw = client.chat.completions.with_raw_response.create(
            model="long", messages=[{"role": "user", "content": "Write for a long time."}], stream=True,
            max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True}, extra_headers={"x-reef-scenario": "long"})
        receipt = raw.headers["x-reef-agent-record-id"]
        for n, chunk in enumerate(raw.parse()):
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
            for choice in chunk.choices:
                chars += len(choice.delta.content or "")
                finish = choice.finish_reason or finish
            # /proc is read every 16th chunk: the windows are hundreds of tokens
            arrivals.append(sample(chars) if n % 16 == 0 else (time.perf_counter(), chars, *arrivals[-1][2:]))
        rss1 = rss_mb(daemon.proc.pid)  # type: ignore[union-attr]
        status, body = daemon.get(f"/reef/records/{receipt}")
        record = json.loads(body) if status == 200 else {}
        completion = record.get("completion_token_ids")
        ok = finish == "length" and used == tokens and completion is not None and len(completion) == tokens
        if not ok:
            print(f"finish {finish!r}, usage {used}, record {status}: {str(record)[:300]}")
        windows = per_window(folder, completion or [], arrivals, began, window)
        daemon.stop()  # the bare model runs alone
        base = bare_model(folder, tokens, window) if baseline else []
        return {"windows": windows, "rss0": rss0, "rss1": rss1, "ok": ok, "finish": finish, "base": base}
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def report(engine: str, model: str, run: dict[str, Any], base: list[float], args: argparse.Namespace
           ) -> dict[str, Any]:
    windows = run["windows"]
    print(f"{engine} ({model}):")
    print(f"{'tokens':>8} {'ms/token':>9} {'bare model':>11} {'engine CPU':>11} {'reefd CPU':>10} {'reefd RSS MB':>13}")
    n = min(len(windows), len(base))
    for i in range(n):
        per, reefd, work, rss = windows[i]
        print(f"{(i + 1) * args.window:>8} {per * 1e3:>9.2f} {base[i] * 1e3:>11.2f} {work * 1e3:>11.2f} "
              f"{reefd * 1e3:>10.3f} {rss:>13.1f}")
    head, tail = windows[: max(1, n // 8)], windows[n - max(1, n // 8) : n]  # first and last eighth

    def mean(rows: list[tuple[float, float, float, float]], col: int) -> float:
        return sum(r[col] for r in rows) / len(rows)

    e2e_ratio = mean(tail, 0) / mean(head, 0)
    bare_ratio = (sum(base[n - len(tail) : n]) / len(tail)) / (sum(base[: len(head)]) / len(head))
    reefd_ratio = mean(tail, 1) / mean(head, 1)
    verdict = "ok" if reefd_ratio <= GOAL else "over the goal"
    print(f"first eighth -> last eighth: end to end {e2e_ratio:.2f}x, bare model {bare_ratio:.2f}x (attention "
          f"reads the whole context per token), engine CPU {mean(tail, 2) / mean(head, 2):.2f}x, reefd CPU "
          f"{mean(head, 1) * 1e3:.3f} -> {mean(tail, 1) * 1e3:.3f} ms/token = {reefd_ratio:.2f}x (goal <= {GOAL}x: "
          f"{verdict}); reefd RSS {run['rss0']:.0f} -> {run['rss1']:.0f} MB; mean {mean(windows[:n], 0) * 1e3:.2f} "
          f"ms/token; finish {run['finish']}, record {'complete' if run['ok'] else 'MISSING OR SHORT'}")
    return {"ms_per_token": [round(w[0] * 1e3, 3) for w in windows[:n]],
            "engine_cpu_ms_per_token": [round(w[2] * 1e3, 3) for w in windows[:n]],
            "reefd_cpu_ms_per_token": [round(w[1] * 1e3, 4) for w in windows[:n]],
            "rss_mb": [round(w[3], 1) for w in windows[:n]], "mean_ms_per_token": round(mean(windows[:n], 0) * 1e3, 3),
            "end_to_end_ratio": round(e2e_ratio, 3), "bare_ratio": round(bare_ratio, 3),
            "reefd_cpu_ratio": round(reefd_ratio, 3), "rss_before_mb": round(run["rss0"], 1),
            "rss_after_mb": round(run["rss1"], 1), "finish": run["finish"], "record_complete": run["ok"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--engines", default="worker", help="engines to stream from, one after the other "
                                                        "(worker,vllm: side by side in one run)")
    args = ap.parse_args()
    engines = args.engines.split(",")
    runs = {engine: stream(engine, args.model, args.tokens, args.window, engine == engines[0]) for engine in engines}
    base = runs[engines[0]]["base"]
    out = {engine: report(engine, args.model, run, base, args) for engine, run in runs.items()}
    print(json.dumps({"bench": "stream_length", "model": args.model, "tokens": args.tokens, "window": args.window,
                      "bare_ms_per_token": [round(b * 1e3, 3) for b in base], "engines": out}))
    if not all(run["ok"] for run in runs.values()):
        raise SystemExit("a long stream did not end with its finish reason and a complete record")


if __name__ == "__main__":
    main()
