"""The bounds of memory input, in one place: the memory stage's validation enforces them, and the proxy's MCP tool
schemas state them to clients (the stages never import one another, so both read them from here)."""

from __future__ import annotations

from typing import Final

MAX_CONTENT_BYTES: Final = 10_000
MAX_LABELS: Final = 5
MAX_LABEL_CHARS: Final = 64
MAX_METADATA_BYTES: Final = 16_384
MAX_METADATA_DEPTH: Final = 6
MAX_QUERY_BYTES: Final = 2_000
DEFAULT_SEARCH_LIMIT: Final = 10
MAX_SEARCH_LIMIT: Final = 50
DEFAULT_LIST_LIMIT: Final = 20
MAX_LIST_LIMIT: Final = 100
MAX_BATCH_ITEMS: Final = 100
SESSION_ID_PATTERN: Final = r"^[A-Za-z0-9._:\-]{1,128}$"
