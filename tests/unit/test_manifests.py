"""Local tenant manifests: the shipped examples are valid, and invalid ones are rejected precisely."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from ibex_operator.manifests import ManifestError, load_manifests
from ibex_operator.models import Agent, ApiKey, Directive, Organization

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tenants"

ORG = """\
apiVersion: ibex.dev/v1alpha1
kind: Organization
metadata: {name: acme, namespace: tenants}
spec: {models: {default: echo}}
"""


def test_examples_hold_two_organizations_each_with_two_agents_a_directive_and_keys() -> None:
    manifests = load_manifests(EXAMPLES)
    resources = [m.resource for m in manifests]
    orgs = [r for r in resources if isinstance(r, Organization)]
    assert len(orgs) >= 2
    for org in orgs:
        assert org.spec.models.default == "echo"
        agents = [r for r in resources if isinstance(r, Agent) and r.spec.organization_ref.name == org.metadata.name]
        assert len(agents) >= 2
        assert all(a.spec.default_model == "echo" for a in agents)
        agent_names = {a.metadata.name for a in agents}
        assert any(isinstance(r, Directive) and r.spec.agent_ref.name in agent_names for r in resources)
        keys = [r for r in resources if isinstance(r, ApiKey) and r.spec.organization_ref.name == org.metadata.name]
        assert keys
    # Apply order: every kind after the kinds it references.
    order = [m.resource.kind for m in manifests]
    assert order == sorted(order, key=["Organization", "Agent", "Directive", "ApiKey"].index)


def write(tmp_path: Path, text: str, name: str = "tenant.yaml") -> Path:
    (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (
            "kind: Agent\nmetadata: {name: bot, namespace: tenants}\n"
            "spec: {organizationRef: {name: acme}, memory: {contextTokens: -5}}",
            ["Agent tenants/bot", "spec.memory.contextTokens", "greater than or equal to 0"],
        ),
        (
            "kind: Agent\nmetadata: {name: bot, namespace: tenants}\nspec: {displayName: x}",
            ["Agent tenants/bot", "spec.organizationRef", "Field required"],
        ),
        (
            "kind: Directive\nmetadata: {name: d, namespace: tenants}\n"
            "spec: {agentRef: {name: bot}, content: hi, injectionMode: SystemLast}",
            ["Directive tenants/d", "spec.injectionMode", "SystemFirst"],
        ),
        (
            "kind: ApiKey\nmetadata: {name: k, namespace: tenants}\n"
            "spec: {organizationRef: {name: acme}, agentRefs: [], scopes: [chat], secretName: k}",
            ["ApiKey tenants/k", "spec.agentRefs", "at least 1"],
        ),
        (
            "kind: ApiKey\nmetadata: {name: k, namespace: tenants}\n"
            "spec: {organizationRef: {name: acme}, agentRefs: [{name: a}], scopes: [chat, admin], secretName: k}",
            ["ApiKey tenants/k", "spec.scopes[1]"],
        ),
        (
            "kind: Organization\nmetadata: {name: acme, namespace: tenants}\n"
            "spec: {budget: {monthlyLimitUSD: 'lots'}, colour: blue}",
            ["Organization tenants/acme", "spec.budget.monthlyLimitUSD", "spec.colour", "Extra inputs"],
        ),
        (
            "kind: Organization\nmetadata: {name: Not_A_Name}\nspec: {}",
            ["Organization default/Not_A_Name", "metadata.name"],
        ),
    ],
)
def test_invalid_manifests_name_the_file_the_resource_and_the_field(
    tmp_path: Path, doc: str, expected: list[str]
) -> None:
    folder = write(tmp_path, "apiVersion: ibex.dev/v1alpha1\n" + doc)
    with pytest.raises(ManifestError) as err:
        load_manifests(folder)
    message = str(err.value)
    assert str(folder / "tenant.yaml") in message
    for fragment in expected:
        assert fragment in message


def test_unknown_version_and_kind_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"field apiVersion: unsupported version 'ibex.dev/v2'"):
        load_manifests(write(tmp_path, ORG.replace("v1alpha1", "v2")))
    with pytest.raises(ManifestError, match=r"field kind: unknown kind 'Tenant'"):
        load_manifests(write(tmp_path, ORG.replace("Organization", "Tenant")))


def test_broken_yaml_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"bad\.yaml: not valid YAML"):
        load_manifests(write(tmp_path, "kind: [unclosed\n", "bad.yaml"))


def test_a_resource_defined_twice_is_refused(tmp_path: Path) -> None:
    write(tmp_path, ORG, "a.yaml")
    write(tmp_path, ORG, "b.yaml")
    with pytest.raises(ManifestError, match=r"Organization tenants/acme: defined twice"):
        load_manifests(tmp_path)


def test_other_kubernetes_objects_are_ignored(tmp_path: Path) -> None:
    write(tmp_path, "apiVersion: v1\nkind: Namespace\nmetadata: {name: tenants}\n---\n" + ORG)
    manifests = load_manifests(tmp_path)
    assert [m.ref for m in manifests] == ["Organization tenants/acme"]
    assert Counter(m.resource.kind for m in manifests) == {"Organization": 1}
