"""The OpenAPI 3.1 document of the proxy's routes, served at ``/openapi.json``.

Every route :func:`ibex_dataplane.proxy.app.create_app` registers is described here with its parameters (path,
query and headers), its request body, every response it can give (the success shapes and the error envelope of
:mod:`ibex_dataplane.shared.errors`, per status) and examples. The contract tests compare it with the app's router,
validate it as OpenAPI, validate every example against its schema, and validate real answers of a running proxy
against the documented response schemas. Pure data: no I/O.
"""

from __future__ import annotations

from typing import Any

import orjson

from ibex_dataplane.shared.errors import ERROR_CODES

JSON = "application/json"
SSE = "text/event-stream"

_EXAMPLE_ORG = "5f0c6a4e-2b7d-4f3a-9c1e-8d2a6b4f0e11"
_EXAMPLE_AGENT = "0b8e3c52-7a19-4d6e-b2f4-6c1d9e8a7f30"
_EXAMPLE_MEMORY = "9d4f1a27-3c6b-4e8d-a5f2-1b7c0e9d4a63"
_EXAMPLE_OTHER_MEMORY = "2a6e9c14-8b3d-4f7a-9e1c-5d0b4a8f6e27"
_EXAMPLE_KEY = "k7Qm2Xw9Lp4R"
_EXAMPLE_REQUEST = "req_3f2b9c8d1e7a4b6c9d0e1f2a3b4c5d6e"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_UUID = {"type": "string", "format": "uuid"}
_TIME = {"type": "string", "format": "date-time"}
_TIME_OR_NULL = {"type": ["string", "null"], "format": "date-time"}
_UNIT = {"type": "number", "minimum": 0, "maximum": 1}
_SESSION_ID = {"type": "string", "pattern": "^[A-Za-z0-9._:\\-]{1,128}$"}

# -- schemas -------------------------------------------------------------------------------------------------------

_FIELD_ERROR = {
    "type": "object",
    "required": ["field", "message"],
    "properties": {
        "field": {"type": "string", "description": "Where the problem is, e.g. `messages[0].content`."},
        "message": {"type": "string"},
    },
}

_ERROR = {
    "type": "object",
    "description": "The one error body of every route and stage.",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "request_id"],
            "additionalProperties": False,
            "properties": {
                "code": {"type": "string", "enum": sorted({c for codes in ERROR_CODES.values() for c in codes})},
                "message": {"type": "string", "description": "Safe to show: never content, internals or secrets."},
                "request_id": {"type": "string", "description": "The same value as the `X-Request-ID` header."},
                "field_errors": {"type": "array", "items": _ref("FieldError")},
            },
        }
    },
}

_CONTENT_PART = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"type": "string", "enum": ["text", "image_url", "input_audio", "file", "refusal"]},
        "text": {"type": "string"},
        "image_url": {"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}},
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
                {"type": "array", "minItems": 1, "items": _CONTENT_PART},
                {"type": "null", "description": "Only for an assistant message that carries tool calls."},
            ]
        },
        "name": {"type": "string"},
        "tool_call_id": {"type": "string", "description": "Required for `tool` messages."},
        "tool_calls": {"type": "array", "items": _ref("ToolCall")},
    },
}

_TOOL_CALL = {
    "type": "object",
    "required": ["id", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}

_CHAT_REQUEST = {
    "type": "object",
    "description": "An OpenAI Chat Completions body. Fields not listed here travel on untouched to "
    "OpenAI-compatible upstreams.",
    "required": ["messages"],
    "additionalProperties": True,
    "properties": {
        "model": {
            "type": "string",
            "minLength": 1,
            "maxLength": 256,
            "description": "Defaults to the agent's, else the organization's default model.",
        },
        "messages": {"type": "array", "minItems": 1, "maxItems": 4096, "items": _ref("ChatMessage")},
        "stream": {"type": "boolean"},
        "stream_options": {
            "type": "object",
            "description": "Only with `stream: true`.",
            "properties": {"include_usage": {"type": "boolean"}},
        },
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        "n": {"type": "integer", "minimum": 1, "maximum": 1},
        "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
        "tools": {
            "type": "array",
            "maxItems": 128,
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "pattern": "^[A-Za-z0-9_\\-]{1,64}$"},
                            "description": {"type": "string"},
                            "parameters": {"type": "object"},
                        },
                    },
                },
            },
        },
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "response_format": {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}},
        },
        "user": {"type": "string"},
    },
}

_USAGE_TOKENS = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    },
}

_CHAT_COMPLETION = {
    "type": "object",
    "description": "An OpenAI chat completion, as the provider produced it (`echo` answers with the messages it "
    "received, as JSON text).",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "message": {
                        "type": "object",
                        "required": ["role"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": ["string", "null"]},
                            "refusal": {"type": ["string", "null"]},
                            "tool_calls": {"type": "array", "items": _ref("ToolCall")},
                        },
                    },
                    "logprobs": {"type": ["object", "null"]},
                    "finish_reason": {"type": ["string", "null"]},
                },
            },
        },
        "usage": _ref("TokenUsage"),
        "system_fingerprint": {"type": ["string", "null"]},
    },
}

_CHAT_CHUNK = {
    "type": "object",
    "description": "One `data:` event of a streamed completion. The stream ends with `data: [DONE]`; a provider "
    "failure after the first chunk arrives as one `data:` event holding the error envelope.",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion.chunk"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "system_fingerprint": {"type": ["string", "null"]},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "delta"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "delta": {
                        "type": "object",
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": ["string", "null"]},
                            "refusal": {"type": ["string", "null"]},
                            "tool_calls": {"type": "array"},
                        },
                    },
                    "logprobs": {"type": ["object", "null"]},
                    "finish_reason": {"type": ["string", "null"]},
                },
            },
        },
        "usage": {
            "anyOf": [_ref("TokenUsage"), {"type": "null"}],
            "description": "With `stream_options.include_usage`: null on every chunk but the last, which has "
            "empty `choices`.",
        },
    },
}

_MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by", "context_window", "max_output_tokens"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string", "description": "The provider that serves the model."},
        "context_window": {"type": "integer", "minimum": 1},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "kind": {
            "type": "string",
            "enum": ["chat", "embedding"],
            "description": "`chat` models serve the generation routes, `embedding` models `/v1/embeddings`.",
        },
    },
}

_MODEL_LIST = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
}

_MEMORY_WRITE = {
    "type": "object",
    "required": ["content"],
    "additionalProperties": False,
    "properties": {
        "content": {"type": "string", "minLength": 1, "description": "1..10000 bytes of UTF-8, not only spaces."},
        "labels": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 64},
            "minItems": 1,
            "maxItems": 5,
            "uniqueItems": True,
            "description": "A set: leave the field out for no labels (an empty array is an error).",
        },
        "source": {"type": "string", "enum": ["user_provided", "extracted", "imported"], "default": "user_provided"},
        "confidence": {**_UNIT, "default": 1.0},
        "valid_from": _TIME,
        "valid_until": {**_TIME, "description": "Later than `valid_from` (validity is half-open)."},
        "observed_at": _TIME,
        "session_id": _SESSION_ID,
        "metadata": {"type": "object", "description": "Plain JSON, at most 6 levels deep and 16384 bytes."},
    },
}

_MEMORY_PROPERTIES: dict[str, Any] = {
    "id": _UUID,
    "agent_id": _UUID,
    "content": {"type": ["string", "null"], "description": "After PII redaction."},
    "status": {"type": "string", "enum": ["active", "superseded", "quarantined", "forgotten"]},
    "labels": {"type": "array", "items": {"type": "string"}},
    "source": {"type": "string", "enum": ["user_provided", "extracted", "imported"]},
    "confidence": _UNIT,
    "usefulness": _UNIT,
    "valid_from": _TIME_OR_NULL,
    "valid_until": _TIME_OR_NULL,
    "observed_at": _TIME_OR_NULL,
    "session_id": {"type": ["string", "null"]},
    "metadata": {"type": "object"},
    "revision": {"type": "integer", "minimum": 1},
    "retrieval_count": {"type": "integer", "minimum": 0},
    "created_at": _TIME,
    "updated_at": _TIME,
}
_MEMORY = {
    "type": "object",
    "description": "A memory. A quarantined or forgotten memory never shows its content, labels or metadata.",
    "required": list(_MEMORY_PROPERTIES),
    "additionalProperties": False,
    "properties": _MEMORY_PROPERTIES,
}
# A quarantined write answers without the fields that could echo what was held back.
_HELD_BACK = ("content", "labels", "metadata")
_QUARANTINED_MEMORY = {
    "type": "object",
    "required": [name for name in _MEMORY_PROPERTIES if name not in _HELD_BACK],
    "additionalProperties": False,
    "properties": {name: schema for name, schema in _MEMORY_PROPERTIES.items() if name not in _HELD_BACK}
    | {"status": {"const": "quarantined"}},
}

_RELATIONSHIP = {
    "type": "object",
    "required": ["kind", "source_id", "target_id", "score", "needs_review"],
    "properties": {
        "kind": {
            "type": "string",
            "enum": ["supersedes", "contradicts", "overlaps", "specializes", "near_duplicate_of"],
        },
        "source_id": _UUID,
        "target_id": _UUID,
        "score": {"type": ["number", "null"]},
        "needs_review": {"type": "boolean"},
    },
}

_MEMORY_CREATED = {
    "type": "object",
    "required": ["memory", "relationships"],
    "properties": {"memory": _ref("Memory"), "relationships": {"type": "array", "items": _ref("Relationship")}},
}
_MEMORY_DEDUPLICATED = {
    "type": "object",
    "required": ["memory", "deduplicated"],
    "properties": {"memory": _ref("Memory"), "deduplicated": {"const": "exact"}},
}
_MEMORY_QUARANTINED = {
    "type": "object",
    "required": ["memory"],
    "properties": {"memory": _ref("QuarantinedMemory")},
}
_ONE_MEMORY = {"type": "object", "required": ["memory"], "properties": {"memory": _ref("Memory")}}

_BATCH_REQUEST = {
    "type": "object",
    "required": ["items"],
    "additionalProperties": False,
    "properties": {"items": {"type": "array", "items": _ref("MemoryWrite"), "minItems": 1, "maxItems": 100}},
}
_BATCH_RESULT = {
    "type": "object",
    "description": "The outcome of one item, in input order: the status it would have had alone, and its body.",
    "required": ["status"],
    "properties": {
        "status": {"type": "integer", "minimum": 200, "maximum": 599},
        "memory": {"anyOf": [_ref("Memory"), _ref("QuarantinedMemory")]},
        "relationships": {"type": "array", "items": _ref("Relationship")},
        "deduplicated": {"const": "exact"},
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "field_errors": {"type": "array", "items": _ref("FieldError")},
            },
        },
    },
}
_BATCH_RESPONSE = {
    "type": "object",
    "required": ["results"],
    "properties": {"results": {"type": "array", "items": _ref("BatchResult")}},
}

_SEARCH_REQUEST = {
    "type": "object",
    "required": ["query"],
    "additionalProperties": False,
    "properties": {
        "query": {"type": "string", "minLength": 1, "description": "At most 2000 bytes."},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
        "min_confidence": _UNIT,
        "labels": {
            "type": "array",
            "items": {"type": "string"},
            "minItems": 1,
            "maxItems": 5,
            "uniqueItems": True,
            "description": "Only memories carrying these labels.",
        },
    },
}
_SEARCH_RESPONSE = {
    "type": "object",
    "required": ["results"],
    "properties": {
        "results": {
            "type": "array",
            "description": "Best first.",
            "items": {
                "type": "object",
                "required": ["memory", "score", "components", "matched_by"],
                "properties": {
                    "memory": _ref("Memory"),
                    "score": {"type": "number"},
                    "components": {
                        "type": "object",
                        "description": "0.40 relevance + 0.25 recency + 0.20 usefulness + 0.10 confidence + "
                        "0.05 frequency.",
                        "required": ["relevance", "recency", "usefulness", "confidence", "frequency"],
                        "properties": {
                            name: {"type": "number"}
                            for name in ("relevance", "recency", "usefulness", "confidence", "frequency")
                        },
                    },
                    "matched_by": {"type": "string", "enum": ["vector", "text", "both"]},
                },
            },
        }
    },
}
_MEMORY_LIST = {
    "type": "object",
    "required": ["data", "next_cursor"],
    "properties": {
        "data": {"type": "array", "items": _ref("Memory"), "description": "Newest first."},
        "next_cursor": {"type": ["string", "null"], "description": "Pass as `cursor` for the next page."},
    },
}
_FEEDBACK = {
    "type": "object",
    "description": "`useful` (or its synonym `signal`); sending both requires them to agree.",
    "additionalProperties": False,
    "anyOf": [{"required": ["useful"]}, {"required": ["signal"]}],
    "properties": {"useful": {"type": "boolean"}, "signal": {"type": "string", "enum": ["positive", "negative"]}},
}

_ME = {
    "type": "object",
    "required": ["org_id", "org_name", "key_id", "scopes", "agents"],
    "properties": {
        "org_id": _UUID,
        "org_name": {"type": ["string", "null"]},
        "key_id": {"type": "string"},
        "scopes": {
            "type": "array",
            "items": {"type": "string", "enum": ["chat", "memory:read", "memory:write", "memory:delete", "usage:read"]},
        },
        "agents": {
            "type": "array",
            "description": "The agents this key may act as.",
            "items": {
                "type": "object",
                "required": ["id", "name", "suspended"],
                "properties": {"id": _UUID, "name": {"type": "string"}, "suspended": {"type": "boolean"}},
            },
        },
    },
}

_USAGE = {
    "type": "object",
    "required": ["object", "org_id", "group_by", "from", "to", "data"],
    "properties": {
        "object": {"const": "usage"},
        "org_id": _UUID,
        "group_by": {"type": "string", "enum": ["agent", "model", "day"]},
        "from": {"type": "string", "format": "date"},
        "to": {"type": "string", "format": "date", "description": "Exclusive."},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "requests", "prompt_tokens", "completion_tokens", "cost_usd"],
                "properties": {
                    "key": {"type": "string", "description": "The agent id, the model or the day."},
                    "agent_name": {"type": ["string", "null"], "description": "Only when grouped by agent."},
                    "requests": {"type": "integer", "minimum": 0},
                    "prompt_tokens": {"type": "integer", "minimum": 0},
                    "completion_tokens": {"type": "integer", "minimum": 0},
                    "cost_usd": {"type": "string", "pattern": "^-?[0-9]+(\\.[0-9]+)?$", "description": "Decimal."},
                },
            },
        },
    },
}

_AUTH_PROBE = {
    "type": "object",
    "required": ["ok", "org_id", "key_id"],
    "properties": {"ok": {"const": True}, "org_id": _UUID, "key_id": {"type": "string"}},
}
_SESSION_CLOSED = {
    "type": "object",
    "required": ["id", "status"],
    "properties": {"id": _SESSION_ID, "status": {"const": "closed"}},
}
_HEALTH = {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}
_READINESS = {
    "type": "object",
    "required": ["status", "checks"],
    "properties": {
        "status": {"type": "string", "enum": ["ready", "not ready"]},
        "checks": {
            "type": "object",
            "description": "`ok`, or `error: <kind>`, per store (postgres, redis, clickhouse).",
            "additionalProperties": {"type": "string"},
        },
        "degraded": {
            "type": "array",
            "items": {"type": "string"},
            "description": "Stores that failed their check but only degrade the proxy (clickhouse: analytics rows "
            "are dropped and counted); the proxy stays ready.",
        },
    },
}

_JSONRPC_ID = {"type": ["string", "integer"], "description": "The request's id (absent in a notification)."}
_JSONRPC_MESSAGE = {
    "type": "object",
    "description": "One JSON-RPC 2.0 message of the Model Context Protocol: a request (with `id`), a notification "
    "(without), or an answer to a request of the server (this server sends none). See docs/mcp.md.",
    "required": ["jsonrpc"],
    "properties": {
        "jsonrpc": {"const": "2.0"},
        "id": _JSONRPC_ID,
        "method": {"type": "string"},
        "params": {"type": "object"},
        "result": {"type": "object"},
        "error": {"type": "object"},
    },
}
_JSONRPC_ERROR = {
    "type": "object",
    "description": "A JSON-RPC error answer: -32700 parse error, -32600 invalid request (no or unknown session, "
    "another protocol revision), -32601 no such method, -32602 invalid params, -32603 internal error, -32002 no "
    "such resource, -32003 refused (`data` holds the error envelope's fields).",
    "required": ["jsonrpc", "id", "error"],
    "additionalProperties": False,
    "properties": {
        "jsonrpc": {"const": "2.0"},
        "id": {"type": ["string", "integer", "null"]},
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "additionalProperties": False,
            "properties": {"code": {"type": "integer"}, "message": {"type": "string"}, "data": {}},
        },
    },
}
_JSONRPC_ANSWER = {
    "type": "object",
    "description": "The answer to one request: a `result`, or a JSON-RPC `error`.",
    "required": ["jsonrpc", "id"],
    "properties": {
        "jsonrpc": {"const": "2.0"},
        "id": {"type": ["string", "integer", "null"]},
        "result": {"type": "object"},
        "error": _JSONRPC_ERROR["properties"]["error"],  # type: ignore[index]
    },
    "oneOf": [{"required": ["result"]}, {"required": ["error"]}],
}
_PROTECTED_RESOURCE = {
    "type": "object",
    "description": "OAuth 2.0 protected-resource metadata (RFC 9728).",
    "required": ["resource", "bearer_methods_supported", "scopes_supported"],
    "properties": {
        "resource": {"type": "string", "format": "uri"},
        "resource_name": {"type": "string"},
        "bearer_methods_supported": {"type": "array", "items": {"const": "header"}},
        "scopes_supported": {"type": "array", "items": {"type": "string"}},
    },
}

_RESPONSES_ITEM = {
    "type": "object",
    "description": "A message (`role` with string content or `input_text` / `output_text` / `input_image` parts), "
    "a `function_call` (`call_id`, `name`, `arguments`) or a `function_call_output` (`call_id`, `output`).",
    "properties": {
        "type": {"type": "string", "enum": ["message", "function_call", "function_call_output", "reasoning"]},
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "arguments": {"type": "string"},
        "output": {"anyOf": [{"type": "string"}, {"type": "array"}]},
    },
}

_RESPONSES_REQUEST = {
    "type": "object",
    "description": "An OpenAI Responses API body, translated to a chat completion for any provider. Only `function` "
    "tools are supported; `previous_response_id` and `conversation` are refused (send the conversation as input).",
    "required": ["input"],
    "additionalProperties": True,
    "properties": {
        "model": {"type": "string", "minLength": 1, "maxLength": 256},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _ref("ResponsesInputItem")}]},
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "stream": {"type": "boolean"},
        "store": {"type": "boolean", "description": "Keep the answer for `GET /v1/responses/{id}` (default true)."},
        "temperature": {"type": ["number", "null"]},
        "top_p": {"type": ["number", "null"]},
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"const": "function"},
                    "name": {"type": "string"},
                    "description": {"type": ["string", "null"]},
                    "parameters": {"type": ["object", "null"]},
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "text": {"type": "object"},
        "user": {"type": "string"},
        "metadata": {"type": ["object", "null"]},
    },
}

_RESPONSE_OUTPUT_ITEM = {
    "type": "object",
    "required": ["type", "id", "status"],
    "properties": {
        "type": {"type": "string", "enum": ["message", "function_call"]},
        "id": {"type": "string"},
        "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete"]},
        "role": {"const": "assistant"},
        "content": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "text"],
                "properties": {"type": {"const": "output_text"}, "text": {"type": "string"}},
            },
        },
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "arguments": {"type": "string"},
    },
}

_RESPONSE = {
    "type": "object",
    "description": "An OpenAI Responses API `response` object.",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": {"type": "string", "pattern": "^resp_"},
        "object": {"const": "response"},
        "created_at": {"type": "integer"},
        "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete", "failed"]},
        "incomplete_details": {
            "anyOf": [{"type": "null"}, {"type": "object", "properties": {"reason": {"type": "string"}}}]
        },
        "instructions": {"type": ["string", "null"]},
        "model": {"type": "string"},
        "output": {"type": "array", "items": _ref("ResponseOutputItem")},
        "store": {"type": "boolean"},
        "usage": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": ["input_tokens", "output_tokens", "total_tokens"],
                    "properties": {
                        "input_tokens": {"type": "integer", "minimum": 0},
                        "output_tokens": {"type": "integer", "minimum": 0},
                        "total_tokens": {"type": "integer", "minimum": 0},
                    },
                },
            ]
        },
    },
}

_RESPONSE_EVENT = {
    "type": "object",
    "description": "One server-sent event of a streamed response (its `event:` line repeats `type`): "
    "`response.created`, `response.in_progress`, `response.output_item.added`, `response.content_part.added`, "
    "`response.output_text.delta`, `response.output_text.done`, `response.content_part.done`, "
    "`response.function_call_arguments.delta`, `response.function_call_arguments.done`, `response.output_item.done`, "
    "then `response.completed` or `response.incomplete`; or `error` (with the envelope under `error`) when the "
    "provider fails after the first byte.",
    "required": ["type", "sequence_number"],
    "properties": {
        "type": {"type": "string", "pattern": "^(response\\.|error$)"},
        "sequence_number": {"type": "integer", "minimum": 0},
        "response": _ref("Response"),
        "output_index": {"type": "integer", "minimum": 0},
        "item": _ref("ResponseOutputItem"),
        "delta": {"type": "string"},
    },
}

_ANTHROPIC_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"type": "string", "enum": ["text", "image", "tool_use", "tool_result"]}},
}

_MESSAGES_REQUEST = {
    "type": "object",
    "description": "An Anthropic Messages body. `system` is a string or text blocks; content blocks `text`, "
    "`image` (base64 or url source), `tool_use` (assistant) and `tool_result` (user).",
    "required": ["max_tokens", "messages"],
    "additionalProperties": True,
    "properties": {
        "model": {"type": "string", "minLength": 1, "maxLength": 256},
        "max_tokens": {"type": "integer", "minimum": 1},
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _ref("AnthropicContentBlock")}]},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": ["user", "assistant"]},
                    "content": {
                        "anyOf": [{"type": "string"}, {"type": "array", "items": _ref("AnthropicContentBlock")}]
                    },
                },
            },
        },
        "stream": {"type": "boolean"},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "temperature": {"type": "number"},
        "top_p": {"type": "number"},
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "input_schema": {"type": "object"},
                },
            },
        },
        "tool_choice": {"type": "object"},
    },
}

_ANTHROPIC_MESSAGE = {
    "type": "object",
    "description": "An Anthropic Messages `message`.",
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "model": {"type": "string"},
        "content": {"type": "array", "items": _ref("AnthropicContentBlock")},
        "stop_reason": {"type": ["string", "null"], "enum": ["end_turn", "max_tokens", "tool_use", "refusal", None]},
        "stop_sequence": {"type": ["string", "null"]},
        "usage": {
            "type": "object",
            "required": ["input_tokens", "output_tokens"],
            "properties": {
                "input_tokens": {"type": "integer", "minimum": 0},
                "output_tokens": {"type": "integer", "minimum": 0},
                "cache_read_input_tokens": {"type": "integer", "minimum": 0},
                "cache_creation_input_tokens": {"type": "integer", "minimum": 0},
            },
        },
    },
}

_MESSAGES_EVENT = {
    "type": "object",
    "description": "One server-sent event of a streamed message (its `event:` line repeats `type`): "
    "`message_start`, then per block `content_block_start`, `content_block_delta` (`text_delta` or "
    "`input_json_delta`), `content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`; or "
    "`error` (with the envelope fields under `error`) when the provider fails after the first byte.",
    "required": ["type"],
    "properties": {
        "type": {
            "type": "string",
            "enum": ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop", "error"],
        },
        "index": {"type": "integer", "minimum": 0},
        "message": _ref("AnthropicMessage"),
    },
}  # fmt: skip

_EMBEDDINGS_REQUEST = {
    "type": "object",
    "description": "An OpenAI embeddings body. `ibex-minilm` (built in, 384 dimensions) embeds text; token arrays "
    "need an upstream model.",
    "required": ["model", "input"],
    "additionalProperties": True,
    "properties": {
        "model": {"type": "string", "minLength": 1, "maxLength": 256},
        "input": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "maxItems": 2048, "items": {"type": "string", "minLength": 1}},
                {"type": "array", "minItems": 1, "items": {"type": "integer"}},
                {"type": "array", "minItems": 1, "items": {"type": "array", "items": {"type": "integer"}}},
            ]
        },
        "encoding_format": {"type": "string", "enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1},
        "user": {"type": "string"},
    },
}

_EMBEDDINGS = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "model": {"type": "string"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"const": "embedding"},
                    "index": {"type": "integer", "minimum": 0},
                    "embedding": {
                        "anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}],
                        "description": "Floats, or with `encoding_format: base64` little-endian float32 bytes.",
                    },
                },
            },
        },
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "total_tokens": {"type": "integer", "minimum": 0},
            },
        },
    },
}

SCHEMAS: dict[str, Any] = {
    "Error": _ERROR,
    "FieldError": _FIELD_ERROR,
    "ChatMessage": _MESSAGE,
    "ToolCall": _TOOL_CALL,
    "ChatCompletionRequest": _CHAT_REQUEST,
    "ChatCompletion": _CHAT_COMPLETION,
    "ChatCompletionChunk": _CHAT_CHUNK,
    "ResponsesInputItem": _RESPONSES_ITEM,
    "ResponsesRequest": _RESPONSES_REQUEST,
    "Response": _RESPONSE,
    "ResponseOutputItem": _RESPONSE_OUTPUT_ITEM,
    "ResponseStreamEvent": _RESPONSE_EVENT,
    "AnthropicContentBlock": _ANTHROPIC_BLOCK,
    "MessagesRequest": _MESSAGES_REQUEST,
    "AnthropicMessage": _ANTHROPIC_MESSAGE,
    "MessagesStreamEvent": _MESSAGES_EVENT,
    "EmbeddingsRequest": _EMBEDDINGS_REQUEST,
    "Embeddings": _EMBEDDINGS,
    "TokenUsage": _USAGE_TOKENS,
    "Model": _MODEL,
    "ModelList": _MODEL_LIST,
    "MemoryWrite": _MEMORY_WRITE,
    "Memory": _MEMORY,
    "QuarantinedMemory": _QUARANTINED_MEMORY,
    "Relationship": _RELATIONSHIP,
    "MemoryCreated": _MEMORY_CREATED,
    "MemoryDeduplicated": _MEMORY_DEDUPLICATED,
    "MemoryQuarantined": _MEMORY_QUARANTINED,
    "OneMemory": _ONE_MEMORY,
    "BatchWrite": _BATCH_REQUEST,
    "BatchResult": _BATCH_RESULT,
    "BatchResponse": _BATCH_RESPONSE,
    "SearchRequest": _SEARCH_REQUEST,
    "SearchResponse": _SEARCH_RESPONSE,
    "MemoryList": _MEMORY_LIST,
    "Feedback": _FEEDBACK,
    "Me": _ME,
    "Usage": _USAGE,
    "AuthProbe": _AUTH_PROBE,
    "SessionClosed": _SESSION_CLOSED,
    "Health": _HEALTH,
    "Readiness": _READINESS,
    "JsonRpcMessage": _JSONRPC_MESSAGE,
    "JsonRpcAnswer": _JSONRPC_ANSWER,
    "JsonRpcError": _JSONRPC_ERROR,
    "ProtectedResourceMetadata": _PROTECTED_RESOURCE,
}

# -- examples ------------------------------------------------------------------------------------------------------

_MEMORY_EXAMPLE = {
    "id": _EXAMPLE_MEMORY,
    "agent_id": _EXAMPLE_AGENT,
    "content": "The customer prefers email over phone calls.",
    "status": "active",
    "labels": ["preferences"],
    "source": "user_provided",
    "confidence": 1.0,
    "usefulness": 0.5,
    "valid_from": None,
    "valid_until": None,
    "observed_at": "2026-01-12T09:30:00Z",
    "session_id": "sess_7c1e",
    "metadata": {"channel": "support"},
    "revision": 1,
    "retrieval_count": 0,
    "created_at": "2026-01-12T09:30:01.125000Z",
    "updated_at": "2026-01-12T09:30:01.125000Z",
}
_QUARANTINED_EXAMPLE = {k: v for k, v in _MEMORY_EXAMPLE.items() if k not in ("content", "labels", "metadata")} | {
    "id": _EXAMPLE_OTHER_MEMORY,
    "status": "quarantined",
}
_CHAT_EXAMPLE_REQUEST = {"model": "echo", "messages": [{"role": "user", "content": "Hello"}]}
_CHAT_EXAMPLE = {
    "id": "chatcmpl-6f1d2c9a8b7e4f3a",
    "object": "chat.completion",
    "created": 1768210201,
    "model": "echo",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": '[{"role":"user","content":"Hello"}]', "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 14, "total_tokens": 26},
    "system_fingerprint": None,
}
_RESPONSES_EXAMPLE_REQUEST = {"model": "echo", "instructions": "Be brief.", "input": "Hello"}
_RESPONSE_EXAMPLE = {
    "id": "resp_8f1c2d3e4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b", "object": "response", "created_at": 1768210201,
    "status": "completed", "model": "echo", "instructions": "Be brief.", "store": True,
    "output": [{"type": "message", "id": "msg_5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a29", "status": "completed",
                "role": "assistant", "content": [{"type": "output_text", "text": "[...]", "annotations": []}]}],
    "usage": {"input_tokens": 12, "output_tokens": 9, "total_tokens": 21},
}  # fmt: skip
_MESSAGES_EXAMPLE_REQUEST = {"model": "echo", "max_tokens": 256, "messages": [{"role": "user", "content": "Hello"}]}
_MESSAGE_EXAMPLE = {
    "id": "msg_3b2a19f8e7d6c5b4a3928170f6e5d4c3", "type": "message", "role": "assistant", "model": "echo",
    "content": [{"type": "text", "text": "[...]"}], "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 8, "output_tokens": 9, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
}  # fmt: skip
_RESPONSE_EVENTS: list[dict[str, Any]] = [
    {"type": "response.created", "sequence_number": 0, "response": {**_RESPONSE_EXAMPLE, "status": "in_progress",
                                                                     "output": [], "usage": None}},
    {"type": "response.output_text.delta", "sequence_number": 4,
     "item_id": "msg_5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a29", "output_index": 0, "content_index": 0,
     "delta": "[..."},
    {"type": "response.completed", "sequence_number": 9, "response": _RESPONSE_EXAMPLE},
]  # fmt: skip
_MESSAGE_EVENTS: list[dict[str, Any]] = [
    {"type": "message_start", "message": {**_MESSAGE_EXAMPLE, "content": [], "stop_reason": None}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "[..."}},
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}},
    {"type": "message_stop"},
]  # fmt: skip
_EMBEDDINGS_EXAMPLE = {
    "object": "list", "model": "ibex-minilm", "data": [{"object": "embedding", "index": 0, "embedding": [0.0123]}],
    "usage": {"prompt_tokens": 2, "total_tokens": 2},
}  # fmt: skip
_RESPONSE_ID = {
    "name": "response_id",
    "in": "path",
    "required": True,
    "description": "A response id (`resp_...`); anything else is simply a response that does not exist (404).",
    "schema": {"type": "string"},
}

_CHUNK_EXAMPLE = {
    "id": "chatcmpl-6f1d2c9a8b7e4f3a",
    "object": "chat.completion.chunk",
    "created": 1768210201,
    "model": "echo",
    "system_fingerprint": None,
    "choices": [{"index": 0, "delta": {"content": '[{"role":'}, "logprobs": None, "finish_reason": None}],
}

# One representative error per status, for the examples of every route that can answer it.
_ERROR_EXAMPLES: dict[int, tuple[str, str]] = {
    400: ("VALIDATION_ERROR", "the request body is invalid"),
    401: ("INVALID_TOKEN", "the API key is invalid"),
    402: ("BUDGET_EXCEEDED", "the agent budget for this month is exhausted"),
    403: ("INSUFFICIENT_PERMISSIONS", "this API key lacks the 'chat' scope"),
    404: ("NOT_FOUND", "no such memory"),
    409: ("IDEMPOTENCY_CONFLICT", "the idempotency key was used with a different request"),
    413: ("PAYLOAD_TOO_LARGE", "the request body exceeds 1048576 bytes"),
    415: ("UNSUPPORTED_MEDIA_TYPE", "the request body must be application/json"),
    422: ("UNPROCESSABLE", "the request alone needs more tokens than the per-minute token limit allows"),
    429: ("RATE_LIMITED", "rate limit exceeded"),
    500: ("INTERNAL_ERROR", "internal error"),
    502: ("PROVIDER_ERROR", "the provider failed"),
    503: ("SERVICE_DEGRADED", "a required store is unavailable (redis)"),
    504: ("PROVIDER_TIMEOUT", "the provider did not answer before the deadline"),
}


def _error_example(status: int) -> dict[str, Any]:
    code, message = _ERROR_EXAMPLES[status]
    error: dict[str, Any] = {"code": code, "message": message, "request_id": _EXAMPLE_REQUEST}
    if code == "VALIDATION_ERROR":
        error["field_errors"] = [{"field": "messages", "message": "must contain at least one message"}]
    return {"error": error}


# -- parameters and headers ----------------------------------------------------------------------------------------


def _header(name: str, description: str, *, required: bool = False, schema: Any = None) -> dict[str, Any]:
    return {
        "name": name,
        "in": "header",
        "required": required,
        "description": description,
        "schema": schema or {"type": "string"},
    }


_AGENT = _header("X-IBEX-Agent-ID", "The agent to act as: its id, or its name within the organization.",
                 required=True)  # fmt: skip
_OPTIONAL_AGENT = _header(
    "X-IBEX-Agent-ID", "Optional here; when given it must be an agent the key may act as.", required=False
)
_REQUEST_ID = _header(
    "X-Request-ID", "Echoed back for correlation when it matches `^[A-Za-z0-9._:-]{1,128}$`.",
    schema={"type": "string", "maxLength": 128},
)  # fmt: skip
_SESSION = _header(
    "X-IBEX-Session-ID", "The conversation this turn belongs to; one is generated (and echoed) when absent.",
    schema=_SESSION_ID,
)  # fmt: skip
_OBSERVED_AT = _header(
    "X-IBEX-Observed-At", "When this turn happened (RFC 3339 with a time zone, not in the future), for clients that "
    "replay or import conversations; captured memories take it as their `observed_at`. Default: the time of the "
    "answer.",
    schema={"type": "string", "format": "date-time"},
)  # fmt: skip
_IDEMPOTENCY = _header(
    "Idempotency-Key", "Same key and body replay the stored answer (`X-Idempotency-Replayed: true`); the same key "
    "with another body is 409 `IDEMPOTENCY_CONFLICT`. `X-Idempotency-Key` is accepted too.",
    schema={"type": "string", "minLength": 1, "maxLength": 255},
)  # fmt: skip
_SKIP_MEMORY = _header(
    "X-IBEX-Skip-Memory", "`1` (or `true`, `yes`) skips memory retrieval for this request.",
    schema={"type": "string", "enum": ["1", "true", "yes"]},
)  # fmt: skip
_MEMORY_ID = {
    "name": "memory_id",
    "in": "path",
    "required": True,
    "description": "A memory id; anything that is not one is simply a memory that does not exist (404).",
    "schema": {"type": "string"},
}

_HEADERS: dict[str, Any] = {
    "X-Request-ID": {"description": "The request id (the client's, when well formed).", "schema": {"type": "string"}},
    "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}},
    "X-RateLimit-Limit": {"description": "Requests per minute of the tightest tier.", "schema": {"type": "integer"}},
    "X-RateLimit-Remaining": {"description": "Requests left in this minute.", "schema": {"type": "integer"}},
    "X-RateLimit-Reset": {"description": "Seconds until the window resets.", "schema": {"type": "integer"}},
    "X-IBEX-Session-ID": {"description": "The session of this turn.", "schema": _SESSION_ID},
    "X-IBEX-Memories-Injected": {"description": "Memories placed in the prompt.", "schema": {"type": "integer"}},
    "X-IBEX-Context-Tokens": {"description": "Tokens of memory context added.", "schema": {"type": "integer"}},
    "X-IBEX-Context-Degraded": {
        "description": "`true` when assembly failed or missed its deadline (the chat still answers).",
        "schema": {"type": "string", "enum": ["true", "false"]},
    },
    "X-Idempotency-Replayed": {"description": "`true` on a replayed answer.", "schema": {"const": "true"}},
    "X-IBEX-Fallback-Model": {
        "description": "The model of the fallback chain that answered, when the requested one was unavailable.",
        "schema": {"type": "string"},
    },
}


def _headers(*names: str) -> dict[str, Any]:
    return {name: {"$ref": f"#/components/headers/{name}"} for name in ("X-Request-ID", *names)}


# -- operations ----------------------------------------------------------------------------------------------------


def _json_content(schema: str, examples: dict[str, Any]) -> dict[str, Any]:
    return {JSON: {"schema": _ref(schema), "examples": {k: {"value": v} for k, v in examples.items()}}}


def _ok(description: str, schema: str, example: Any, *headers: str) -> dict[str, Any]:
    return {
        "description": description,
        "headers": _headers(*headers),
        "content": _json_content(schema, {"ok": example}),
    }


def _error_responses(statuses: tuple[int, ...]) -> dict[str, Any]:
    out = {}
    for status in sorted(statuses):
        codes = ", ".join(f"`{c}`" for c in ERROR_CODES[status])
        headers = _headers("Retry-After") if status in (409, 429, 503) else _headers()
        out[str(status)] = {
            "description": f"Error envelope; codes at this status: {codes}.",
            "headers": headers,
            "content": _json_content("Error", {_ERROR_EXAMPLES[status][0]: _error_example(status)}),
        }
    return out


# What every protected route can answer before its handler runs (body limit, content type, key, scope, a store
# outage, a bug) and what the agent binding adds.
_KEYED_ERRORS = (401, 403, 413, 415, 500, 503)
_BOUND_ERRORS = (*_KEYED_ERRORS, 400)
_MEMORY_ERRORS = (*_BOUND_ERRORS, 429)


def _operation(
    operation_id: str,
    summary: str,
    tag: str,
    responses: dict[str, Any],
    *,
    errors: tuple[int, ...] = (),
    parameters: tuple[dict[str, Any], ...] = (),
    body: tuple[str, dict[str, Any]] | None = None,
    description: str | None = None,
    secured: bool = True,
) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": operation_id, "summary": summary, "tags": [tag]}
    if description:
        op["description"] = description
    if secured:
        op["security"] = [{"bearer": []}]
    op["parameters"] = [*parameters, _REQUEST_ID]
    if body is not None:
        op["requestBody"] = {"required": True, "content": _json_content(*body)}
    op["responses"] = {**responses, **_error_responses(errors)}
    return op


def _paths() -> dict[str, Any]:
    memory_created = {
        "description": "Written: the memory and the relationships the refinery found.",
        "headers": _headers("X-Idempotency-Replayed"),
        "content": _json_content("MemoryCreated", {"created": {"memory": _MEMORY_EXAMPLE, "relationships": []}}),
    }
    memory_dedup = {
        "description": "An exact duplicate of an active memory: nothing new was written.",
        "headers": _headers("X-Idempotency-Replayed"),
        "content": _json_content(
            "MemoryDeduplicated", {"duplicate": {"memory": _MEMORY_EXAMPLE, "deduplicated": "exact"}}
        ),
    }
    memory_quarantined = {
        "description": "Held for review (possible PII): never retrieved, content not echoed.",
        "headers": _headers("X-Idempotency-Replayed"),
        "content": _json_content("MemoryQuarantined", {"quarantined": {"memory": _QUARANTINED_EXAMPLE}}),
    }
    chat_ok = {
        "description": "The completion: JSON, or with `stream: true` server-sent events whose `data:` lines are "
        "`ChatCompletionChunk` objects, ending with `data: [DONE]`.",
        "headers": _headers(
            "X-IBEX-Session-ID",
            "X-RateLimit-Limit",
            "X-RateLimit-Remaining",
            "X-RateLimit-Reset",
            "X-IBEX-Memories-Injected",
            "X-IBEX-Context-Tokens",
            "X-IBEX-Context-Degraded",
            "X-Idempotency-Replayed",
            "X-IBEX-Fallback-Model",
        ),
        "content": {
            **_json_content("ChatCompletion", {"echo": _CHAT_EXAMPLE}),
            SSE: {
                "schema": {"type": "string"},
                "x-ibex-event-schema": _ref("ChatCompletionChunk"),
                "example": "data: " + orjson.dumps(_CHUNK_EXAMPLE).decode() + "\n\ndata: [DONE]\n\n",
            },
        },
    }

    def generation_ok(schema: str, event: str, example: Any, events: list[dict[str, Any]]) -> dict[str, Any]:
        sse = "".join(f"event: {e['type']}\ndata: {orjson.dumps(e).decode()}\n\n" for e in events)
        return {
            "description": f"The answer: JSON, or with `stream: true` server-sent events whose `data:` lines are "
            f"`{event}` objects.",
            "headers": chat_ok["headers"],
            "content": {
                **_json_content(schema, {"echo": example}),
                SSE: {"schema": {"type": "string"}, "x-ibex-event-schema": _ref(event), "example": sse},
            },
        }

    return {
        "/v1/chat/completions": {
            "post": _operation(
                "createChatCompletion",
                "OpenAI Chat Completions (JSON or SSE)",
                "chat",
                {"200": chat_ok},
                errors=(*_BOUND_ERRORS, 402, 404, 409, 422, 429, 502, 504),
                parameters=(_AGENT, _SESSION, _IDEMPOTENCY, _SKIP_MEMORY, _OBSERVED_AT),
                body=(
                    "ChatCompletionRequest",
                    {"hello": _CHAT_EXAMPLE_REQUEST, "stream": {**_CHAT_EXAMPLE_REQUEST, "stream": True}},
                ),
                description="Gates in order: body limit, content type, key and scope `chat`, agent binding, org and "
                "agent status, model policy, rate limit, validation, idempotency, budget hold, directive and session, "
                "memory context (degrades, never fails). `Idempotency-Key` applies to non-streaming requests. When an "
                "upstream refuses a request, its 4xx status comes back with `VALIDATION_ERROR` (400), "
                "`UNPROCESSABLE` (422) or `PROVIDER_ERROR` (any other).",
            )
        },
        "/v1/responses": {
            "post": _operation(
                "createResponse",
                "OpenAI Responses API (JSON or SSE), on the same pipeline as chat",
                "chat",
                {"200": generation_ok("Response", "ResponseStreamEvent", _RESPONSE_EXAMPLE, _RESPONSE_EVENTS)},
                errors=(*_BOUND_ERRORS, 402, 404, 409, 422, 429, 502, 504),
                parameters=(_AGENT, _SESSION, _IDEMPOTENCY, _SKIP_MEMORY, _OBSERVED_AT),
                body=("ResponsesRequest", {"hello": _RESPONSES_EXAMPLE_REQUEST}),
                description="The same gates, memory context, providers, budget and usage accounting as "
                "`/v1/chat/completions`; the body is translated to a chat completion and the answer back, so every "
                "provider serves it. With `store` (default true) the answer is kept for `GET /v1/responses/{id}`.",
            )
        },
        "/v1/responses/{response_id}": {
            "get": _operation(
                "getResponse",
                "A stored Responses API answer of this agent",
                "chat",
                {"200": _ok("The stored response.", "Response", _RESPONSE_EXAMPLE)},
                errors=(*_BOUND_ERRORS, 404),
                parameters=(_AGENT, _RESPONSE_ID),
                description="Answers are kept 30 days per agent: another agent's or organization's id is 404.",
            )
        },
        "/v1/embeddings": {
            "post": _operation(
                "createEmbeddings",
                "OpenAI embeddings: the built-in embedder or an upstream provider",
                "chat",
                {
                    "200": _ok(
                        "The vectors, in input order.",
                        "Embeddings",
                        _EMBEDDINGS_EXAMPLE,
                        "X-RateLimit-Limit",
                        "X-RateLimit-Remaining",
                        "X-RateLimit-Reset",
                        "X-IBEX-Fallback-Model",
                    )
                },
                errors=(*_BOUND_ERRORS, 402, 404, 422, 429, 502, 504),
                parameters=(_AGENT,),
                body=("EmbeddingsRequest", {"minilm": {"model": "ibex-minilm", "input": ["Hello"]}}),
                description="Gates: body limit, content type, key and scope `chat`, agent binding, org and agent "
                "status, model policy (an `embedding` model the organization allows), rate limit (the inputs' "
                "tokens), validation, budget hold. No memory context.",
            )
        },
        "/v1/messages": {
            "post": _operation(
                "createMessage",
                "Anthropic Messages wire format (JSON or SSE), on the same pipeline as chat",
                "chat",
                {"200": generation_ok("AnthropicMessage", "MessagesStreamEvent", _MESSAGE_EXAMPLE, _MESSAGE_EVENTS)},
                errors=(*_BOUND_ERRORS, 402, 404, 409, 422, 429, 502, 504),
                parameters=(_AGENT, _SESSION, _IDEMPOTENCY, _SKIP_MEMORY, _OBSERVED_AT),
                body=("MessagesRequest", {"hello": _MESSAGES_EXAMPLE_REQUEST}),
                description="For clients of the `anthropic` SDK (`base_url` the gateway, the IBEX key as `api_key`: "
                "it is accepted in `x-api-key` as well as `Authorization: Bearer`). Any catalogued model serves, "
                "Claude or not. Errors use the gateway's envelope.",
            )
        },
        "/v1/models": {
            "get": _operation(
                "listModels",
                "Models the key's organization may use (and the gateway can serve)",
                "chat",
                {
                    "200": _ok(
                        "The models.",
                        "ModelList",
                        {
                            "object": "list",
                            "data": [
                                {
                                    "id": "echo",
                                    "object": "model",
                                    "created": 1768210201,
                                    "owned_by": "echo",
                                    "context_window": 128000,
                                    "max_output_tokens": 16384,
                                    "kind": "chat",
                                }
                            ],
                        },
                    )
                },
                errors=(*_BOUND_ERRORS,),
                parameters=(_OPTIONAL_AGENT,),
            )
        },
        "/v1/memories": {
            "post": _operation(
                "createMemory",
                "Write one memory through the refinery",
                "memory",
                {"200": memory_dedup, "201": memory_created, "202": memory_quarantined},
                errors=(*_MEMORY_ERRORS, 409, 422),
                parameters=(_AGENT, _IDEMPOTENCY),
                body=(
                    "MemoryWrite",
                    {
                        "fact": {
                            "content": "The customer prefers email over phone calls.",
                            "labels": ["preferences"],
                            "metadata": {"channel": "support"},
                        }
                    },
                ),
                description="Validate, redact PII, deduplicate, embed, detect conflicts, persist. Needs "
                "`memory:write`; an agent with `memory.enabled: false` is refused (403).",
            ),
            "get": _operation(
                "listMemories",
                "List the agent's memories, newest first",
                "memory",
                {"200": _ok("One page.", "MemoryList", {"data": [_MEMORY_EXAMPLE], "next_cursor": None})},
                errors=_MEMORY_ERRORS,
                parameters=(
                    _AGENT,
                    {
                        "name": "status",
                        "in": "query",
                        "required": False,
                        "description": "Quarantined memories are listed only when asked for (review).",
                        "schema": {
                            "type": "string",
                            "enum": ["active", "superseded", "quarantined"],
                            "default": "active",
                        },
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
                    },
                    {
                        "name": "cursor",
                        "in": "query",
                        "required": False,
                        "description": "The `next_cursor` of the previous page.",
                        "schema": {"type": "string"},
                    },
                    {
                        "name": "source",
                        "in": "query",
                        "required": False,
                        "description": "Only memories of this source; `extracted`: captured from the agent's chats.",
                        "schema": {"type": "string", "enum": ["user_provided", "extracted", "imported"]},
                    },
                ),
                description="Other query parameters are refused (400).",
            ),
        },
        "/v1/memories:batch": {
            "post": _operation(
                "createMemories",
                "Write up to 100 memories; one result per item, in input order",
                "memory",
                {
                    "200": _ok(
                        "Per-item results.",
                        "BatchResponse",
                        {
                            "results": [
                                {"status": 201, "memory": _MEMORY_EXAMPLE, "relationships": []},
                                {
                                    "status": 400,
                                    "error": {
                                        "code": "VALIDATION_ERROR",
                                        "message": "the request is invalid",
                                        "field_errors": [{"field": "items[1].content", "message": "must not be empty"}],
                                    },
                                },
                            ]
                        },
                        "X-Idempotency-Replayed",
                    )
                },
                errors=(*_MEMORY_ERRORS, 409),
                parameters=(_AGENT, _IDEMPOTENCY),
                body=(
                    "BatchWrite",
                    {"two": {"items": [{"content": "The customer prefers email over phone calls."}, {"content": " "}]}},
                ),
            )
        },
        "/v1/memories/search": {
            "post": _operation(
                "searchMemories",
                "Ranked hybrid search over the agent's active, currently valid memories",
                "memory",
                {
                    "200": _ok(
                        "Hits, best first.",
                        "SearchResponse",
                        {
                            "results": [
                                {
                                    "memory": _MEMORY_EXAMPLE,
                                    "score": 0.61,
                                    "matched_by": "both",
                                    "components": {
                                        "relevance": 0.72,
                                        "recency": 0.98,
                                        "usefulness": 0.5,
                                        "confidence": 1.0,
                                        "frequency": 0.0,
                                    },
                                }
                            ]
                        },
                    )
                },
                errors=_MEMORY_ERRORS,
                parameters=(_AGENT,),
                body=("SearchRequest", {"question": {"query": "How should we contact the customer?", "limit": 5}}),
            )
        },
        "/v1/memories/{memory_id}": {
            "get": _operation(
                "getMemory",
                "One memory (also superseded or quarantined ones)",
                "memory",
                {"200": _ok("The memory.", "OneMemory", {"memory": _MEMORY_EXAMPLE})},
                errors=(*_MEMORY_ERRORS, 404),
                parameters=(_MEMORY_ID, _AGENT),
            ),
            "delete": _operation(
                "forgetMemory",
                "Forget a memory (tombstone: content and embedding erased)",
                "memory",
                {"204": {"description": "Forgotten.", "headers": _headers("X-Idempotency-Replayed")}},
                errors=(*_MEMORY_ERRORS, 404, 409),
                parameters=(_MEMORY_ID, _AGENT, _IDEMPOTENCY),
                description="Needs `memory:delete`. Forgetting it again is 404.",
            ),
        },
        "/v1/memories/{memory_id}/feedback": {
            "post": _operation(
                "memoryFeedback",
                "Usefulness feedback on a memory",
                "memory",
                {
                    "200": _ok(
                        "The memory with its new usefulness.",
                        "OneMemory",
                        {"memory": _MEMORY_EXAMPLE},
                        "X-Idempotency-Replayed",
                    )
                },
                errors=(*_MEMORY_ERRORS, 404, 409),
                parameters=(_MEMORY_ID, _AGENT, _IDEMPOTENCY),
                body=("Feedback", {"useful": {"useful": True}, "signal": {"signal": "negative"}}),
            )
        },
        "/v1/sessions/{session_id}/terminate": {
            "post": _operation(
                "terminateSession",
                "End a session",
                "chat",
                {"200": _ok("Closed.", "SessionClosed", {"id": "sess_7c1e", "status": "closed"})},
                errors=(*_BOUND_ERRORS, 404),
                parameters=(
                    {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}},
                    _AGENT,
                ),
                description="No body. An unknown, already closed or malformed session id is 404.",
            )
        },
        "/v1/usage": {
            "get": _operation(
                "getUsage",
                "The organization's spend and tokens by agent, model or day",
                "tenancy",
                {
                    "200": _ok(
                        "Usage rows in [from, to).",
                        "Usage",
                        {
                            "object": "usage",
                            "org_id": _EXAMPLE_ORG,
                            "group_by": "agent",
                            "from": "2026-01-01",
                            "to": "2026-01-13",
                            "data": [
                                {
                                    "key": _EXAMPLE_AGENT,
                                    "agent_name": "support-bot",
                                    "requests": 3,
                                    "prompt_tokens": 36,
                                    "completion_tokens": 42,
                                    "cost_usd": "0.000120",
                                }
                            ],
                        },
                    )
                },
                errors=(*_KEYED_ERRORS, 400),
                parameters=(
                    {
                        "name": "group_by",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": ["agent", "model", "day"], "default": "agent"},
                    },
                    {
                        "name": "from",
                        "in": "query",
                        "required": False,
                        "description": "First day (default: the first of this month, UTC).",
                        "schema": {"type": "string", "format": "date"},
                    },
                    {
                        "name": "to",
                        "in": "query",
                        "required": False,
                        "description": "Day after the last one (default: tomorrow, UTC); must be after `from`.",
                        "schema": {"type": "string", "format": "date"},
                    },
                ),
                description="Needs `usage:read`; no agent header.",
            )
        },
        "/v1/me": {
            "get": _operation(
                "whoAmI",
                "Who the key is: organization, key id, scopes, agents it may act as",
                "tenancy",
                {
                    "200": _ok(
                        "The key.",
                        "Me",
                        {
                            "org_id": _EXAMPLE_ORG,
                            "org_name": "acme",
                            "key_id": _EXAMPLE_KEY,
                            "scopes": ["chat", "memory:read"],
                            "agents": [{"id": _EXAMPLE_AGENT, "name": "support-bot", "suspended": False}],
                        },
                    )
                },
                errors=(401, 413, 415, 500, 503),
                description="Any valid key; no scope needed.",
            )
        },
        "/v1/orgs/{org_id}/auth-probe": {
            "get": _operation(
                "authProbe",
                "Diagnostic: the organization in the path must be the key's",
                "tenancy",
                {
                    "200": _ok(
                        "Same organization.", "AuthProbe", {"ok": True, "org_id": _EXAMPLE_ORG, "key_id": _EXAMPLE_KEY}
                    )
                },
                errors=(401, 403, 413, 415, 500, 503),
                parameters=({"name": "org_id", "in": "path", "required": True, "schema": {"type": "string"}},),
                description="Any valid key; another organization's id is 403 `PATH_ORG_MISMATCH`.",
            )
        },
        "/healthz": {
            "get": _operation(
                "healthz",
                "Liveness: answers while the process runs",
                "operations",
                {"200": _ok("Alive.", "Health", {"status": "ok"})},
                secured=False,
            )
        },
        "/readyz": {
            "get": _operation(
                "readyz",
                "Readiness: Postgres and Redis answer (ClickHouse is reported, and only degrades)",
                "operations",
                {
                    "200": {
                        "description": "Ready; a degradable store that fails its check is listed under `degraded`.",
                        "headers": _headers(),
                        "content": _json_content(
                            "Readiness",
                            {
                                "ready": {
                                    "status": "ready",
                                    "checks": {"postgres": "ok", "redis": "ok", "clickhouse": "ok"},
                                },
                                "analytics_degraded": {
                                    "status": "ready",
                                    "checks": {
                                        "postgres": "ok",
                                        "redis": "ok",
                                        "clickhouse": "error: ClickHouseUnavailable",
                                    },
                                    "degraded": ["clickhouse"],
                                },
                            },
                        ),
                    },
                    "503": {
                        "description": "Not ready: the failing checks say which store (this body is not an error "
                        "envelope).",
                        "headers": _headers(),
                        "content": _json_content(
                            "Readiness",
                            {
                                "postgres": {
                                    "status": "not ready",
                                    "checks": {
                                        "postgres": "error: StoreUnavailable",
                                        "redis": "ok",
                                        "clickhouse": "ok",
                                    },
                                }
                            },
                        ),
                    },
                },
                secured=False,
            )
        },
        "/metrics": {
            "get": _operation(
                "metrics",
                "Prometheus metrics (text exposition format)",
                "operations",
                {
                    "200": {
                        "description": "Metrics.",
                        "headers": _headers(),
                        "content": {
                            "text/plain": {
                                "schema": {"type": "string"},
                                "example": 'ibex_proxy_gate_seconds_count{gate="api_key"} 3.0\n',
                            }
                        },
                    }
                },
                secured=False,
            )
        },
        "/openapi.json": {
            "get": _operation(
                "openapi",
                "This document",
                "operations",
                {
                    "200": {
                        "description": "OpenAPI 3.1.",
                        "headers": _headers(),
                        "content": {
                            JSON: {
                                "schema": {"type": "object", "required": ["openapi", "info", "paths"]},
                                "example": {"openapi": "3.1.0", "info": {"title": "IBEX Harness proxy"}, "paths": {}},
                            }
                        },
                    }
                },
                secured=False,
            )
        },
    }


_MCP_SESSION = _header(
    "Mcp-Session-Id", "The session `initialize` answered with; required on every other message.",
    schema={"type": "string", "minLength": 16, "maxLength": 128},
)  # fmt: skip
_MCP_VERSION = _header(
    "MCP-Protocol-Version", "When sent, the protocol revision the session negotiated (`2025-11-25` or `2025-06-18`).",
    schema={"type": "string", "enum": ["2025-11-25", "2025-06-18"]},
)  # fmt: skip
_MCP_INITIALIZE = {
    "jsonrpc": "2.0", "id": 0, "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "a-client", "version": "1"}},
}  # fmt: skip
_MCP_SEARCH = {
    "jsonrpc": "2.0", "id": 2, "method": "tools/call",
    "params": {"name": "search_memory", "arguments": {"query": "How should we contact the customer?", "limit": 5}},
}  # fmt: skip
_MCP_INITIALIZED = {
    "jsonrpc": "2.0", "id": 0,
    "result": {
        "protocolVersion": "2025-11-25",
        "capabilities": {"tools": {"listChanged": False}, "resources": {"subscribe": False, "listChanged": False}},
        "serverInfo": {"name": "ibex-harness", "title": "IBEX Harness memory", "version": "0.1.0"},
        "instructions": "Memory of this agent, kept by IBEX Harness. ...",
    },
}  # fmt: skip
_MCP_TOOL_ERROR = {
    "jsonrpc": "2.0", "id": 2,
    "result": {
        "content": [{"type": "text", "text": "INSUFFICIENT_PERMISSIONS: this API key lacks the 'memory:write' scope"}],
        "structuredContent": {"error": {"code": "INSUFFICIENT_PERMISSIONS", "status": 403, "request_id":
                              _EXAMPLE_REQUEST, "message": "this API key lacks the 'memory:write' scope"}},
        "isError": True,
    },
}  # fmt: skip
_MCP_NO_SESSION = {
    "jsonrpc": "2.0", "id": 1,
    "error": {"code": -32600, "message": "the Mcp-Session-Id header is required: send initialize first"},
}  # fmt: skip
_MCP_UNKNOWN_SESSION = {
    "jsonrpc": "2.0", "id": 1, "error": {"code": -32600, "message": "unknown or expired MCP session: initialize again"}
}  # fmt: skip
_MCP_PROGRESS = {
    "jsonrpc": "2.0", "method": "notifications/progress",
    "params": {"progressToken": "p1", "progress": 0, "total": 1, "message": "calling the memory stage"},
}  # fmt: skip


def _mcp_refusals(gate_errors: tuple[int, ...]) -> dict[str, Any]:
    """The gates' envelope errors, and the transport's JSON-RPC errors at 400 (beside the gates') and 404."""
    out = _error_responses(gate_errors)
    envelope = out["400"]["content"][JSON]
    out["400"] = {
        "description": "The gates' envelope (`MISSING_AGENT_ID`), or a JSON-RPC error: not JSON, not one JSON-RPC "
        "message, no `Mcp-Session-Id`, or another protocol revision than the session's.",
        "headers": _headers(),
        "content": {
            JSON: {
                "schema": {"oneOf": [_ref("Error"), _ref("JsonRpcError")]},
                "examples": {**envelope["examples"], "no_session": {"value": _MCP_NO_SESSION}},
            }
        },
    }
    out["404"] = {
        "description": "A JSON-RPC error: the session is unknown, expired, ended, or another key's or agent's.",
        "headers": _headers(),
        "content": _json_content("JsonRpcError", {"unknown_session": _MCP_UNKNOWN_SESSION}),
    }
    return out


def _mcp_paths() -> dict[str, Any]:
    gate_errors = (*_MEMORY_ERRORS,)
    rate_headers = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")
    post = _operation(
        "mcpMessage",
        "MCP streamable HTTP: one JSON-RPC message per POST",
        "mcp",
        {
            "200": {
                "description": "The answer to a request: JSON, or (for a `tools/call` with `_meta.progressToken` from "
                "a client accepting `text/event-stream`) server-sent events: progress notifications, then the answer. "
                "`initialize` also sets `Mcp-Session-Id`.",
                "headers": {
                    **_headers(*rate_headers),
                    "Mcp-Session-Id": {
                        "description": "The new session (on `initialize`).",
                        "schema": {"type": "string"},
                    },
                },
                "content": {
                    JSON: {
                        "schema": _ref("JsonRpcAnswer"),
                        "examples": {
                            "initialized": {"value": _MCP_INITIALIZED},
                            "tool_error": {"value": _MCP_TOOL_ERROR},
                        },
                    },
                    SSE: {
                        "schema": {"type": "string"},
                        "x-ibex-event-schema": _ref("JsonRpcMessage"),
                        "example": "event: message\ndata: "
                        + orjson.dumps(_MCP_PROGRESS).decode()
                        + "\n\nevent: message\n"
                        "data: " + orjson.dumps(_MCP_TOOL_ERROR).decode() + "\n\n",
                    },
                },
            },
            "202": {
                "description": "A notification (or an answer to the server) was accepted; no body.",
                "headers": _headers(*rate_headers),
            },
        },
        errors=(),
        parameters=(_AGENT, _MCP_SESSION, _MCP_VERSION),
        body=("JsonRpcMessage", {"initialize": _MCP_INITIALIZE, "search": _MCP_SEARCH}),
        description="The memory routes' gates first (body limit, content type, key, agent binding, org and agent "
        "status, rate limit; their refusals are the error envelope, a 401 pointing to the protected-resource "
        "metadata), then the message. Tools: `search_memory`, `write_memory`, `forget_memory`, `list_memories`, "
        "`record_feedback`, each with the scope of its memory route; their refusals are tool results with "
        "`isError: true` carrying the envelope code. Resources: `ibex://memories/recent`, `ibex://memories/{id}`. "
        "Protocol revisions `2025-11-25` and `2025-06-18`. See docs/mcp.md.",
    )
    post["responses"].update(_mcp_refusals(gate_errors))
    delete = _operation(
        "mcpEndSession",
        "End an MCP session",
        "mcp",
        {"204": {"description": "Ended.", "headers": _headers(*rate_headers)}},
        parameters=(_AGENT, _MCP_SESSION),
    )
    delete["responses"].update(_mcp_refusals(gate_errors))
    metadata = _operation(
        "protectedResourceMetadata",
        "OAuth protected-resource metadata of /mcp (RFC 9728): bearer API keys in the Authorization header",
        "mcp",
        {
            "200": _ok(
                "The metadata.",
                "ProtectedResourceMetadata",
                {
                    "resource": "http://127.0.0.1:8080/mcp",
                    "resource_name": "IBEX Harness memory (MCP)",
                    "bearer_methods_supported": ["header"],
                    "scopes_supported": ["memory:read", "memory:write", "memory:delete"],
                },
            )
        },
        secured=False,
        description="No authorization server: the bearer is an IBEX API key (`ibex_sk_...`).",
    )
    return {
        "/mcp": {"post": post, "delete": delete},
        "/.well-known/oauth-protected-resource": {"get": metadata},
        "/.well-known/oauth-protected-resource/mcp": {
            "get": {**metadata, "operationId": "protectedResourceMetadataMcp"}
        },
    }


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "IBEX Harness proxy",
            "version": "v1",
            "description": "The OpenAI-compatible gateway and memory API. Every error body is the `Error` envelope; "
            "every response carries `X-Request-ID`.",
        },
        "tags": [
            {"name": "chat", "description": "Model calls (scope `chat`)."},
            {"name": "memory", "description": "The agent's memories (scopes `memory:read`, `:write`, `:delete`)."},
            {"name": "tenancy", "description": "Who the key is, and what the organization spent."},
            {
                "name": "mcp",
                "description": "The memory tools over the Model Context Protocol (memory scopes per tool).",
            },
            {"name": "operations", "description": "Health, readiness, metrics and this document (no key)."},
        ],
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "An API key, `ibex_sk_<id>_<secret>`."}
            },
            "headers": _HEADERS,
            "schemas": SCHEMAS,
        },
        "paths": {**_paths(), **_mcp_paths()},
    }
