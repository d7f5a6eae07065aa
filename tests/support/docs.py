"""Reading the repository's Markdown docs in tests."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def table_column(doc: str, heading: str) -> list[str]:
    """The backticked names in the first column of the table(s) under ``## heading`` of ``docs/<doc>``."""
    text = (REPO / "docs" / doc).read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE)
