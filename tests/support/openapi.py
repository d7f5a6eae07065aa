"""Reading the proxy's OpenAPI document in tests: its operations, and JSON Schema validators for its schemas."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

DOC_URI = "urn:ibex:openapi"
METHODS = ("get", "post", "put", "patch", "delete")


def operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(method, path template, operation object) of every documented operation."""
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                yield method, path, op


def escape(token: str) -> str:
    """One JSON Pointer reference token."""
    return token.replace("~", "~0").replace("/", "~1")


def schema_validator(doc: dict[str, Any], pointer: str) -> jsonschema.protocols.Validator:
    """A JSON Schema 2020-12 validator for the schema at ``pointer`` in the document (its $refs resolve there)."""
    registry: Registry[Any] = Registry().with_resource(DOC_URI, Resource.from_contents(doc, DRAFT202012))
    return jsonschema.Draft202012Validator(
        {"$ref": f"{DOC_URI}#{pointer}"}, registry=registry, format_checker=jsonschema.FormatChecker()
    )
