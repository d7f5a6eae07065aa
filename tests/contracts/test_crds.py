"""The committed CRDs (``crds/`` and the chart's copies) are exactly what the pydantic models generate."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from ibex_operator import crdgen
from ibex_operator.models import GROUP, KIND_ORDER, PLURALS, SPEC_MODELS

REPO = Path(__file__).resolve().parents[2]
REGENERATE = "python -m ibex_operator.crdgen"


def test_committed_crds_match_the_models() -> None:
    expected = crdgen.render(REPO)
    problems: list[str] = []
    for path, text in expected.items():
        rel = path.relative_to(REPO)
        if not path.exists():
            problems.append(f"{rel} is missing")
            continue
        committed = path.read_text()
        if committed != text:
            diff = "".join(
                difflib.unified_diff(
                    committed.splitlines(keepends=True), text.splitlines(keepends=True), str(rel), "generated", n=1
                )
            )
            problems.append(f"{rel} differs from the models:\n{diff[:3000]}")
    assert not problems, f"run `{REGENERATE}`:\n" + "\n".join(problems)


def test_no_stale_generated_crds_are_left_behind() -> None:
    expected = set(crdgen.render(REPO))
    for folder in (REPO / "crds", REPO / "charts" / "ibex" / "templates" / "crds"):
        stale = {p for p in folder.glob("*.yaml") if p not in expected}
        assert not stale, f"not generated from the models any more (delete them): {sorted(map(str, stale))}"


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, sub in node.get("properties", {}).items():
            found.extend(_walk(sub, f"{path}.{key}"))
        if "items" in node:
            found.extend(_walk(node["items"], f"{path}[]"))
    return found


def test_every_crd_is_structural_for_kubernetes_1_20() -> None:
    for kind in KIND_ORDER:
        doc = yaml.safe_load((REPO / "crds" / crdgen.file_name(kind)).read_text())
        assert doc["metadata"]["name"] == f"{PLURALS[kind]}.{GROUP}"
        (version,) = doc["spec"]["versions"]
        assert version["subresources"] == {"status": {}}
        columns = [c["name"] for c in version["additionalPrinterColumns"]]
        assert columns[0] == "Ready" and columns[-1] == "Age" and len(columns) >= 4, columns
        schema = version["schema"]["openAPIV3Schema"]
        for path, node in _walk(schema):
            assert "type" in node, f"{kind}{path}: no type"
            for banned in ("$ref", "anyOf", "oneOf", "allOf", "not", "x-kubernetes-validations", "uniqueItems"):
                assert banned not in node, f"{kind}{path}: {banned} is not structural / not on 1.20"
            assert node.get("additionalProperties") in (None,), f"{kind}{path}: additionalProperties"
        # every spec field the model knows is in the schema, under its camelCase name
        spec_props = set(schema["properties"]["spec"]["properties"])
        model_fields = {f.alias or name for name, f in SPEC_MODELS[kind].model_fields.items()}
        assert spec_props == model_fields


def test_the_chart_templates_wrap_the_same_crds_behind_a_switch() -> None:
    for kind in KIND_ORDER:
        template = (REPO / "charts" / "ibex" / "templates" / "crds" / crdgen.file_name(kind)).read_text()
        assert template.startswith("{{- if .Values.crds.install }}\n")
        assert template.rstrip().endswith("{{- end }}")
        plain = yaml.safe_load((REPO / "crds" / crdgen.file_name(kind)).read_text())
        spec_text = template.split("\nspec:\n", 1)[1].rsplit("{{- end }}", 1)[0]
        assert yaml.safe_load("spec:\n" + spec_text)["spec"] == plain["spec"]
