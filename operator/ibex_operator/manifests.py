"""Local tenant manifests: the same YAML ``kubectl apply`` takes, validated and reconciled without Kubernetes.

``ibex dev`` loads a folder of ``*.yaml``/``*.yml`` files (multi-document), validates every document with the
models the operator uses, and applies them through the same :class:`~ibex_operator.reconcile.Reconciler`, kinds in
dependency order. An invalid manifest stops everything with a message naming the file, the resource and the field.
Documents of other API groups (a Namespace, a ConfigMap) are skipped, as an operator would ignore them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from ibex_operator.models import API_VERSION, GROUP, KIND_ORDER, Agent, ApiKey, Directive, Organization, Resource
from ibex_operator.reconcile import Reconciler
from ibex_operator.status import ReconcileOutcome

_RESOURCE: TypeAdapter[Organization | Agent | Directive | ApiKey] = TypeAdapter(Resource)


class ManifestError(ValueError):
    """A manifest cannot be used; the message names the file, the resource and the field."""


@dataclass(frozen=True)
class LoadedManifest:
    path: Path
    index: int  # document number within the file, from 1
    resource: Organization | Agent | Directive | ApiKey

    @property
    def ref(self) -> str:
        m = self.resource.metadata
        return f"{self.resource.kind} {m.namespace}/{m.name}"


def _field_path(loc: Iterable[int | str]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "(document)"


def _describe(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    assert isinstance(meta, dict)
    return f"{doc.get('kind', '?')} {meta.get('namespace', 'default')}/{meta.get('name', '?')}"


def parse_document(path: Path, index: int, doc: Any) -> LoadedManifest | None:
    where = f"{path} (document {index})"
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: a manifest must be a mapping, got {type(doc).__name__}")
    api_version = doc.get("apiVersion")
    if not isinstance(api_version, str) or not api_version.startswith(f"{GROUP}/"):
        return None  # not ours
    if api_version != API_VERSION:
        raise ManifestError(f"{where}: {_describe(doc)}: field apiVersion: unsupported version {api_version!r}")
    kind = doc.get("kind")
    if kind not in KIND_ORDER:
        raise ManifestError(f"{where}: field kind: unknown kind {kind!r} (expected one of {', '.join(KIND_ORDER)})")
    try:
        resource = _RESOURCE.validate_python(doc)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = list(err["loc"])
            if loc and loc[0] == kind:
                loc = loc[1:]
            problems.append(f"field {_field_path(loc)}: {err['msg']}")
        raise ManifestError(f"{path}: {_describe(doc)}: " + "; ".join(problems)) from None
    return LoadedManifest(path, index, resource)


def load_file(path: Path) -> list[LoadedManifest]:
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
    except yaml.YAMLError as e:
        raise ManifestError(f"{path}: not valid YAML: {e}") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read: {e.strerror}") from None
    loaded = [parse_document(path, i, doc) for i, doc in enumerate(docs, start=1)]
    return [m for m in loaded if m is not None]


def load_manifests(folder: Path) -> list[LoadedManifest]:
    """Every IBEX resource in the folder's YAML files, validated, sorted in apply order; duplicates refused."""
    if not folder.is_dir():
        raise ManifestError(f"{folder}: manifest folder does not exist")
    found: list[LoadedManifest] = []
    for path in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
        found.extend(load_file(path))
    seen: dict[str, Path] = {}
    for m in found:
        if m.ref in seen:
            raise ManifestError(f"{m.path}: {m.ref}: defined twice (also in {seen[m.ref]})")
        seen[m.ref] = m.path
    found.sort(key=lambda m: KIND_ORDER.index(m.resource.kind))
    return found


async def apply_manifests(reconciler: Reconciler, manifests: list[LoadedManifest]) -> list[ReconcileOutcome]:
    """Reconcile each resource once, in dependency order; returns one outcome per resource."""
    outcomes: list[ReconcileOutcome] = []
    for m in manifests:
        r = m.resource
        ns, name, gen = r.metadata.namespace, r.metadata.name, r.metadata.generation
        if isinstance(r, Organization):
            outcomes.append(await reconciler.organization(ns, name, r.spec, generation=gen))
        elif isinstance(r, Agent):
            outcomes.append(await reconciler.agent(ns, name, r.spec, generation=gen))
        elif isinstance(r, Directive):
            outcomes.append(await reconciler.directive(ns, name, r.spec, generation=gen))
        else:
            outcomes.append(await reconciler.api_key(ns, name, r.spec, generation=gen))
    return outcomes
