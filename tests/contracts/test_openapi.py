"""The OpenAPI document describes exactly the routes the proxy serves, completely, and is itself valid.

Completeness means: every route of the app's router is an operation; every path parameter of the route template is
documented; every operation names its success and error responses with schemas and examples; every error response
is the envelope; and every example (request and response) validates against the schema next to it. That real
answers of a running proxy match the documented schemas is checked in ``tests/integration/test_openapi_responses``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openapi_spec_validator import validate

import ibex_dataplane
from ibex_dataplane.providers import errors as provider_errors
from ibex_dataplane.proxy.app import create_app
from ibex_dataplane.proxy.openapi import openapi_document
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings
from ibex_dataplane.shared.errors import ERROR_CODES, HTTP_STATUS_CODES, ServiceError
from tests.support.openapi import escape, operations, schema_validator

SOURCE = Path(ibex_dataplane.__file__).parent


def served_routes(settings: Settings, stores: Stores) -> set[tuple[str, str]]:
    app = create_app(settings, stores, pepper=b"x" * 32)
    routes = set()
    for route in app.router.routes():
        info: dict[str, Any] = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path and route.method not in ("HEAD", "*"):
            routes.add((route.method.lower(), path))
    return routes


def media_types(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(where, JSON pointer of the media type object, media type object) for every request and response body."""
    for method, path, op in operations(doc):
        base = f"/paths/{escape(path)}/{method}"
        body = op.get("requestBody", {}).get("content", {})
        for ctype, media in body.items():
            yield f"{method.upper()} {path} request", f"{base}/requestBody/content/{escape(ctype)}", media
        for status, response in op["responses"].items():
            for ctype, media in response.get("content", {}).items():
                yield f"{method.upper()} {path} {status}", f"{base}/responses/{status}/content/{escape(ctype)}", media


async def test_every_served_route_is_documented_and_nothing_else(settings: Settings, stores: Stores) -> None:
    doc = openapi_document()
    documented = {(method, path) for method, path, _ in operations(doc)}
    assert served_routes(settings, stores) == documented


def test_the_document_is_valid_openapi() -> None:
    validate(openapi_document())


def test_every_operation_documents_its_parameters_bodies_and_responses() -> None:
    doc = openapi_document()
    ids = [op["operationId"] for _, _, op in operations(doc)]
    assert len(ids) == len(set(ids))
    for method, path, op in operations(doc):
        where = f"{method.upper()} {path}"
        assert op.get("summary"), where
        params = op.get("parameters", [])
        in_path = {p["name"] for p in params if p["in"] == "path"}
        assert in_path == set(re.findall(r"\{([^}]+)\}", path)), where
        assert all("schema" in p for p in params), where
        successes = {s: r for s, r in op["responses"].items() if s.startswith("2")}
        assert successes, where
        for status, response in successes.items():
            if status != "204" and (path, status) != ("/mcp", "202"):  # MCP: an accepted notification has no body
                assert response.get("content"), (where, status)
        errors = {s: r for s, r in op["responses"].items() if int(s) >= 400}
        if "security" in op:  # every protected route can refuse a key and can fail
            assert {"401", "500", "503"} <= set(errors), where
        for status, response in errors.items():
            if (path, status) == ("/readyz", "503"):  # readiness reports its checks, not an error
                continue
            if path == "/mcp" and status in ("400", "404"):  # MCP's transport errors are JSON-RPC errors
                rpc, envelope = {"$ref": "#/components/schemas/JsonRpcError"}, {"$ref": "#/components/schemas/Error"}
                schema = response["content"]["application/json"]["schema"]
                assert schema in (rpc, {"oneOf": [envelope, rpc]}), (where, status)
                continue
            assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}, (
                where,
                status,
            )
        if method == "post" and not path.endswith("/terminate"):
            assert op["requestBody"]["required"] is True, where


def test_every_example_matches_the_schema_beside_it() -> None:
    doc = openapi_document()
    checked = 0
    for where, pointer, media in media_types(doc):
        examples = [e["value"] for e in media.get("examples", {}).values()]
        if "example" in media:
            examples.append(media["example"])
        if media["schema"] != {"type": "string"}:  # JSON bodies carry examples; text ones (SSE, metrics) may
            assert examples, f"{where}: no example"
        validator = schema_validator(doc, pointer + "/schema")
        for example in examples:
            errors = [e.message for e in validator.iter_errors(example)]
            assert not errors, (where, errors)
            checked += 1
        event_schema = media.get("x-ibex-event-schema")
        if event_schema is not None:  # SSE: every data line but [DONE] is one event of the documented schema
            events = schema_validator(doc, pointer + "/x-ibex-event-schema")
            for line in media["example"].splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.validate(json.loads(line[6:]))
                    checked += 1
    assert checked > 40


def test_the_schemas_reject_what_is_not_in_the_contract() -> None:
    """The validator really validates: shapes outside the contract fail."""
    doc = openapi_document()
    error = schema_validator(doc, "/components/schemas/Error")
    assert error.is_valid({"error": {"code": "NOT_FOUND", "message": "no such memory", "request_id": "r1"}})
    assert not error.is_valid({"error": {"code": "NOT_FOUND", "message": "no such memory"}})
    assert not error.is_valid({"error": {"code": "SOMETHING_ELSE", "message": "m", "request_id": "r1"}})
    assert not error.is_valid({"detail": "Not Found"})
    memory = schema_validator(doc, "/components/schemas/Memory")
    assert not memory.is_valid({"id": "not-a-uuid"})
    quarantined = schema_validator(doc, "/components/schemas/QuarantinedMemory")
    example = doc["paths"]["/v1/memories"]["post"]["responses"]["202"]["content"]["application/json"]
    held = example["examples"]["quarantined"]["value"]["memory"]
    assert quarantined.is_valid(held)
    assert not quarantined.is_valid({**held, "content": "a secret"})


@functools.cache
def raised_codes() -> frozenset[tuple[int, str]]:
    """(status, code) of every envelope error the data plane's source can raise."""
    found: set[tuple[int, str]] = set()
    for path in SOURCE.rglob("*.py"):
        if "proto_gen" in path.parts:
            continue
        text = path.read_text()
        for status, code in re.findall(r"(?:ApiError|error_response)\(\s*(\d{3}),\s*\"([A-Z][A-Z0-9_]+)\"", text):
            found.add((int(status), code))
    for info in pkgutil.walk_packages(ibex_dataplane.__path__, "ibex_dataplane."):
        if ".proto_gen" not in info.name:
            importlib.import_module(info.name)

    def subclasses(cls: type) -> Iterator[type]:
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    for cls in subclasses(ServiceError):
        if cls.__name__ != "ApiError":
            found.add((cls.status, cls.code))  # type: ignore[attr-defined]
    for _, cls in inspect.getmembers(provider_errors, inspect.isclass):
        if issubclass(cls, provider_errors.ProviderError) and cls is not provider_errors.UpstreamRejected:
            found.add((cls.default_status, cls.code))
    found |= set(HTTP_STATUS_CODES.items())
    return frozenset(found)


def test_every_error_code_the_code_raises_is_in_the_catalogue() -> None:
    catalogue = {(status, code) for status, codes in ERROR_CODES.items() for code in codes}
    raised = raised_codes()
    assert len(raised) > 25  # the scan found the raise sites
    assert raised <= catalogue, sorted(raised - catalogue)


@pytest.mark.parametrize("status", sorted(ERROR_CODES))
def test_each_status_of_the_catalogue_is_raised_somewhere(status: int) -> None:
    assert status in {s for s, _ in raised_codes()}
