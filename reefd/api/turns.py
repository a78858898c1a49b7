"""One agent turn, protocol-independent: the scenario a request names → engine → record (durable) → answer.

The provider modules supply a `Wire` that formats bodies and stream events; this module
owns the order that makes receipts trustworthy: an answer, or a stream's terminal event,
leaves only after its record is fsynced.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from aiohttp import web

from reefd import loop
from reefd.api import access
from reefd.api.errors import SCENARIO_HEADER, ApiError, from_domain, json_response
from reefd.commit import trials as canary
from reefd.engines import EngineError, EngineUnavailable, Prompt
from reefd.loop import CONVERSATIONS, REGISTRY
from reefd.observe.conversations import Conversations, Placement
from reefd.observe.receipts import new_receipt
from reefd.observe.records import RecordStore, StorageError
from reefd.ops.metrics import Metrics
from reefd.serve.chat import ChatRequest, Completion, add_system_text
from reefd.serve.scenarios import Binding, Route, Scenario, Trial
from reefd.serve.turn_record import asked, finish_record, served_by

log = logging.getLogger("reefd.api")
T = TypeVar("T")

RECEIPT_HEADER = "x-reef-agent-record-id"
RELEASE_HEADER = "x-reef-release-id"
TURN_HEADER = "x-reef-turn"  # "side": a call that is not a turn of the conversation (never judged or trained)


class Wire(Protocol):
    """A provider's formatting of one answer (built per request, knows ids and model name)."""

    api: str

    def response(self, c: Completion) -> dict[str, Any]: ...

    def stream_head(self, prompt_tokens: int) -> bytes: ...

    def stream_delta(self, text: str) -> bytes: ...

    def stream_tail(self, c: Completion) -> bytes: ...

    def stream_terminal(self) -> bytes: ...

    def stream_error(self, err: ApiError) -> bytes: ...


FAILURES = (EngineUnavailable, EngineError, StorageError)


def engine_failure(exc: EngineUnavailable | EngineError | StorageError) -> ApiError:
    """The status a caller gets when the engine or the record store cannot serve the turn."""
    err = from_domain(exc)
    assert err is not None
    return err


def scenario_of(request: web.Request, body: dict[str, Any] | None = None,
                messages: Callable[[], list[dict[str, Any]]] | None = None) -> Scenario:
    """The scenario a request names: by path (/scenarios/NAME/...), else by the x-reef-scenario header; else, for
    an agent turn (`body`, and its chat `messages`), the scenario of the session it continues (by its session
    header, or a transcript extending a served turn), so an agent need name the scenario on its first call only."""
    name = request.match_info.get("scenario") or request.headers.get(SCENARIO_HEADER)
    if not name and body is not None:
        found = request.app[CONVERSATIONS].scenario_of(session_of(request, body), messages() if messages else [],
                                                       access.caller(request))
        name = found if found is not None and access.covers(request, found) else None
    if not name:
        known = access.visible(request, request.app[REGISTRY].scenarios)
        raise ApiError(400, f"missing the {SCENARIO_HEADER} header: it names the scenario that serves this "
                       f"request (known: {', '.join(known)}); a later call of the same session may leave it out",
                       param=SCENARIO_HEADER, code="scenario_missing")
    return access.scenario(request, name.strip())


SESSION_HEADERS = ("x-reef-session",  # Reef's own, then what agents send of themselves:
                   "x-claude-code-session-id", "session_id", "session-id", "x-session-id")


def session_of(request: web.Request, body: dict[str, Any]) -> str | None:
    """The conversation a turn belongs to: a session header, else Anthropic's metadata.user_id."""
    for name in SESSION_HEADERS:
        if request.headers.get(name):
            return request.headers[name]
    user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    return user if isinstance(user, str) and user else None


def new_record(request: web.Request, scenario: Scenario, binding: Binding, receipt: str, api: str,
               body: dict[str, Any], chat: ChatRequest, stream: bool, placement: Placement,
               who: tuple[str, str | None]) -> dict[str, Any]:
    """`who`: the session's owner, and the user the turn is made for (None: nobody's)."""
    prefix = "x-reef-tag-"
    tags = {k[len(prefix):].lower(): v for k, v in request.headers.items() if k.lower().startswith(prefix)}
    owner, user = who
    return {**served_by(scenario, binding, receipt), "api": api, "requested_model": body.get("model"),
            "created_at": time.time(), **placement.fields(), "owner": owner, **({"user": user} if user else {}),
            "tags": tags, "stream": stream, "request": body, **asked(chat)}


class Served:
    """Stores a turn's record, and tells the conversations: the turn is open, and the one it continues is linked."""

    def __init__(self, conversations: Conversations, store: RecordStore, record: dict[str, Any],
                 placement: Placement, metrics: Metrics | None = None) -> None:
        self.conversations, self.store, self.record, self.placement = conversations, store, record, placement
        self.metrics = metrics

    async def put_failed(self, err: Any, delivered: str, started: float) -> None:
        """A stream that failed after its receipt was sent: its record says what happened and what the client got
        (no token ids, so no recipe trains on it; the conversation does not move on from it)."""
        self.record.update({"messages": [*self.record["messages"], {"role": "assistant", "content": delivered}],
                            "finish_reason": "error", "latency_s": round(time.monotonic() - started, 6),
                            "error": {"status": err.status, "code": err.code, "message": err.message}})
        await self.store.put_record(self.record, link=False)

    async def put(self) -> None:
        record, placement = self.record, self.placement
        linked = await self.store.put_record(record, next_state=placement.next_state)
        if self.metrics is not None:
            self.metrics.turn(record["scenario"], record["api"], record)
        scenario = record["scenario"]
        reply = record["conversation"]["reply"]  # new_record's placement fields, the hash from finish_record
        self.conversations.served(scenario, record["id"], placement, reply, release=record["release"],
                                  owner=record["owner"])
        if linked and placement.previous is not None:
            self.conversations.linked(scenario, placement.previous)


async def serve_turn(request: web.Request, scenario: Scenario, store: RecordStore, wire_for: Callable[[str], Wire],
                     body: dict[str, Any], chat: ChatRequest, stream: bool) -> web.StreamResponse:
    """Serve one turn: place it in its session, wait for a turn at the engine, and answer with the release that
    serves it (the scenario's, or its canary's for the sessions on the canary's side: see Registry.serving)."""
    receipt = new_receipt()
    registry = request.app[REGISTRY]
    user = access.user(request, scenario)
    users = scenario.cfg.users
    async with registry.users.turn(scenario.name, user, users) if user is not None and users is not None \
            else contextlib.nullcontext():  # a new user is kept durably before their first answer
        return await _serve_placed(request, scenario, store, wire_for, body, chat, stream, receipt, user)


async def _serve_placed(request: web.Request, scenario: Scenario, store: RecordStore,
                        wire_for: Callable[[str], Wire], body: dict[str, Any], chat: ChatRequest, stream: bool,
                        receipt: str, user: str | None) -> web.StreamResponse:
    registry = request.app[REGISTRY]
    who = (access.owner(request, user), user)
    placement = request.app[CONVERSATIONS].place(scenario.name, receipt, session_of(request, body), chat.messages,
                                                 chat.tools, side=request.headers.get(TURN_HEADER) == "side",
                                                 owner=who[0])
    trial = scenario.trial
    shadow = None  # the request as it came, for a copy to the release on shadow trial
    if trial is not None and trial.mode == "shadow" and trial.takes(placement.session, None):
        shadow = copy.deepcopy(chat)
    async with request.app[loop.RECONCILER].users.holding(scenario, user) as own, \
            registry.serving(scenario, left=client_left(request), route=Route(placement.session, placement.sticky),
                             own=own) as binding:
        response, record = await _serve_bound(request, scenario, binding, store, wire_for, receipt,
                                              (placement, who), body, chat, stream)
        personal = own is not None  # a user's own release answered: no shared trial's copy
    live = registry.scenarios.get(scenario.name)
    if shadow is not None and not personal and trial is not None and live is not None and live.trial is trial and \
            "response" in record and request.app[loop.TRIALS].take_shadow_slot(scenario.name):
        # the trial still runs: its adapter is held from here (synchronously) until the copy is answered
        hold = registry.hold(scenario.engine, trial.binding.adapter)
        request.app[loop.TRIALS].spawn(_shadow(request.app, scenario, trial, shadow, record, wire_for, hold),
                                       f"shadow-{receipt}")
    return response


def sampling(scenario: Scenario, binding: Binding, chat: ChatRequest) -> None:
    """Fill what the request left unset: the release's harness config.yaml first, then the scenario's defaults."""
    serve = scenario.cfg.serve
    chat.top_logprobs = scenario.capture_top_k
    harness = binding.harness.sampling() if binding.harness is not None else {}
    if chat.temperature is None:
        chat.temperature = harness.get("temperature", serve.temperature)
    if chat.top_p is None:
        chat.top_p = harness.get("top_p", serve.top_p)
    cap = scenario.cfg.model.max_new_tokens  # whatever the client asked for (Claude Code: 32000)
    if cap is not None:
        chat.max_tokens = min(chat.max_tokens, cap)


async def _serve_bound(request: web.Request, scenario: Scenario, binding: Binding, store: RecordStore,
                       wire_for: Callable[[str], Wire], receipt: str,
                       placed: tuple[Placement, tuple[str, str | None]], body: dict[str, Any],
                       chat: ChatRequest, stream: bool) -> tuple[web.StreamResponse, dict[str, Any]]:
    """Serve one turn with the release `binding` names (taken when the request started); returns the answer and
    the turn's record (complete when it has a `response`). `placed`: its session's place, and its owner and user."""
    placement, who = placed
    sampling(scenario, binding, chat)
    wire = wire_for(receipt)
    chat.routing_key = placement.session
    if binding.harness is not None and scenario.cfg.harness.inject:
        add_system_text(chat, scenario.harness_text(binding.harness))
    record = new_record(request, scenario, binding, receipt, wire.api, body, chat, stream, placement, who)
    turn = Served(request.app[CONVERSATIONS], store, record, placement, loop.of(request.app))
    headers = {RECEIPT_HEADER: record["id"], RELEASE_HEADER: binding.release}
    started = time.monotonic()
    # an engine that swaps weights answers on the binding's weights only (a swap may be rolling across replicas)
    on_weights = {"weights": binding.weights_version} if scenario.weight_swap is not None else {}
    events = scenario.engine.generate(chat, stream=stream, timeout_s=scenario.cfg.serve.request_timeout_s,
                                      adapter=binding.adapter, **on_weights)
    if stream:
        first = await _first(events)  # engine refusals become proper statuses, not broken streams
        return await _stream(request, turn, wire, record, headers, first, events, started), record
    try:
        completion = await _unless_client_leaves(request, _whole(events))
        if completion is None:
            log.info("client went away before its answer %s: the engine request is cancelled, nothing recorded",
                     record["id"])
            return web.Response(status=CLIENT_CLOSED, reason="Client Closed Request"), record
        answer = wire.response(completion)
        finish_record(record, completion, answer, started, None)
        await turn.put()
    except FAILURES as exc:
        raise engine_failure(exc) from exc
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    return json_response(answer, headers=headers), record


async def _shadow(app: web.Application, scenario: Scenario, trial: Trial, chat: ChatRequest, served: dict[str, Any],
                  wire_for: Callable[[str], Wire], hold: Callable[[], None]) -> None:
    """A copy of a served turn, answered by the release on shadow trial: recorded as a shadow record (never
    returned, never trained on), and both answers scored by the scenario's scorer for the trial."""
    trials = app[loop.TRIALS]
    try:
        binding = trial.binding
        sampling(scenario, binding, chat)
        chat.routing_key = served.get("session")
        if binding.harness is not None and scenario.cfg.harness.inject:
            add_system_text(chat, scenario.harness_text(binding.harness))
        receipt = new_receipt()
        record: dict[str, Any] = {
            **served_by(scenario, binding, receipt), "api": served.get("api"),
            "requested_model": served.get("requested_model"), "created_at": time.time(),
            "session": served.get("session"), "turn": None, "turn_kind": "shadow", "previous": None,
            "tags": served.get("tags") or {}, "stream": False, "request": served.get("request"), **asked(chat)}
        on_weights = {"weights": binding.weights_version} if scenario.weight_swap is not None else {}
        started = time.monotonic()
        events = scenario.engine.generate(chat, stream=False, timeout_s=scenario.cfg.serve.request_timeout_s,
                                          adapter=binding.adapter, **on_weights)
        try:
            completion = await _whole(events)
        finally:
            await events.aclose()  # type: ignore[attr-defined]
            hold()
        finish_record(record, completion, wire_for(receipt).response(completion), started, None)
        record.pop("conversation", None)
        score = canary.scorer(scenario.cfg.release.shadow)
        served_score, shadow_score = await asyncio.to_thread(lambda: (float(score(served)), float(score(record))))
        record["shadow"] = {"of": served["id"], "score": shadow_score, "served_score": served_score}
        await app[loop.RECORDS].put_record(record, link=False)
        trials.shadowed(scenario.name, binding.release, receipt, served_score, shadow_score)
    except (ApiError, *FAILURES) as exc:
        log.warning("%s: the shadow copy of %s failed: %s", scenario.name, served.get("id"), exc)
    except Exception:  # the scorer is the operator's code
        log.exception("%s: the shadow copy of %s failed", scenario.name, served.get("id"))
    finally:
        hold()
        trials.free_shadow_slot(scenario.name)


CLIENT_CLOSED = 499  # nginx's status for a request whose client closed the connection first
DISCONNECT_POLL_S = 0.25


def client_left(request: web.Request) -> Callable[[], bool]:
    """Whether the request's client has closed its connection (checked while it waits in the engine's line)."""
    return lambda: request.transport is None or request.transport.is_closing()


async def _unless_client_leaves(request: web.Request, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result; or None, with `work` cancelled, once the client has closed its connection.

    aiohttp keeps running a handler whose client left (cancelling any handler could cut a write in half), so a
    long generation watches its own connection: its batch slot goes back as soon as nobody waits for it. A timer
    looks every DISCONNECT_POLL_S and cancels this task only while it awaits `work` (no task, no wait set per
    turn: this runs on every non-streamed turn).
    """
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    left, handle = False, None

    def look() -> None:
        nonlocal handle, left
        transport = request.transport
        if transport is None or transport.is_closing():
            left = True
            task.cancel()
        else:
            handle = loop.call_later(DISCONNECT_POLL_S, look)

    handle = loop.call_later(DISCONNECT_POLL_S, look)
    try:
        return await work
    except asyncio.CancelledError:
        if not left:  # reefd stopping, not the client leaving
            raise
        task.uncancel()
        return None
    except (*FAILURES, ApiError):
        if left:  # what the cancelled engine request raised on its way out
            task.uncancel()
            return None
        raise
    finally:
        if handle is not None:
            handle.cancel()


async def _first(events: AsyncIterator[Any]) -> Any:
    try:
        return await anext(events)
    except StopAsyncIteration:
        raise ApiError(502, "the engine ended without a completion") from None
    except FAILURES as exc:
        raise engine_failure(exc) from exc


async def _whole(events: AsyncIterator[Any]) -> Completion:
    first = await _first(events)
    if isinstance(first, Completion):
        return first
    async for event in events:
        if isinstance(event, Completion):
            return event
    raise ApiError(502, "the engine ended without a completion")


async def _stream(request: web.Request, turn: Served, wire: Wire, record: dict[str, Any], headers: dict[str, str],
                  first: Any, events: AsyncIterator[Any], started: float) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    ttft: float | None = None
    delivered: list[str] = []
    try:
        await resp.write(wire.stream_head(first.tokens if isinstance(first, Prompt) else 0))
        completion = first if isinstance(first, Completion) else None
        if isinstance(first, str):
            ttft = time.monotonic()
            await resp.write(wire.stream_delta(first))
            delivered.append(first)
        async for event in events:
            if isinstance(event, Completion):
                completion = event
            elif isinstance(event, str):
                ttft = ttft or time.monotonic()
                await resp.write(wire.stream_delta(event))
                delivered.append(event)
        if completion is None:
            raise ApiError(502, "the engine ended without a completion")
        await resp.write(wire.stream_tail(completion))
        answer = wire.response(completion)
        finish_record(record, completion, answer, started, ttft)
        await turn.put()  # durable before the terminal event, always
        await resp.write(wire.stream_terminal())
    except ConnectionError:
        log.info("client went away during stream %s", record["id"])
        return resp
    except Exception as exc:  # past the headers, every failure must end the stream in-band
        if isinstance(exc, ApiError):
            err = exc
        elif isinstance(exc, FAILURES):
            err = engine_failure(exc)
        else:
            log.exception("stream %s failed", record["id"])
            err = ApiError(500, "internal server error")
        log.warning("stream %s failed: %s", record["id"], err.message)
        if "response" not in record:  # the client has this receipt: its record says what happened
            try:
                await turn.put_failed(err, "".join(delivered), started)
            except Exception as put_exc:  # the store is failing too: the stream still ends in-band
                log.error("stream %s: its failure could not be recorded: %s", record["id"], put_exc)
        with contextlib.suppress(ConnectionError):
            await resp.write(wire.stream_error(err))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    with contextlib.suppress(ConnectionError):
        await resp.write_eof()
    return resp
