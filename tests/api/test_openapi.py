"""The OpenAPI document (reefd/api/openapi.py): every route of the app described and nothing else, a valid
OpenAPI 3.1 document, request bodies that are the handlers' own schemas, errors in each route's provider shape.
tests/e2e/test_fuzz.py checks the daemon's answers against it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import schemathesis

from reefd.api import anthropic, openai, reports, responses
from reefd.api.openapi import document, routes

NAMES = ["alpha", "beta"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    from reefd.app import Settings, build_app

    state = tmp_path_factory.mktemp("state")
    return routes(build_app(Settings(state_dir=Path(state), tokens=["t" * 16])))


@pytest.fixture(scope="module")
def doc(served: dict[tuple[str, str], str]) -> dict[str, Any]:
    return document(NAMES, served)


def operations(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(method.upper(), path): op for path, item in doc["paths"].items() for method, op in item.items()}


def test_every_route_the_app_serves_is_described(doc: dict[str, Any], served: dict[tuple[str, str], str]) -> None:
    """A route added without a description fails here."""
    assert set(operations(doc)) == set(served)


def test_each_operation_names_the_token_scope_it_needs(doc: dict[str, Any]) -> None:
    ops = operations(doc)
    for key, scope in ((("POST", "/v1/chat/completions"), "serve"), (("POST", "/reef/report"), "report"),
                       (("GET", "/reef/status"), "read"), (("POST", "/reef/scenarios/{name}/train"), "admin")):
        assert ops[key]["security"] == [{"bearer": [scope]}, {"apiKey": [scope]}], key
    assert "security" not in ops[("GET", "/openapi.json")]  # any valid token: the document's default
    assert ops[("GET", "/healthz")]["security"] == []


def test_a_route_the_app_does_not_serve_is_left_out(served: dict[tuple[str, str], str]) -> None:
    some = {("GET", "/healthz"), ("POST", "/v1/responses")}
    assert set(operations(document(NAMES, some))) == some


def test_it_is_a_valid_openapi_3_1_document_with_valid_schemas(doc: dict[str, Any]) -> None:
    schemathesis.openapi.from_dict(doc).validate()  # the OpenAPI 3.1 meta-schema
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    ids = [op["operationId"] for op in operations(doc).values()]
    assert len(ids) == len(set(ids))


def test_request_bodies_are_the_schemas_the_handlers_validate_with(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    assert schemas["ChatCompletionRequest"] is openai.REQUEST_SCHEMA
    assert schemas["MessagesRequest"] is anthropic.REQUEST_SCHEMA
    assert schemas["CountTokensRequest"] is anthropic.COUNT_SCHEMA
    assert schemas["ResponseRequest"] is responses.REQUEST_SCHEMA
    assert schemas["ReportRequest"] is reports.REPORT_SCHEMA


def test_messages_routes_answer_errors_in_anthropic_shape_every_other_route_in_openai_shape(
        doc: dict[str, Any]) -> None:
    for (_, path), op in operations(doc).items():
        anthropic_route = path.removeprefix("/scenarios/{scenario}").startswith("/v1/messages")
        for status, answer in op["responses"].items():
            if int(status) >= 400 and "$ref" in answer:
                assert answer["$ref"].rsplit("/", 1)[1].startswith("Anthropic" if anthropic_route else "OpenAI")
    for name, answer in doc["components"]["responses"].items():
        shape = answer["content"]["application/json"]["schema"]["$ref"]
        assert shape.endswith("/AnthropicError" if name.startswith("Anthropic") else "/OpenAIError")


def test_the_error_shapes_are_exactly_what_errors_render() -> None:
    from reefd.api.errors import ApiError, anthropic_body, openai_body

    schemas = document(NAMES, set())["components"]["schemas"]
    err = ApiError(404, "no such thing", param="x", code="not_found")
    jsonschema.validate(openai_body(err), schemas["OpenAIError"])
    jsonschema.validate(anthropic_body(err), schemas["AnthropicError"])
    with pytest.raises(jsonschema.ValidationError):  # the shapes are strict: one in place of the other fails
        jsonschema.validate(openai_body(err), schemas["AnthropicError"])


def test_agent_routes_take_the_scenario_by_header_or_path_and_answer_with_the_receipt(doc: dict[str, Any]
                                                                                      ) -> None:
    ops = operations(doc)
    header = {p["name"]: p for p in ops[("POST", "/v1/chat/completions")]["parameters"]}["x-reef-scenario"]
    assert header["in"] == "header" and header["schema"]["enum"] == NAMES
    assert not header.get("required") and "later call of a session may leave it out" in header["description"]
    path = {p["name"]: p for p in ops[("POST", "/scenarios/{scenario}/v1/messages")]["parameters"]}["scenario"]
    assert path["in"] == "path" and path["schema"]["enum"] == NAMES
    for key in (("POST", "/v1/chat/completions"), ("POST", "/v1/messages"), ("POST", "/v1/responses")):
        ok = ops[key]["responses"]["200"]
        assert ok["headers"]["x-reef-agent-record-id"]["required"]
        assert set(ok["content"]) == {"application/json", "text/event-stream"}
    assert doc["components"]["securitySchemes"]["apiKey"] == {"type": "apiKey", "in": "header", "name": "x-api-key"}
    assert ops[("GET", "/healthz")]["security"] == [] and "security" not in ops[("GET", "/openapi.json")]
