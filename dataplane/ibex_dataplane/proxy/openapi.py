"""The OpenAPI 3.1 document of the proxy's routes, served at ``/openapi.json`` (and fuzzed by the tests)."""

from __future__ import annotations

from typing import Any

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "request_id"],
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z][A-Z0-9_]*$"},
                "message": {"type": "string"},
                "request_id": {"type": "string"},
                "field_errors": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"field": {"type": "string"}, "message": {"type": "string"}},
                    },
                },
            },
        }
    },
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool", "function"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object", "properties": {"type": {"type": "string"}}}},
                {"type": "null"},
            ]
        },
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
    },
}

_CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "additionalProperties": True,
    "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": 1},
        "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
        "tools": {"type": "array"},
        "tool_choice": {},
        "user": {"type": "string"},
    },
}

_HEADERS = [
    {"name": "X-IBEX-Agent-ID", "in": "header", "required": True, "schema": {"type": "string"}},
    {"name": "X-IBEX-Session-ID", "in": "header", "required": False, "schema": {"type": "string"}},
    {"name": "X-Request-ID", "in": "header", "required": False, "schema": {"type": "string"}},
]


def _errors(*statuses: int) -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(s): {"description": "error", "content": content} for s in statuses}


def _op(summary: str, *, body: dict[str, Any] | None = None, agent: bool = True, errors: tuple[int, ...] = ()) -> Any:
    op: dict[str, Any] = {
        "summary": summary,
        "security": [{"bearer": []}],
        "parameters": _HEADERS if agent else _HEADERS[1:],
        "responses": {"200": {"description": "ok"}, **_errors(400, 401, 403, 404, 429, 500, 503, *errors)},
    }
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


_MEMORY_WRITE = {
    "type": "object",
    "required": ["content"],
    "properties": {
        "content": {"type": "string", "minLength": 1},
        "labels": {"type": "array", "items": {"type": "string"}, "maxItems": 5, "uniqueItems": True},
        "source": {"type": "string", "enum": ["user_provided", "extracted", "imported"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "valid_from": {"type": "string", "format": "date-time"},
        "valid_until": {"type": "string", "format": "date-time"},
        "observed_at": {"type": "string", "format": "date-time"},
        "session_id": {"type": "string"},
        "metadata": {"type": "object"},
    },
}
_MEMORY_ID = {"name": "memory_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}}
_IDEMPOTENCY = {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"}}


def _with(op: dict[str, Any], *params: dict[str, Any]) -> dict[str, Any]:
    return {**op, "parameters": [*params, *op["parameters"]]}


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "IBEX Harness proxy", "version": "v1"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": _ERROR, "ChatCompletionRequest": _CHAT_REQUEST},
        },
        "paths": {
            "/v1/chat/completions": {
                "post": _op(
                    "OpenAI Chat Completions (JSON or SSE)", body=_CHAT_REQUEST, errors=(402, 413, 415, 502, 504)
                )
            },
            "/v1/models": {"get": _op("Models the key's organization may use", agent=False)},
            "/v1/memories": {
                "post": _with(
                    _op("Write one memory through the refinery", body=_MEMORY_WRITE, errors=(409, 413, 415)),
                    _IDEMPOTENCY,
                ),
                "get": _op("List the agent's memories (cursor pagination; status active, superseded or quarantined)"),
            },
            "/v1/memories:batch": {
                "post": _with(
                    _op(
                        "Write up to 100 memories",
                        body={
                            "type": "object",
                            "required": ["items"],
                            "properties": {
                                "items": {"type": "array", "items": _MEMORY_WRITE, "minItems": 1, "maxItems": 100}
                            },
                        },
                        errors=(409, 413, 415),
                    ),
                    _IDEMPOTENCY,
                )
            },
            "/v1/memories/search": {
                "post": _op(
                    "Ranked hybrid search",
                    body={
                        "type": "object",
                        "required": ["query"],
                        "properties": {
                            "query": {"type": "string"},
                            "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                            "min_confidence": {"type": "number"},
                            "labels": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                )
            },
            "/v1/memories/{memory_id}": {
                "get": _with(_op("One memory"), _MEMORY_ID),
                "delete": _with(_op("Forget a memory (tombstone)"), _MEMORY_ID),
            },
            "/v1/memories/{memory_id}/feedback": {
                "post": _with(_op("Usefulness feedback", body={"type": "object"}), _MEMORY_ID),
            },
            "/v1/me": {"get": _op("Who the key is", agent=False)},
            "/v1/usage": {
                "get": {
                    **_op("The organization's spend and tokens by agent, model or day", agent=False),
                    "parameters": [
                        {
                            "name": "group_by",
                            "in": "query",
                            "schema": {"type": "string", "enum": ["agent", "model", "day"]},
                        },
                        {"name": "from", "in": "query", "schema": {"type": "string", "format": "date"}},
                        {"name": "to", "in": "query", "schema": {"type": "string", "format": "date"}},
                        *_HEADERS[1:],
                    ],
                }
            },
            "/v1/orgs/{org_id}/auth-probe": {
                "get": {
                    **_op("Diagnostic: the path org must be the key's org", agent=False),
                    "parameters": [
                        {"name": "org_id", "in": "path", "required": True, "schema": {"type": "string"}},
                        *_HEADERS[1:],
                    ],
                }
            },
            "/v1/sessions/{session_id}/terminate": {
                "post": {
                    **_op("End a session"),
                    "parameters": [
                        {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}},
                        *_HEADERS,
                    ],
                }
            },
            "/healthz": {"get": {"summary": "Liveness", "responses": {"200": {"description": "alive"}}}},
            "/readyz": {
                "get": {"summary": "Readiness", "responses": {"200": {"description": "ready"}, **_errors(503)}}
            },
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "metrics"}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI"}}}},
        },
    }
