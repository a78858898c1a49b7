"""`GET /openapi.json`: the OpenAPI 3.1 document of reefd's HTTP API, with each route's statuses and error shape.

Request bodies are the JSON Schemas the handlers validate with (api/openai.py, anthropic.py, responses.py,
reports.py); the served scenarios are the values of `x-reef-scenario` and of the `{scenario}`/`{name}` path
parameters. Knows no handler logic: a route's behaviour lives in its handler, its description here.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from reefd import __version__
from reefd.api import access, admin, releases, search, tinker_routes
from reefd.api.access import USER_HEADER
from reefd.api.errors import SCENARIO_HEADER, json_response
from reefd.api.openapi_schemas import ID, OBJ, SCHEMAS, STR, ref
from reefd.api.turns import RECEIPT_HEADER, RELEASE_HEADER, SESSION_HEADERS, TURN_HEADER
from reefd.harness.installer import ADAPTERS
from reefd.loop import REGISTRY
from reefd.observe.records import PRACTICE_FILTERS
from reefd.ops.auth import ANY, ROUTE_SCOPES

JSON = "application/json"
SSE = "text/event-stream"
ANTHROPIC = "anthropic"  # the error shape of /v1/messages*; every other route answers in OpenAI's


# What each error status means, for the document's readers (the answer's message says what happened).
_ERRORS = {
    400: "Malformed JSON, a wrong type or value (`param` names the field path), or no scenario named",
    401: "Missing or wrong token",
    403: "The token lacks the route's scope, may not use the scenario it names, or speaks for another user; or "
         "the scenario already has its users.max users",
    404: "Unknown scenario, receipt, release, job or response",
    405: "Method not allowed",
    409: "A conflict: a stale `expected_head`, a pinned scenario, a reused `report_id`, a job that has ended",
    410: "The Tinker session has ended (no heartbeat for a while, or it was finished)",
    413: "The body is too large",
    415: "The body's media type is not accepted",
    426: "Responses over WebSocket are not served",
    429: "The engine's line is full; retry after `Retry-After` seconds (the Tinker API: a bound on sessions or "
         "models, not to be retried: `x-should-retry: false`)",
    501: "Not installed (prometheus_client; protobuf and numpy for the Tinker API)",
    502: "The engine failed the request (the Tinker API: it could not load a checkpoint)",
    503: "The engine is starting or busy, or records cannot be made durable; retry after `Retry-After` seconds",
}
_RETRY = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": STR}}
_ALLOW = {"Allow": {"description": "The methods the path serves.", "required": True, "schema": STR}}
_RECEIPT_HEADERS = {
    RECEIPT_HEADER: {"description": "The record's receipt, for `POST /reef/report`.", "required": True,
                     "schema": {"type": "string", "minLength": 1}},
    RELEASE_HEADER: {"description": "The release that served the request.", "required": True,
                     "schema": {"type": "string", "minLength": 1}},
}


def _error_name(status: int, shape: str) -> str:
    return f"{'Anthropic' if shape == ANTHROPIC else 'OpenAI'}{status}"


def _errors() -> dict[str, Any]:
    """Every error answer, in both shapes (components/responses)."""
    out: dict[str, Any] = {}
    for status, description in _ERRORS.items():
        for shape, schema in ((ANTHROPIC, "AnthropicError"), ("openai", "OpenAIError")):
            answer: dict[str, Any] = {"description": description, "content": _content(schema)}
            if status in (405, 429, 503):
                answer["headers"] = _ALLOW if status == 405 else _RETRY
            out[_error_name(status, shape)] = answer
    return out


def _content(schema: str | dict[str, Any], media: str = JSON) -> dict[str, Any]:
    return {media: {"schema": ref(schema) if isinstance(schema, str) else schema}}


def _body(schema: str, **examples: dict[str, Any]) -> dict[str, Any]:
    """A JSON request body of the components' `schema`, with named examples."""
    return {JSON: {"schema": ref(schema), "examples": {name: {"value": value} for name, value in examples.items()}}}


def _op(op_id: str, summary: str, tag: str, ok: dict[str | int, dict[str, Any]], errors: tuple[int, ...] = (),
        *, params: tuple[dict[str, Any], ...] = (), body: dict[str, Any] | None = None, shape: str = "openai",
        open_route: bool = False) -> dict[str, Any]:
    """One operation: its successful answers (`ok`), its error statuses (in `shape`), parameters and body."""
    answers: dict[str, Any] = {str(status): answer for status, answer in ok.items()}
    for status in (*(() if open_route else (401, 403)), *errors):
        answers[str(status)] = {"$ref": f"#/components/responses/{_error_name(status, shape)}"}
    op: dict[str, Any] = {"operationId": op_id, "summary": summary, "tags": [tag], "responses": answers}
    if params:
        op["parameters"] = list(params)
    if body is not None:
        op["requestBody"] = {"required": True, "content": body}
    if open_route:
        op["security"] = []
    return op


def _param(name: str, where: str, schema: dict[str, Any], description: str, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": where, "required": required or where == "path", "description": description,
            "schema": schema}


def _scenario_schema(names: list[str]) -> dict[str, Any]:
    return {"type": "string", **({"enum": names} if names else {})}


def _agent_ops(names: list[str], by_path: bool) -> dict[str, dict[str, Any]]:
    """The agent APIs, the scenario named by the x-reef-scenario header or (`by_path`) by the path."""
    about = "The scenario that serves the request."
    scenario = (_param("scenario", "path", _scenario_schema(names), about) if by_path
                else _param(SCENARIO_HEADER, "header", _scenario_schema(names), about + " A later call of a "
                            "session may leave it out: it goes to the scenario of the session it continues (its "
                            "session header, its transcript, or previous_response_id); one that continues none "
                            "is a 400."))
    named = {f"{scenario['in']}.{scenario['name']}": f"$request.{scenario['in']}.{scenario['name']}"}
    session = _param(SESSION_HEADERS[0], "header", STR, "The conversation this turn belongs to.")
    turn = _param(TURN_HEADER, "header", {"enum": ["side"]}, "`side`: a call that is not a turn of the "
                  "conversation (never judged or trained on).")
    user = _param(USER_HEADER, "header", STR, "The user this turn is for, on a scenario with a users: block (a "
                  "user's token makes it that user's without it).")
    suffix = "ByPath" if by_path else ""
    served = (400, 404, 413, 429, 503)
    model = names[0] if names else "default"  # any name is taken: the scenario decides what serves
    say = [{"role": "user", "content": "Say hello."}]
    chat = {"model": model, "messages": say, "max_tokens": 16}
    message = {"model": model, "max_tokens": 16, "messages": say}
    response = {"model": model, "input": "Say hello.", "max_output_tokens": 16}
    receipt = f"$response.header.{RECEIPT_HEADER}"
    follow = {"record": {"operationId": "getRecord", "parameters": {"path.receipt": receipt}},
              "report": {"operationId": "report",
                         "parameters": {f"header.{SCENARIO_HEADER}": f"$request.{scenario['in']}.{scenario['name']}"},
                         "requestBody": {"references": [receipt], "score": 1.0}}}
    retrieve = {"operationId": "getResponse" + suffix,
                "parameters": {**named, "path.response_id": "$response.body#/id"}}

    def answered(schema: str, **links: dict[str, Any]) -> dict[str | int, dict[str, Any]]:
        return {200: {"description": "The answer (an event stream with `stream: true`), sent once its record is "
                      "durable.", "headers": _RECEIPT_HEADERS, "links": {**follow, **links},
                      "content": {**_content(schema), SSE: {"schema": ref(schema + "Event")}}}}

    return {
        "/v1/chat/completions": {"post": _op(
            "createChatCompletion" + suffix, "OpenAI Chat Completions", "agent", answered("ChatCompletion"), served,
            params=(scenario, session, turn, user), body=_body(
                "ChatCompletionRequest", answer=chat,
                stream={**chat, "stream": True, "stream_options": {"include_usage": True}}))},
        "/v1/messages": {"post": _op(
            "createMessage" + suffix, "Anthropic Messages", "agent", answered("Message"), served,
            params=(scenario, session, turn, user), shape=ANTHROPIC,
            body=_body("MessagesRequest", answer=message, stream={**message, "stream": True}))},
        "/v1/messages/count_tokens": {"post": _op(
            "countTokens" + suffix, "Anthropic token counting, with the scenario's tokenizer and template", "agent",
            {200: {"description": "The prompt's length in tokens.", "content": _content("TokenCount")}},
            (400, 404, 413, 503), params=(scenario,), shape=ANTHROPIC,
            body=_body("CountTokensRequest", count={"model": model, "messages": say}))},
        "/v1/responses": {
            "post": _op("createResponse" + suffix, "OpenAI Responses", "agent",
                        answered("Response", retrieve=retrieve), served, params=(scenario, session, turn, user),
                        body=_body("ResponseRequest", answer=response, stream={**response, "stream": True})),
            "get": _op("refuseResponsesGet" + suffix, "Not served: 426 to a WebSocket upgrade, else 405", "agent",
                       {}, (405, 426), params=(scenario,) if by_path else ())},
        "/v1/responses/{response_id}": {"get": _op(
            "getResponse" + suffix, "A stored response, read back from its record", "agent",
            {200: {"description": "The response as it was answered.", "content": _content("Response")}},
            (400, 404), params=(scenario, _param("response_id", "path", STR, "`resp_<receipt>`")))},
    }


def _name_param(names: list[str]) -> dict[str, Any]:
    return _param("name", "path", _scenario_schema(names), "The scenario.")


def _ok(schema: str, description: str, status: int = 200, links: dict[str, Any] | None = None
        ) -> dict[str | int, dict[str, Any]]:
    return {status: {"description": description, "content": _content(schema), **({"links": links} if links else {})}}


def _text(media: str, description: str) -> dict[str | int, dict[str, Any]]:
    return {200: {"description": description, "content": _content(STR, media)}}


def _reef_ops(names: list[str]) -> dict[str, dict[str, Any]]:
    """The report route and the operator's API (records, releases, jobs, attempts, harness, health)."""
    name = _name_param(names)
    practice = _param("practice", "query", {"enum": list(PRACTICE_FILTERS)},
                      "reefd's practice records: include them (the default), exclude them, or only them.")
    by_user = _param("user", "query", STR, "Only this user's records (a user's token reads its own user's only).")
    line = _param("user", "query", STR, "A user's release line (a scenario with a users: block).")
    header = _param(SCENARIO_HEADER, "header", _scenario_schema(names), "The scenario.")
    by_query = _param("scenario", "query", _scenario_schema(names), "The scenario (or the x-reef-scenario header; "
                      "default: the only scenario with a harness).")
    release_q = _param("release", "query", STR, "A release id (default: the serving release).")
    harness_errors = (400, 404, 503)
    job = {verb: {"operationId": op, "parameters": {"path.job": "$response.body#/id"}}
           for verb, op in (("get", "getJob"), ("cancel", "cancelJob"))}
    return {
        "/v1/models": {"get": _op("listModels", "The served scenarios (Anthropic's shape with anthropic-version)",
                                  "agent", _ok("Models", "The scenarios, as models."),
                                  params=(_param("anthropic-version", "header", STR, "Answer in Anthropic's shape."),
                                          ))},
        "/reef/report": {"post": _op(
            "report", "Feedback on receipts, idempotent by report_id", "observe", _ok("Report", "The stored report."),
            (400, 404, 409, 413, 503),
            params=(_param(SCENARIO_HEADER, "header", _scenario_schema(names), "The scenario; without it, the "
                           "scenario of the first referenced record."),),
            body=_body("ReportRequest", report={
                "references": ["01JD3Q8C7RZ5W6N0M4X2Y9A1BC"], "score": 1.0, "feedback": "Correct."}))},
        "/reef/records/{receipt}": {"get": _op(
            "getRecord", "One record, with its reports", "observe", _ok("Record", "The record."), (404,),
            params=(_param("receipt", "path", STR, "The receipt."),))},
        "/reef/scenarios/{name}/records": {"get": _op(
            "listRecords", "A scenario's records in receipt order", "observe", _ok("Records", "A page of records."),
            (400, 404), params=(name, _param("limit", "query", {"type": "integer", "minimum": 1,
                                                                 "maximum": admin.MAX_LIMIT}, "Page size."),
                                _param("after", "query", {"type": "string", "maxLength": 64}, "The last receipt seen."),
                                _param("session", "query", STR, "Only this conversation's turns."), practice,
                                by_user))},
        "/reef/scenarios/{name}/export": {"get": _op(
            "export", "A scenario's records, each with its reports, as JSON lines in receipt order", "observe",
            _text("application/x-ndjson", "One record a line."), (400, 404),
            params=(name, _param("since", "query", {"type": "string", "maxLength": 64}, "A receipt, a release id, a "
                                 "duration (90s, 30m, 24h, 7d) or an RFC 3339 time: the records after it."),
                    _param("reported_only", "query", {"enum": ["true", "false", "1", "0", "yes", "no"]},
                           "Only the records that have reports."), practice, by_user))},
        "/reef/status": {"get": _op("status", "Scenarios, engines, releases and counts", "observe",
                                    _ok("Status", "The daemon's status."))},
        "/reef/scenarios/{name}/users": {"get": _op(
            "listUsers", "A per-user scenario's users: what serves each, their records and reports", "observe",
            _ok("Users", "The users (a user's token: its own)."), (400, 404), params=(name,))},
        "/reef/scenarios/{name}/users/{user}": {"delete": _op(
            "deleteUser", "Delete every byte of a user's: records, reports, sessions, release line, adapters",
            "observe",
            _ok("UserDeleted", "What was removed, and the shared releases that learned from the user's records."),
            (400, 404, 409), params=(name, _param("user", "path", STR, "The user."))),
            "patch": _op(
            "patchUser", "Set what a user consents to: {\"share\": true} lets promotions learn from what their "
            "releases learned", "observe", _ok("User", "The user's consent as now kept."), (400, 403, 404),
            params=(name, _param("user", "path", STR, "The user.")), body=_body("UserPatch", share={"share": True}))},
        "/reef/scenarios/{name}/releases": {
            "get": _op("listReleases", "The release chain, newest first", "commit", _ok("Releases", "The chain."),
                       (400, 404), params=(name, _param("all", "query", {"enum": ["1", "true", "yes"]},
                                                        "Add the rejected candidates."), line)),
            "post": _op("publish", "Publish a LoRA adapter or full weights: a tar of the folder", "commit",
                        _ok("Published", "The new release, serving.", 201), (400, 404, 409, 413, 415, 503),
                        params=(name, _param("kind", "query", {"enum": list(releases.PUBLISH_KINDS)}, "What the tar "
                                             "holds (default: adapter)."),
                                _param("expected_head", "query", STR, "Refuse (409) unless this is the head."),
                                _param("summary", "query", STR, "A line for the release's history."), line),
                        body={m: {"schema": {"type": "string", "format": "binary"}}
                              for m in ("application/x-tar", "application/gzip")})},
        "/reef/scenarios/{name}/rollback": {"post": _op(
            "rollback", "Append a copy of an earlier release (default: the head's parent)", "commit",
            _ok("Copied", "The new release (none on a dry run)."), (400, 404, 409, 413, 503), params=(name,),
            body=_body("RollbackRequest", parent={"dry_run": True}))},
        "/reef/scenarios/{name}/promote": {"post": _op(
            "promote", "Append a copy of a release or of a rejected candidate", "commit",
            _ok("Copied", "The new release (none on a dry run)."), (400, 404, 409, 413, 503), params=(name,),
            body=_body("PromoteRequest", release={"release": "r1-1a2b3c4", "dry_run": True}))},
        "/reef/releases/{release}": {"get": _op(
            "getRelease", "One release and its files", "commit", _ok("ReleaseFiles", "The release."), (400, 404),
            params=(_param("release", "path", STR, "The release id."),))},
        "/reef/releases/{release}/lineage": {"get": _op(
            "getLineage", "What a release learned from, and its ancestors'", "commit",
            _ok("Lineage", "The release, then its parents up to depth."), (400, 404),
            params=(_param("release", "path", STR, "The release id."),
                    _param("depth", "query", {"type": "string", "pattern": "^(all|[0-9]+)$"},
                           "How many releases, from this one back (default 1; all: to the base)."),))},
        "/reef/diff": {"get": _op(
            "diff", "What changed from release a to release b", "commit", _ok("Diff", "The differences."),
            (400, 404), params=(_param("a", "query", ID, "A release id.", required=True),
                                _param("b", "query", ID, "A release id.", required=True)))},
        "/reef/scenarios/{name}/train": {"post": _op(
            "train", "Queue a Grow job now (202), or get the one queued or running (200)", "grow",
            {**_ok("Job", "The job already queued or running.", links=job), **_ok("Job", "The job queued.", 202,
                                                                                       links=job)},
            (400, 404, 409), params=(name,), body=_body("TrainRequest", parent={}))},
        "/reef/scenarios/{name}/attempts/next": {"post": _op(
            "nextAttempt", "A search scenario's open step (200), or why to wait (202)", "grow",
            {**_ok("Step", "The step to attempt."), 202: {"description": "Not yet: retry after Retry-After.",
                                                           "headers": _RETRY, "content": _content("Wait")}},
            (400, 404), params=(name, _param("wait", "query", {"type": "number", "minimum": 0,
                                                               "maximum": search.MAX_WAIT_S},
                                             "Seconds to wait for a plan.")))},
        "/reef/scenarios/{name}/archive": {"get": _op(
            "archive", "A search scenario's archive and best-so-far curve", "grow", _ok("Archive", "The archive."),
            (400, 404), params=(name, _param("top", "query", {"type": "integer", "minimum": 1, "maximum": 1000},
                                             "How many of the best states.")))},
        "/reef/jobs": {"get": _op("listJobs", "Jobs, newest first", "grow", _ok("Jobs", "The jobs."), (404,),
                                  params=(_param("scenario", "query", _scenario_schema(names), "Only this "
                                                 "scenario's."),))},
        "/reef/jobs/{job}": {"get": _op("getJob", "One job", "grow", _ok("Job", "The job."), (404,),
                                        params=(_param("job", "path", STR, "The job id."),))},
        "/reef/jobs/{job}/cancel": {"post": _op(
            "cancelJob", "Stop a queued or running job (409 once it ended or is publishing)", "grow",
            _ok("Job", "The cancelled job."), (404, 409), params=(_param("job", "path", STR, "The job id."),))},
        "/reef/harness": {"get": _op(
            "getHarness", "The harness files of a release", "harness", _ok("Harness", "The harness."),
            harness_errors, params=(header, by_query, release_q))},
        "/reef/harness/releases": {"get": _op(
            "harnessReleases", "The releases that changed the harness, newest first", "harness",
            _ok("HarnessReleases", "The harness versions."), (400, 404), params=(header, by_query))},
        "/reef/harness/install": {"get": _op(
            "installHarness", "A POSIX sh installer for a coding agent, with the harness inline", "harness",
            _text("text/x-shellscript", "The installer script."), harness_errors,
            params=(_param("adapter", "query", {"enum": list(ADAPTERS)}, "The agent.", required=True), header,
                    by_query, release_q))},
        "/healthz": {"get": _op("healthz", "Liveness", "health", _ok("Health", "Alive."), open_route=True)},
        "/": {"get": _op("root", "Liveness (agents probe HEAD /)", "health", _ok("Health", "Alive."),
                         open_route=True)},
        "/readyz": {"get": _op(
            "readyz", "Whether every scenario's engine generates (with the token: each engine's state)", "health",
            {200: {"description": "Ready.", "content": _content("Ready")},
             503: {"description": "Not ready.", "content": _content("Ready")}}, open_route=True)},
        "/metrics": {"get": _op("metrics", "Prometheus metrics", "health",
                                _text("text/plain", "The exposition."), (501,))},
        "/openapi.json": {"get": _op("openapi", "This document", "health",
                                     {200: {"description": "OpenAPI 3.1.", "content": _content(OBJ)}})},
    }


def _tinker_ops() -> dict[str, dict[str, Any]]:
    """The Tinker API's operations, from its route table (api/tinker_routes.py)."""
    out: dict[str, dict[str, Any]] = {}
    for r in tinker_routes.ROUTES:
        ok: dict[str, Any] = {JSON: {"schema": r.answer}}
        if r.protobuf_answer:
            ok[tinker_routes.PROTOBUF] = {"schema": {"type": "string", "format": "binary"}}
        body = {tinker_routes.PROTOBUF: {"schema": {"type": "string", "format": "binary"}}} if r.protobuf_body \
            else None if r.body is None else {JSON: {"schema": r.body}}
        params = tuple(_param(name, "path", STR, f"The {name.replace('_', ' ')}.")
                       for name in re.findall(r"{(\w+)}", r.path))
        out.setdefault(r.path, {})[r.method.lower()] = _op(r.op_id, r.summary, "tinker", {
            200: {"description": r.summary, "content": ok}}, r.errors, body=body, params=params)
    return out


def document(names: list[str], routes: set[tuple[str, str]] | dict[tuple[str, str], str]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the `routes` ((method, path) pairs, as the router spells them) of a daemon
    serving the scenarios `names`: a route described here that the app does not serve is left out. When `routes`
    maps each route to the token scope it needs, each operation's security requirement names that scope."""
    described = _agent_ops(names, by_path=False)
    described.update({"/scenarios/{scenario}" + path: ops for path, ops in _agent_ops(names, by_path=True).items()})
    described.update(_reef_ops(names))
    described.update(_tinker_ops())
    paths = {path: kept for path, ops in described.items()
             if (kept := {method: op for method, op in ops.items() if (method.upper(), path) in routes})}
    scopes = routes if isinstance(routes, dict) else {}
    for path, ops in paths.items():
        for method, op in ops.items():
            scope = scopes.get((method.upper(), path), ANY)
            if scope != ANY and op.get("security") != []:
                op["security"] = [{"bearer": [scope]}, {"apiKey": [scope]}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "reefd", "version": __version__, "license": {"name": "Apache-2.0",
                                                                      "identifier": "Apache-2.0"},
                 "description": "Reef's daemon: provider-native agent APIs (OpenAI Chat Completions and Responses, "
                                "Anthropic Messages) that record every turn, feedback on receipts, and the "
                                "operator's API over records, releases and jobs. Errors come in OpenAI's shape, "
                                "except on /v1/messages*, which answer in Anthropic's."},
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}, {"apiKey": []}],
        "paths": paths,
        "components": {
            "schemas": SCHEMAS,
            "responses": _errors(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        },
    }


def routes(app: web.Application) -> dict[tuple[str, str], str]:
    """(method, path) of every route `app` serves (HEAD aside: aiohttp adds it to each GET), with the token
    scope it needs (reefd/ops/tokens.py)."""
    scopes = app.get(ROUTE_SCOPES, {})
    return {(r.method, r.resource.canonical): scopes.get(r.handler, "admin") for r in app.router.routes()
            if r.resource is not None and r.method != "HEAD"}


async def openapi_json(request: web.Request) -> web.Response:
    """The scenarios the request's token covers are the document's scenario names."""
    return json_response(document(access.visible(request, request.app[REGISTRY].scenarios), routes(request.app)))
