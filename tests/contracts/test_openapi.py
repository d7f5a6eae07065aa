"""The OpenAPI document describes exactly the routes the proxy serves, and is a valid OpenAPI 3.1 document."""

from __future__ import annotations

from typing import Any

from openapi_spec_validator import validate

from ibex_dataplane.proxy.app import create_app
from ibex_dataplane.proxy.openapi import openapi_document
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.settings import Settings


def served_routes(settings: Settings, stores: Stores) -> set[tuple[str, str]]:
    app = create_app(settings, stores, pepper=b"x" * 32)
    routes = set()
    for route in app.router.routes():
        info: dict[str, Any] = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path and route.method not in ("HEAD", "*"):
            routes.add((route.method.lower(), path))
    return routes


async def test_every_served_route_is_documented_and_nothing_else(settings: Settings, stores: Stores) -> None:
    doc = openapi_document()
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert served_routes(settings, stores) == documented


def test_the_document_is_valid_openapi() -> None:
    validate(openapi_document())
