"""The documentation stands alone and stays true: every relative link (and anchor) resolves, the troubleshooting
guide covers every error code a caller can meet (the orders docs/architecture.md gives are checked against the
running code in tests/integration/test_architecture_doc.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ibex_dataplane.shared.errors import ERROR_CODES

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", REPO / "charts" / "ibex" / "README.md", *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to hyphens."""
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", markdown), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_to_a_file_and_anchor(doc: Path) -> None:
    assert [target for target in links(doc) if not resolves(doc, target)] == []


def resolves(doc: Path, target: str) -> bool:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked offline
        return True
    file, _, anchor = target.partition("#")
    resolved = (doc.parent / file).resolve() if file else doc
    if not resolved.exists():
        return False
    return not anchor or resolved.suffix != ".md" or anchor in anchors(resolved.read_text())


def test_the_link_check_finds_links_and_would_catch_a_broken_one() -> None:
    readme = REPO / "README.md"
    assert any("architecture.md" in t for t in links(readme))
    assert resolves(readme, "docs/architecture.md#the-protected-path")
    assert not resolves(readme, "docs/architecture.md#no-such-heading")
    assert not resolves(readme, "docs/no-such-file.md")


def test_no_doc_cites_an_outside_architecture_contract_or_its_sections() -> None:
    for doc in DOCS:
        text = doc.read_text()
        assert "architecture contract" not in text.lower(), doc
        assert not re.search(r"\barchitecture,? section \d", text), doc


def test_troubleshooting_covers_every_error_code() -> None:
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    missing = [code for codes in ERROR_CODES.values() for code in codes if f"`{code}`" not in text]
    assert missing == []
