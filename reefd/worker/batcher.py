"""Continuous batching: one batcher thread runs torch for every in-flight request.

Owns the running batch (KV cache rows, masks, positions), admission, stop rules and the
hand-off of token updates to asyncio queues. Knows nothing about HTTP or wire formats.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import threading
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from reefd.worker import kvcache
from reefd.worker.detok import TextTracker
from reefd.worker.generation import Control, Generation, Row, Stats, TopLogprobs, Update
from reefd.worker.model import Model
from reefd.worker.params import BadRequest, GenerateRequest
from reefd.worker.sampling import draw_uniforms, prompt_logprobs, sample, top_logprobs

log = logging.getLogger("reefd.worker")
SHARED_PREFILL_MAX = 1024  # longer prompts are prefilled alone (see Batcher._admit)
SHARED_SCORED_MAX = 64  # requests scoring at most this many prompt positions share a prefill (see Batcher._admit)


class Batcher:
    """Admits waiting jobs into the running batch and steps it until every row finishes."""

    def __init__(self, engine: Model, max_batch: int = 8, threads: int | None = None) -> None:
        self.engine = engine
        self.max_batch = max(1, max_batch)
        self.threads = threads
        self.stats = Stats()
        self._waiting: deque[Generation] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="reefd-worker-batcher", daemon=True)
        self._seeds = random.SystemRandom()
        self.rows: list[Row] = []
        self._cache: Any = None
        self._mask = torch.zeros((0, 0), dtype=torch.long)
        self._positions = torch.zeros(0, dtype=torch.long)
        self._next = torch.zeros(0, dtype=torch.long)
        self._control: deque[Control] = deque()
        self.unloading: set[str] = set()  # adapters being unloaded: new requests for them are refused

    # ---- asyncio side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, req: GenerateRequest, prompt: list[int]) -> Generation:
        """Queue a request (call on the event loop). Raises BadRequest for impossible prompts."""
        if not prompt:
            raise BadRequest("the prompt is empty")
        if len(prompt) >= self.engine.context_length:  # as SGLang: no room left for one new token
            raise BadRequest(f"the prompt has {len(prompt)} tokens but the model's context length is "
                             f"{self.engine.context_length} tokens: a prompt must leave room for at least one new "
                             "token")
        bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (size {self.engine.vocab_size})")
        job = Generation(req, prompt, asyncio.get_running_loop())
        with self._cond:
            if self._stopping:
                raise RuntimeError("the worker is shutting down")
            adapter = req.lora_path
            if adapter is not None and (adapter not in self.engine.adapters or adapter in self.unloading):
                raise BadRequest(f"no LoRA adapter named {adapter!r} is loaded "
                                 f"(loaded: {sorted(self.engine.adapters)})")
            self._waiting.append(job)
            self._cond.notify()
        return job

    def control(self, fn: Callable[[], Any], ready: Callable[[], bool] | None = None,
                exclusive: bool = False) -> asyncio.Future[Any]:
        """Run `fn` on the batcher thread between two steps, once `ready()` holds (call on the loop)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the worker is shutting down")
            self._control.append(Control(fn, future, ready or (lambda: True), exclusive))
            self._cond.notify()
        return asyncio.wrap_future(future)

    def uses_adapter(self, name: str) -> bool:
        """True while a waiting request or a row of the batch (a finished one until it leaves) uses adapter `name`
        (any thread; a snapshot)."""
        with self._cond:
            waiting = list(self._waiting)
        return any(r.job.req.lora_path == name for r in list(self.rows)) or \
            any(j.req.lora_path == name and not j.cancelled for j in waiting)

    def abort_running(self, message: str) -> None:
        """Cancel every running and waiting request (call on the loop); they finish as `abort` with `message`."""
        with self._cond:
            for job in [*self._waiting, *(row.job for row in self.rows)]:
                job.aborted = message
                job.cancelled = True
            self._cond.notify()

    @property
    def busy(self) -> int:
        """Requests waiting or running."""
        return len(self._waiting) + self.running

    @property
    def running(self) -> int:
        """Rows still generating (a snapshot; a finished row's client may hold its answer before _reap drops it)."""
        return sum(1 for row in list(self.rows) if row.finish is None)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request and end the batcher thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- batcher thread ---------------------------------------------------------
    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # OpenMP settings are per thread
        with torch.inference_mode():
            while True:
                self._run_controls()
                admitted = self._take()
                if admitted is None:
                    break
                try:
                    if admitted:
                        self._admit(admitted)
                    elif self.rows:
                        self._decode()
                except Exception as exc:  # keep serving: fail the batch, not the process
                    log.error("generation failed: %s\n%s", exc, traceback.format_exc())
                    self._fail_all(admitted, f"generation failed: {exc}")
                self._reap()
        self._abort_all("the worker is shutting down")
        with self._cond:
            controls = list(self._control)
            self._control.clear()
        for control in controls:
            control.future.set_exception(RuntimeError("the worker is shutting down"))

    def _run_controls(self) -> None:
        """Run every queued control whose time has come (between steps: no forward is running)."""
        with self._cond:
            due = [c for c in self._control if c.ready()]
            for control in due:
                self._control.remove(control)
        for control in due:
            if not control.future.set_running_or_notify_cancel():
                continue
            try:
                control.future.set_result(control.fn())
            except BaseException as exc:  # the caller gets it; the batcher keeps going
                control.future.set_exception(exc)

    def _take(self) -> list[Generation] | None:
        """Waiting jobs that fit in the batch; blocks while idle; None when stopping."""
        with self._cond:
            while not self._stopping and not self._waiting and not self.rows and not self._control:
                self._cond.wait()
            if self._stopping:
                return None
            if self._control and not self.rows:
                ready = [c for c in self._control if c.ready()]
                if ready:
                    return []  # run them first (the loop comes straight back)
                if not self._waiting:  # a control waits on something else: poll, never spin
                    self._cond.wait(0.01)
                    return []
            if any(c.exclusive for c in self._control):
                return []  # e.g. a weight update waits for the batch to drain: admit nobody meanwhile
            room = self.max_batch - len(self.rows)
            taken: list[Generation] = []
            while self._waiting and len(taken) < room:
                job = self._waiting.popleft()
                if not job.cancelled:
                    taken.append(job)
                elif job.aborted is not None:  # its client still waits for an answer
                    _deliver([(job, Update([], [], "", {"type": "abort", "message": job.aborted}))])
            return taken

    def _new_row(self, job: Generation) -> Row:
        """max_new_tokens past the context length is capped there (finish reason `length`)."""
        sp = job.req.sampling
        seed = sp.seed if sp.seed is not None else self._seeds.getrandbits(63)
        return Row(job=job, sampling=sp, max_new=min(sp.max_new_tokens, self.engine.context_length - len(job.prompt)),
                   generator=torch.Generator().manual_seed(seed), tracker=TextTracker(self.engine.decode, sp.stop))

    def _admit(self, jobs: list[Generation]) -> None:
        """Prefill new jobs, sample their first token, merge them into the running batch.

        Short prompts are prefilled together in one left-padded pass, first (so they get their
        first token soonest); requests for the logprobs of at most `SHARED_SCORED_MAX` prompt positions (a
        release proof's probes, whatever adapters they are on) together in a pass of their own, which keeps
        those positions' logits. A prompt longer than `SHARED_PREFILL_MAX` tokens, or one asking for more
        prompt logprobs, is prefilled alone: no padding means no (rows, 1, q, k) attention mask,
        which at 40k tokens would take gigabytes, and no compute spent on padding.
        """
        rows = [self._new_row(job) for job in jobs]
        alone = [r for r in rows if len(r.job.prompt) > SHARED_PREFILL_MAX or _kept(r) > SHARED_SCORED_MAX + 1]
        scoring = [r for r in rows if r not in alone and _kept(r) > 1]
        shared = [r for r in rows if r not in alone and r not in scoring]
        for group in [shared, scoring, *([r] for r in alone)]:
            if group:
                self._prefill(group)
        self._publish()

    def _prefill(self, rows: list[Row]) -> None:
        keep = max(_kept(r) for r in rows)
        pre = self.engine.prefill([r.job.prompt for r in rows], keep=keep, adapters=_adapters(rows))
        self.stats.prefills += 1
        for i, row in enumerate(rows):
            start = _scored_from(row)
            if start is not None:  # SGLang's shape: from logprob_start_len, its own entry without a logprob
                logits = None if pre.all_logits is None else pre.all_logits[i:i + 1, keep - _kept(row):]
                row.input_logprobs, row.input_top_logprobs = prompt_logprobs(row.job.prompt, start, logits,
                                                                             _top_n(row))
        uniforms = draw_uniforms([r.generator for r in rows])
        tokens, logprobs = sample(pre.last_logits, [r.sampling for r in rows], uniforms)
        tops = top_logprobs(pre.last_logits, [_top_n(r) if r.max_new > 0 else 0 for r in rows])
        for row, token, logprob, top in zip(rows, tokens.tolist(), logprobs.tolist(), tops, strict=True):
            if row.max_new == 0:  # prefill only (e.g. scoring a prompt's logprobs)
                row.finish = {"type": "length", "length": 0}
            else:
                self._append(row, token, logprob, top)
        positions = torch.tensor([len(r.job.prompt) for r in rows], device=pre.mask.device)
        if not self.rows:
            kv, mask = pre.kv, pre.mask
        else:
            kv, mask = kvcache.merge(kvcache.tensors(self._cache), self._mask, pre.kv, pre.mask)
            positions = torch.cat([self._positions, positions])
            tokens = torch.cat([self._next, tokens])
        self.rows += rows
        self._cache, self._mask, self._positions, self._next = self.engine.cache_from(kv), mask, positions, tokens

    def _decode(self) -> None:
        """One decode step for every running row."""
        mask = torch.cat([self._mask, self._mask.new_ones((self._mask.shape[0], 1))], dim=1)
        logits, self._cache = self.engine.decode_step(self._cache, mask, self._next, self._positions,
                                                      adapters=_adapters(self.rows))
        self._mask, self._positions = mask, self._positions + 1
        rows = self.rows
        live = sum(1 for r in rows if r.finish is None)
        self.stats.decode_steps += 1
        self.stats.decode_rows += live
        self.stats.max_running = max(self.stats.max_running, live)
        tokens, logprobs = sample(logits, [r.sampling for r in rows], draw_uniforms([r.generator for r in rows]))
        tops = top_logprobs(logits, [_top_n(r) if r.finish is None else 0 for r in rows])
        self._next = tokens
        for row, token, logprob, top in zip(rows, tokens.tolist(), logprobs.tolist(), tops, strict=True):
            if row.finish is None:
                self._append(row, token, logprob, top)
        self._publish()

    def _append(self, row: Row, token: int, logprob: float, top: TopLogprobs | None = None) -> None:
        """Record one token (and its top logprobs, when asked) and apply SGLang's stop rules in SGLang's order."""
        row.ids.append(token)
        row.logprobs.append(logprob)
        if top is not None:
            row.top_logprobs.append(top)
        self.stats.tokens_generated += 1
        sp = row.sampling
        if len(row.ids) >= row.max_new:
            row.finish = {"type": "length", "length": row.max_new}
            row.tracker.update(row.ids, check_stops=False, final=True)
        elif not sp.ignore_eos and (token in sp.stop_token_ids or token in self.engine.eos_ids):
            row.finish = {"type": "stop", "matched": token}
            row.tracker.update(row.ids[:-1], check_stops=False, final=True)  # the matched token's text is not shown
        elif (matched := row.tracker.update(row.ids)) is not None:
            row.finish = {"type": "stop", "matched": matched}

    def _publish(self) -> None:
        """Hand this step's updates to the event loop (streams every step, others at the end)."""
        out, ended = _updates(self.rows)
        _deliver(out)
        for row in ended:  # marked once handed over: a failure before that still gets them an abort
            row.delivered = True

    def _reap(self) -> None:
        """Finish cancelled rows, then drop finished rows from the batch once dropping is worth its copy (see
        `_worth_dropping`); until then they generate on, and nobody reads those tokens."""
        aborted = []
        for row in self.rows:
            if row.finish is None and row.job.cancelled:
                row.finish = {"type": "abort", "message": row.job.aborted or "cancelled by the client"}
                row.delivered = True
                if row.job.aborted is not None:  # its client still waits for the end of the answer
                    aborted.append((row.job, Update([], [], row.tracker.rest(), row.finish)))
        _deliver(aborted)
        keep = [i for i, r in enumerate(self.rows) if r.finish is None]
        if not _worth_dropping(self.rows, self._positions, bool(self._control or self._waiting)):
            return
        done = [r for r in self.rows if r.finish is not None]
        self.stats.requests_completed += len(done)
        for row in done:
            log.debug("done %s: %d+%d tokens, %s", row.job.req.rid, len(row.job.prompt), len(row.ids), row.finish)
        if keep:
            kv, self._mask = kvcache.select(kvcache.tensors(self._cache), self._mask, keep)
            self._cache = self.engine.cache_from(kv)
            index = torch.tensor(keep, device=self._positions.device)
            self._positions, self._next = self._positions[index], self._next[index]
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self._cache = None

    def _fail_all(self, admitted: list[Generation], message: str) -> None:
        finish = {"type": "abort", "message": message}
        seen = {id(r.job) for r in self.rows}
        extra = [j for j in admitted if id(j) not in seen]
        live = [r for r in self.rows if not r.delivered]
        for row in live:
            row.finish = row.finish or finish
        _deliver([(r.job, Update([], [], r.tracker.rest(), r.finish)) for r in live])
        _deliver([(j, Update([], [], "", finish)) for j in extra])
        self.rows, self._cache = [], None

    def _abort_all(self, message: str) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        self._fail_all(waiting, message)


def _updates(rows: list[Row]) -> tuple[list[tuple[Generation, Update]], list[Row]]:
    """This step's update of each row that has one (a stream's new tokens, or a final answer), and the rows whose
    final update it is."""
    out: list[tuple[Generation, Update]] = []
    ended: list[Row] = []
    for row in rows:
        if row.delivered or (row.finish is None and (not row.job.req.stream or row.sent == len(row.ids))):
            continue
        text = row.tracker.rest() if row.finish is not None else row.tracker.take()
        new = slice(row.sent, None)
        update = Update(row.ids[new], row.logprobs[new], text, row.finish, new_top_logprobs=row.top_logprobs[new])
        if row.sent == 0:
            update.input_logprobs, update.input_top_logprobs = row.input_logprobs, row.input_top_logprobs
        row.sent = len(row.ids)
        out.append((row.job, update))
        if row.finish is not None:
            ended.append(row)
    return out, ended


def _worth_dropping(rows: list[Row], positions: torch.Tensor, pending: bool) -> bool:
    """Whether the finished rows of a batch are to leave it now.

    Dropping rows copies every kept row's cache (about 70 ms for 63 rows of SmolLM2 at 50 tokens, half a decode
    step), while a finished row left in the batch costs about 1/64 of a step. So finished rows stay until a
    quarter of the batch has finished. They leave at once when every row has finished, when something is
    `pending` (a request waits for room, or work on the model waits: an adapter it used may be unloading), and
    when a finished row's position passes every live row's (it would widen the cache, and models whose position
    scaling follows the batch's largest position, or whose positions end at the context length, must never see it).
    """
    done = torch.tensor([r.finish is not None for r in rows], device=positions.device)
    finished = int(done.sum())
    if not finished:
        return False
    if finished == len(rows) or 4 * finished >= len(rows) or pending:
        return True
    return bool(positions[done].max() > positions[~done].max())


def _adapters(rows: list[Row]) -> list[str | None] | None:
    """Each row's LoRA adapter (None: base), or None when no row uses one."""
    names = [r.job.req.lora_path for r in rows]
    return names if any(names) else None


def _top_n(row: Row) -> int:
    """How many top logprobs the row wants per output token (0 unless return_logprob)."""
    return row.job.req.top_logprobs_num if row.job.req.return_logprob else 0


def _scored_from(row: Row) -> int | None:
    """The prompt index the request's prompt logprobs start at (SGLang's `logprob_start_len`, at most the prompt's
    last); None: it asks none."""
    req = row.job.req
    if not req.return_logprob or req.logprob_start_len < 0:
        return None
    return min(req.logprob_start_len, len(row.job.prompt) - 1)


def _kept(row: Row) -> int:
    """The prefill's last columns whose logits the row needs: one per prompt token it scores, and the last."""
    start = _scored_from(row)
    return 1 if start is None else len(row.job.prompt) - start


def _deliver(updates: list[tuple[Generation, Update]]) -> None:
    """Push updates into their jobs' asyncio queues, one thread-safe call per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Generation, Update]]] = {}
    for job, update in updates:
        by_loop.setdefault(job.loop, []).append((job, update))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[Generation, Update]]) -> None:
    for job, update in items:
        job.queue.put_nowait(update)
