"""The shapes reefd answers in, as JSON Schemas (2020-12) for the OpenAPI document (api/openapi.py): bodies,
server-sent events (each event's `data` as JSON, checked with `contentSchema`), and the two error shapes.

Request bodies are the handlers' own schemas, imported; the answers' shapes are written down here, from the
provider modules that produce them. Knows nothing of routes.
"""

from __future__ import annotations

from typing import Any

from reefd.api import anthropic, openai, reports, responses
from reefd.grow.job_store import STATES


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


STR = {"type": "string"}
_OPT_STR = {"type": ["string", "null"]}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
OBJ = {"type": "object"}
_OPT_OBJ = {"type": ["object", "null"]}
ID = {"type": "string", "minLength": 1}


def _obj(required: str, **props: Any) -> dict[str, Any]:
    """An object schema: `required` names its always-present keys (space-separated); more keys may appear."""
    return {"type": "object", "required": required.split(), "properties": props}


_TOOL_CALL = _obj("id type function", id=STR, type={"const": "function"},
                  function=_obj("name arguments", name=STR, arguments=STR))
# a new head on trial (reefd/commit/trials.py): what a publish or promote started, and its progress in /reef/status
_TRIAL = _obj("mode release share stable", mode={"enum": ["canary", "shadow"]}, release=STR, share=_NUM, stable=STR)
_TALLY = _obj("n mean sd", n=_INT, mean={"type": ["number", "null"]}, sd={"type": ["number", "null"]})
_TRIAL_PROGRESS = _obj("mode release stable_release share started_at max_age_s canary stable min_reports max_drop "
                       "confidence decision reason age_s loaded deciding", mode={"enum": ["canary", "shadow"]},
                       release=STR, stable_release=STR, share=_NUM, started_at=_NUM, max_age_s=_NUM, canary=_TALLY,
                       stable=_TALLY, pairs=_TALLY, min_reports=_INT, max_drop=_NUM, confidence=_NUM,
                       decision={"enum": ["promote", "rollback", None]}, reason=STR, age_s=_NUM,
                       loaded={"type": "boolean"}, deciding={"type": "boolean"}, diff=_NUM,
                       interval={"type": "array", "items": _NUM}, test=OBJ)
_RELEASE = _obj("id scenario parent kind seq created_at commit meta status", id=STR, scenario=STR, parent=_OPT_STR,
                kind=STR, seq=_INT, created_at=STR, commit=STR, meta=OBJ, status={"enum": ["released", "rejected"]},
                user=STR)
_OPT_INT = {"type": ["integer", "null"]}
# a weight job's batch in releases behind its base (reefd/grow/staleness.py): min, max, mean over the samples whose
# release is in the chain, those that are not, and those past max_staleness (`limit`) dropped or kept to be weighted
_STALENESS = _obj("min max mean off_chain dropped weighted limit", min=_OPT_INT, max=_OPT_INT,
                  mean={"type": ["number", "null"]}, off_chain=_INT, dropped=_INT, weighted=_INT, limit=_OPT_INT)
_FILE = _obj("path size lfs sha256", path=STR, size=_INT, lfs={"type": "boolean"}, sha256=STR)
_TEXT_OUT = _obj("type text annotations", type={"const": "output_text"}, text=STR, annotations={"type": "array"})
_RESPONSE_ITEM = {"oneOf": [
    _obj("type id status role content", type={"const": "message"}, id=STR, role={"const": "assistant"},
         status={"enum": ["completed", "incomplete", "in_progress"]}, content={"type": "array", "items": _TEXT_OUT}),
    _obj("type id call_id name arguments status", type={"const": "function_call"}, id=STR, call_id=STR,
         name=STR, arguments=STR, status=STR)]}

_STOP_REASON = {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    """A string holding JSON that fits `schema` (an event's `data`)."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


def _events(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One server-sent event: `event` names its kind, and `data` is JSON of that kind's shape, whose `type` is the
    kind again."""
    cases = [{"if": {"required": ["event"], "properties": {"event": {"const": kind}}},
              "then": {"properties": {"data": _json({"allOf": [
                  schema, {"type": "object", "required": ["type"], "properties": {"type": {"const": kind}}}]})}}}
             for kind, schema in kinds.items()]
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"enum": list(kinds)}, "data": STR}, "allOf": cases}


_CHUNK = _obj(
    "id object created model choices", id=STR, object={"const": "chat.completion.chunk"}, created=_INT, model=STR,
    choices={"type": "array", "items": _obj(
        "index delta finish_reason", index=_INT, finish_reason=_OPT_STR,
        delta=_obj("", role={"const": "assistant"}, content=STR, tool_calls={"type": "array", "items": _obj(
            "index id type function", index=_INT, id=STR, type={"const": "function"},
            function=_obj("name arguments", name=STR, arguments=STR))}))},
    usage={"anyOf": [{"type": "null"}, _obj("prompt_tokens completion_tokens total_tokens", prompt_tokens=_INT,
                                            completion_tokens=_INT, total_tokens=_INT)]})
_BLOCK_AT = {"index": _INT}
_ANTHROPIC_EVENTS = {
    "message_start": _obj("message", message=_obj(
        "id type role model content stop_reason stop_sequence usage", id=STR, type={"const": "message"},
        role={"const": "assistant"}, model=STR, content={"const": []}, stop_reason={"type": "null"},
        stop_sequence={"type": "null"}, usage=_obj("input_tokens output_tokens", input_tokens=_INT,
                                                   output_tokens=_INT))),
    "ping": _obj(""),
    "content_block_start": _obj("index content_block", **_BLOCK_AT,
                                content_block=_obj("type", type={"enum": ["text", "tool_use"]})),
    "content_block_delta": _obj("index delta", **_BLOCK_AT,
                                delta=_obj("type", type={"enum": ["text_delta", "input_json_delta"]})),
    "content_block_stop": _obj("index", **_BLOCK_AT),
    "message_delta": _obj("delta usage", delta=_obj("stop_reason stop_sequence", stop_reason=_STOP_REASON,
                                                    stop_sequence=_OPT_STR),
                          usage=_obj("output_tokens", output_tokens=_INT)),
    "message_stop": _obj(""),
    "error": ref("AnthropicError"),
}
_RESPONSE_STATES = {"enum": ["in_progress", "completed", "incomplete", "failed"]}
_IN_ITEM = {"item_id": STR, "output_index": _INT}
_IN_PART = {**_IN_ITEM, "content_index": _INT}
_PART = {"part": _TEXT_OUT}
_RESPONSE_EVENTS = {
    **{kind: _obj("sequence_number response", sequence_number=_INT, response=_obj(
        "id object status output", id=STR, object={"const": "response"}, status=_RESPONSE_STATES,
        output={"type": "array", "items": _RESPONSE_ITEM}))
       for kind in ("response.created", "response.in_progress", "response.completed", "response.incomplete",
                    "response.failed")},
    **{kind: _obj("sequence_number output_index item", sequence_number=_INT, output_index=_INT, item=_RESPONSE_ITEM)
       for kind in ("response.output_item.added", "response.output_item.done")},
    **{kind: _obj("sequence_number item_id output_index content_index part", sequence_number=_INT, **_IN_PART,
                  **_PART) for kind in ("response.content_part.added", "response.content_part.done")},
    "response.output_text.delta": _obj("sequence_number item_id output_index content_index delta",
                                       sequence_number=_INT, **_IN_PART, delta=STR),
    "response.output_text.done": _obj("sequence_number item_id output_index content_index text",
                                      sequence_number=_INT, **_IN_PART, text=STR),
    "response.function_call_arguments.delta": _obj("sequence_number item_id output_index delta",
                                                   sequence_number=_INT, **_IN_ITEM, delta=STR),
    "response.function_call_arguments.done": _obj("sequence_number item_id output_index arguments",
                                                  sequence_number=_INT, **_IN_ITEM, arguments=STR),
    "error": _obj("sequence_number code message param", sequence_number=_INT, code=STR, message=STR,
                  param=_OPT_STR),
}

SCHEMAS: dict[str, Any] = {
    "OpenAIError": {
        "description": "OpenAI's error shape, on every route but /v1/messages*.",
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                                 "additionalProperties": False,
                                 "properties": {"message": STR, "type": STR, "param": _OPT_STR,
                                                "code": _OPT_STR}}}},
    "AnthropicError": {
        "description": "Anthropic's error shape, on /v1/messages and /v1/messages/count_tokens.",
        "type": "object", "required": ["type", "error"], "additionalProperties": False,
        "properties": {"type": {"const": "error"},
                       "error": {"type": "object", "required": ["type", "message"], "additionalProperties": False,
                                 "properties": {"type": STR, "message": STR}}}},
    "ChatCompletionRequest": openai.REQUEST_SCHEMA,
    "ChatCompletion": _obj(
        "id object created model choices usage", id=STR, object={"const": "chat.completion"}, created=_INT,
        model=STR, choices={"type": "array", "items": _obj(
            "index message finish_reason", index=_INT, finish_reason=STR,
            message=_obj("role content", role={"const": "assistant"}, content=_OPT_STR,
                         tool_calls={"type": "array", "items": _TOOL_CALL}))},
        usage=_obj("prompt_tokens completion_tokens total_tokens", prompt_tokens=_INT, completion_tokens=_INT,
                   total_tokens=_INT)),
    "ChatCompletionEvent": {
        "description": "One event of a stream: a chunk, an error (the stream then ends), or `[DONE]`, the last.",
        "type": "object", "required": ["data"], "properties": {"data": {
            "if": {"const": "[DONE]"}, "else": _json({"anyOf": [_CHUNK, ref("OpenAIError")]})}}},
    "MessagesRequest": anthropic.REQUEST_SCHEMA,
    "CountTokensRequest": anthropic.COUNT_SCHEMA,
    "Message": _obj(
        "id type role model content stop_reason stop_sequence usage", id=STR, type={"const": "message"},
        role={"const": "assistant"}, model=STR, stop_sequence=_OPT_STR,
        stop_reason=_STOP_REASON,
        content={"type": "array", "items": {"oneOf": [
            _obj("type text", type={"const": "text"}, text=STR),
            _obj("type id name input", type={"const": "tool_use"}, id=STR, name=STR, input=OBJ)]}},
        usage=_obj("input_tokens output_tokens", input_tokens=_INT, output_tokens=_INT)),
    "MessageEvent": _events(_ANTHROPIC_EVENTS),
    "TokenCount": _obj("input_tokens", input_tokens=_INT),
    "ResponseRequest": responses.REQUEST_SCHEMA,
    "Response": _obj(
        "id object created_at status output model usage", id=STR, object={"const": "response"},
        created_at=_INT, model=STR, status={"enum": ["completed", "incomplete"]},
        output={"type": "array", "items": _RESPONSE_ITEM},
        usage=_obj("input_tokens output_tokens total_tokens", input_tokens=_INT, output_tokens=_INT,
                   total_tokens=_INT)),
    "ResponseEvent": _events(_RESPONSE_EVENTS),
    "Models": {"oneOf": [
        _obj("object data", object={"const": "list"}, data={"type": "array", "items": _obj(
            "id object created owned_by", id=STR, object={"const": "model"}, created=_INT, owned_by=STR)}),
        _obj("data has_more first_id last_id", has_more={"type": "boolean"}, first_id=_OPT_STR, last_id=_OPT_STR,
             data={"type": "array", "items": _obj("type id display_name created_at", type={"const": "model"},
                                                  id=STR, display_name=STR, created_at=STR)})]},
    "ReportRequest": reports.REPORT_SCHEMA,
    "Report": _obj("object report_id scenario references", object={"const": "reef.report"}, report_id=STR,
                   scenario=STR, references={"type": "array", "items": STR}),
    "Record": _obj("id scenario api request", id=STR, scenario=STR, api=STR, request=OBJ),
    "Records": _obj("object data has_more last_id", object={"const": "list"}, has_more={"type": "boolean"},
                    last_id=_OPT_STR, data={"type": "array", "items": ref("Record")}),
    "Status": _obj("version ready uptime_s scenarios", version=STR, ready={"type": "boolean"}, uptime_s=_NUM,
                   scenarios={"type": "array", "items": _obj("name model engine release releases records reports",
                                                             name=STR, model=STR, engine=OBJ, release=_OPT_STR,
                                                             releases=OBJ, records=_INT, reports=_INT,
                                                             canary=_TRIAL_PROGRESS)}),
    "Release": _RELEASE,
    "ReleaseFiles": {"allOf": [_RELEASE, _obj("files", files={"type": "array", "items": _FILE})]},
    "Releases": _obj("object scenario serving head declared data", object={"const": "list"}, scenario=STR,
                     serving=_OPT_STR, head=_OPT_STR, declared=_OPT_STR, data={"type": "array", "items": _RELEASE},
                     user=STR, own_line={"type": "boolean"}),
    "UserDeleted": _obj("object scenario user records releases jobs sessions shared_releases_learned_from "
                        "tokens_revoked tokens_kept",
                        object={"const": "reef.user.deleted"}, scenario=STR, user=STR, records=_INT,
                        releases={"type": "array", "items": STR}, jobs=_INT, sessions=_INT,
                        shared_releases_learned_from={"type": "array", "items": STR},
                        tokens_revoked={"type": "array", "items": STR}, tokens_kept={"type": "array", "items": STR}),
    "Users": _obj("object scenario max slots shared_release data", object={"const": "list"}, scenario=STR, max=_INT,
                  slots=_INT, shared_release=_OPT_STR, data={"type": "array", "items": _obj(
                      "user since share own_release release records reports", user=STR, since=_NUM,
                      share={"type": "boolean"},
                      own_release=_OPT_STR, release=_OPT_STR, why=STR, records=_INT, reports=_INT,
                      last_job={"type": ["object", "null"]})}),
    "Lineage": _obj("object release depth releases", object={"const": "reef.lineage"}, release=STR, depth=_INT,
                    releases={"type": "array", "items": _obj(
                        "id scenario parent kind status recipe job params metrics gate canary proposal mutations "
                        "harness_diff learned_from", id=STR, scenario=STR, parent=_OPT_STR, kind=STR, status=STR,
                        recipe=_OPT_STR, job={"type": ["object", "string", "null"]}, params=_OPT_OBJ,
                        metrics=_OPT_OBJ, gate=_OPT_OBJ, canary=_OPT_OBJ, proposal=_OPT_STR,
                        mutations={"type": ["array", "null"], "items": OBJ}, harness_diff=_OPT_STR,
                        users={"type": "array", "items": STR},
                        learned_from={"type": "array", "items": _obj(
                            "receipt deleted record reports", receipt=STR, deleted={"type": "boolean"}, record=STR,
                            user=_OPT_STR,
                            reports={"type": "array", "items": OBJ})})}),
    "Diff": _obj("a b kind meta added removed changed text", a=STR, b=STR,
                 kind={"type": "array", "items": STR, "minItems": 2, "maxItems": 2}, meta=OBJ,
                 added={"type": "array", "items": STR}, removed={"type": "array", "items": STR},
                 changed={"type": "array", "items": STR}, text={"type": "object", "additionalProperties": STR}),
    "RollbackRequest": {
        "type": "object", "properties": {
            "to": {"type": ["string", "null"], "minLength": 1, "description": "Default: the head's parent."},
            "dry_run": {"type": "boolean", "default": False},
            "expected_head": {"type": ["string", "null"], "minLength": 1},
            "user": {"type": ["string", "null"], "description": "A user's line (scenarios with a users: block)."}}},
    "TrainRequest": {
        "type": "object", "properties": {
            "user": {"type": ["string", "null"], "description": "Train this user's own line, on their records."},
            "promote": {"type": "boolean", "default": False, "description": "A promotion of the shared line: on "
                        "what consenting users' releases learned from (users.share)."}}},
    "UserPatch": {
        "type": "object", "required": ["share"], "additionalProperties": False, "properties": {
            "share": {"type": "boolean", "description": "Whether promotions may learn from what the user's own "
                      "releases learned from."}}},
    "User": _obj("object scenario user share promotions", object={"const": "reef.user"}, scenario=STR, user=STR,
                 share={"type": "boolean"}, promotions={"type": "boolean"}),
    "PromoteRequest": {
        "type": "object", "required": ["release"], "properties": {
            "release": {"type": "string", "minLength": 1, "description": "A release or a rejected candidate."},
            "dry_run": {"type": "boolean", "default": False},
            "expected_head": {"type": ["string", "null"], "minLength": 1},
            "user": {"type": ["string", "null"], "description": "A user's line (scenarios with a users: block)."}}},
    "Copied": _obj("dry_run release from to serving", dry_run={"type": "boolean"}, release={
        "anyOf": [_RELEASE, {"type": "null"}]}, to=STR, serving=_OPT_STR, trial=_TRIAL, **{"from": _OPT_STR}),
    "Published": _obj("release serving warnings", release=_RELEASE, serving=_OPT_STR, trial=_TRIAL,
                      warnings={"type": "array", "items": STR}),
    "Job": _obj("id scenario reason recipe state stage created_at", id=STR, scenario=STR, reason=STR,
                recipe=STR, state={"enum": list(STATES)}, stage=STR, created_at=_NUM, release=_OPT_STR,
                error=_OPT_STR, staleness={"anyOf": [{"type": "null"}, _STALENESS]}, user=_OPT_STR,
                users={"type": "array", "items": STR}),
    "Jobs": _obj("object data", object={"const": "list"}, data={"type": "array", "items": ref("Job")}),
    "Step": _obj("object scenario step release groups rollouts parents", object={"const": "reef.attempts.step"},
                 scenario=STR, step=_INT, release=STR, groups=_INT, rollouts=_INT, parents={"type": "array"}),
    "Wait": _obj("object scenario status retry_after_s", object={"const": "reef.attempts.wait"}, scenario=STR,
                 status={"enum": ["starting", "training"]}, retry_after_s=_NUM),
    "Archive": _obj("object scenario step best states top curve", object={"const": "reef.archive"}, scenario=STR,
                    step=_INT, best=OBJ, states=_INT, top={"type": "array"}, curve={"type": "array"}),
    "Harness": _obj("scenario release parent kind summary created_at files", scenario=STR, release=STR,
                    parent=_OPT_STR, kind=STR, summary=STR, created_at=STR, files={"type": "array", "items": _obj(
                        "path sha256 size content", path=STR, sha256=STR, size=_INT, content=STR)}),
    "HarnessReleases": _obj("object scenario current data", object={"const": "list"}, scenario=STR,
                            current=_OPT_STR, data={"type": "array", "items": _obj(
                                "id parent kind created_at summary", id=STR, parent=_OPT_STR, kind=STR,
                                created_at=STR, summary=STR)}, user=STR),
    "Health": _obj("status", status={"const": "ok"}),
    "Ready": _obj("ready", ready={"type": "boolean"}, scenarios={"type": "object", "additionalProperties": STR}),
}
