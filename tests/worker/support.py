"""Helpers for the worker tests: a worker subprocess with HTTP helpers, and a reference decoder."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.served import Served, free_port


@dataclass
class Worker(Served):
    """A `python -m reefd.worker` subprocess on a free loopback port, with small HTTP helpers."""

    model: Path
    log_path: Path
    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> Worker:
        self.launch([sys.executable, "-m", "reefd.worker", "--model", str(self.model),
                     "--port", str(self.port), *self.extra])
        self.wait_for("/health", timeout_s)
        return self

    def post(self, path: str, body: bytes | dict[str, Any]) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method="POST", headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        """The SSE `data:` payloads of a streaming POST, decoded (the `[DONE]` marker kept as a string)."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST", headers={"content-type": "application/json"}
        )
        events: list[Any] = []
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            for raw in r:
                line = raw.decode().rstrip("\n")
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    events.append(data if data == "[DONE]" else json.loads(data))
        return events

    def stats(self) -> dict[str, Any]:
        status, body = self.get("/server_info")
        assert status == 200
        return dict(json.loads(body)["stats"])


@torch.inference_mode()
def reference_greedy(engine: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by full forward passes: no cache, no padding, no batching."""
    ids, out, logprobs = list(prompt), [], []
    for _ in range(n):
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
        logprobs.append(float(logits.log_softmax(-1)[token]))
        ids.append(token)
    return out, logprobs
