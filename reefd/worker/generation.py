"""What a request is inside the worker: its asyncio side (Generation, Update), its running row in the
batcher (Row), model changes between steps (Control), and the counters (Stats).

Plain data shared by the batcher thread and the HTTP layer; no scheduling logic here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from reefd.worker.detok import TextTracker
from reefd.worker.params import GenerateRequest, SamplingParams

Finish = dict[str, Any]
TopLogprobs = list[list[Any]]  # one token's alternatives: [[logprob, token_id, None], ...], best first


@dataclass
class Update:
    """What one batcher step produced for one request (ids, logprobs and top logprobs are the new ones)."""

    new_ids: list[int]
    new_logprobs: list[float]
    new_text: str  # the text that became safe to show (final: the rest, its stop string trimmed)
    finish: Finish | None = None
    input_logprobs: list[list[Any]] | None = None  # only on the first update, when asked
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # one per new id when top_logprobs_num > 0
    input_top_logprobs: list[TopLogprobs | None] | None = None  # with input_logprobs, when top_logprobs_num > 0


class Generation:
    """The asyncio side of one request: a queue of `Update`s and a cancel flag."""

    def __init__(self, req: GenerateRequest, prompt: list[int], loop: asyncio.AbstractEventLoop) -> None:
        self.req = req
        self.prompt = prompt
        self.loop = loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.cancelled = False  # written by the loop, read by the batcher thread
        self.aborted: str | None = None  # cancelled by the server (not the client): the answer ends `abort` saying so
        self.created = time.monotonic()


@dataclass(eq=False)
class Row:
    """A running sequence inside the batcher thread."""

    job: Generation
    sampling: SamplingParams
    max_new: int
    generator: torch.Generator
    tracker: TextTracker
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # one per id when top_logprobs_num > 0
    sent: int = 0  # ids already delivered
    finish: Finish | None = None
    delivered: bool = False  # its final update went out (it may stay in the batch until the next compaction)
    input_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[TopLogprobs | None] | None = None


@dataclass(eq=False)
class Control:
    """Work on the model itself (adapters, weights), run by the batcher thread between steps.

    `ready` is checked before each step; `exclusive` holds admission while it waits.
    """

    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]
    ready: Callable[[], bool] = lambda: True
    exclusive: bool = False


@dataclass
class Stats:
    prefills: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # rows generating, summed over decode steps
    max_running: int = 0  # the most rows generating in one decode step
    requests_completed: int = 0
    tokens_generated: int = 0

    def as_dict(self) -> dict[str, Any]:
        avg = self.decode_rows / self.decode_steps if self.decode_steps else 0.0
        return {**self.__dict__, "avg_decode_batch": round(avg, 3)}
