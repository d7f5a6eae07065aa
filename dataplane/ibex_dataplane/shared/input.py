"""Checks every stage applies to decoded client JSON before it can reach a store.

Postgres ``text`` and ``jsonb`` cannot hold the NUL character (U+0000): a string carrying one would fail deep in a
statement and surface as a 500. :func:`nul_path` finds the first such string (keys included) so the edge can
answer 400 ``VALIDATION_ERROR`` naming the field. Called by the memory stage's request decoding.
"""

from __future__ import annotations

from typing import Any


def nul_path(value: Any, path: str = "") -> str | None:
    """The JSON path (``content``, ``items[3].metadata.k``) of the first string containing U+0000, else None."""
    if isinstance(value, str):
        return (path or "body") if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if "\x00" in str(key):
                return here
            found = nul_path(item, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = nul_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None
