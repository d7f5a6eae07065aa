"""The README's configuration table lists every IBEX_ setting with its real default, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import SecretStr

from ibex_dataplane.settings import Settings

README = Path(__file__).resolve().parents[2] / "README.md"


def expected_rows() -> dict[str, str]:
    rows = {}
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "" if default is None or isinstance(default, SecretStr) else f"`{default}`"
        rows[f"IBEX_{name.upper()}"] = shown
    return rows


def test_readme_configuration_table_matches_settings() -> None:
    documented = {
        m.group(1): m.group(2).strip()
        for m in re.finditer(r"^\| `(IBEX_[A-Z0-9_]+)` \|([^|]*)\|", README.read_text(), re.MULTILINE)
    }
    expected = expected_rows()
    table = "\n".join(
        f"| `{k}` | {v} | {Settings.model_fields[k.removeprefix('IBEX_').lower()].description} |"
        for k, v in expected.items()
    )
    assert documented == expected, "README configuration table is out of date; expected rows:\n" + table


def test_every_setting_has_a_description() -> None:
    assert all(f.description for f in Settings.model_fields.values())
