"""The Helm chart: lint-clean, renders valid Kubernetes objects, installs into the 1.20 apiserver, and its RBAC is
both sufficient (an operator running with the chart's ServiceAccount token reconciles an ApiKey end to end) and
narrow (no Secret listing or deletion, nothing outside what the operator does). The kind example (examples/kind),
which CI cannot run, is checked as far as it can be: its script parses and names files that exist, its values
render valid objects, its stores manifest is valid."""

from __future__ import annotations

import base64
import json
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kubernetes_validate
import pytest
import yaml

from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import Stores
from ibex_operator.models import GROUP, KIND_ORDER, PLURALS
from tests.operator.support import REPO, apply, events, spawn_operator, wait_condition
from tests.operator.test_resources import agent, api_key, into, org, secret_token

if TYPE_CHECKING:
    from tests.operator.conftest import KubeApiserver

CHART = REPO / "charts" / "ibex"
CRD_NAMES = [f"{PLURALS[k]}.{GROUP}" for k in KIND_ORDER]
EVERYTHING_ON = (
    "--set", "serviceMonitor.enabled=true,dataPlane.autoscaling.enabled=true",
)  # fmt: skip
# The chart never generates the pepper or the internal secret: every render is given them.
KEYS = ("--set", f"secrets.keyPepper.value={'p' * 48},secrets.internalSecret.value={'i' * 48}")
VALIDATE_AT = ("1.25.0", kubernetes_validate.latest_version())  # the oldest schemas the package ships, the newest


class Helm:
    def __init__(self, kube: KubeApiserver, home: Path) -> None:
        self.kube = kube
        self.env = {
            **kube.env(),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.kube.helm_path), *args], capture_output=True, text=True, timeout=120, env=self.env
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def template(self, *args: str, keys: tuple[str, ...] = KEYS) -> list[dict[str, Any]]:
        out = self("template", "rel", str(CHART), "--namespace", "ibex-system", *keys, *args).stdout
        return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture
def helm(kube_apiserver: KubeApiserver, tmp_path: Path) -> Helm:
    return Helm(kube_apiserver, tmp_path / "helm")


def test_helm_lint_is_clean_with_defaults_and_with_every_option(helm: Helm) -> None:
    for extra in ((), EVERYTHING_ON, ("--set", "operator.watchNamespaces={tenants,team-b}")):
        out = helm("lint", str(CHART), "--strict", *KEYS, *extra)
        assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


def test_rendered_objects_are_valid_kubernetes(helm: Helm) -> None:
    for extra in ((), EVERYTHING_ON, ("--set", "operator.watchNamespaces={tenants,team-b}")):
        docs = helm.template(*extra)
        kinds = {d["kind"] for d in docs}
        assert {"Deployment", "Service", "ServiceAccount", "ClusterRole", "Secret", "CustomResourceDefinition"} <= kinds
        assert "NetworkPolicy" in kinds  # on by default
        for doc in docs:
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a custom resource: no schema to check offline
            for version in VALIDATE_AT:
                kubernetes_validate.validate(doc, version, strict=True)


def test_the_chart_renders_the_data_plane_and_operator_as_specified(helm: Helm) -> None:
    docs = helm.template(*EVERYTHING_ON)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    data_plane = by[("Deployment", "rel-ibex-dataplane")]["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in data_plane["containers"]}
    assert list(containers) == ["proxy", "memory", "context"]
    for name, c in containers.items():
        assert c["command"] == ["ibex"] and c["args"] == ([name, "--workers", "2"] if name == "proxy" else [name])
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["startupProbe"]["httpGet"]["path"] == "/healthz"  # loading may take minutes: no liveness kill
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["resources"]["requests"] and c["securityContext"]["readOnlyRootFilesystem"] is True
    assert data_plane["automountServiceAccountToken"] is False
    # The stages start once the operator has migrated: an init container waits for it with the data plane's DSN.
    (wait,) = data_plane["initContainers"]
    assert wait["name"] == "wait-for-schema" and wait["args"] == ["wait-schema", "--timeout", "600"]
    wait_env = {e["name"]: e for e in wait["env"]}
    proxy_env = {e["name"]: e for e in containers["proxy"]["env"]}
    assert wait_env["IBEX_POSTGRES_DSN"] == proxy_env["IBEX_POSTGRES_DSN"]  # the stages' own DSN, not the admin's
    assert "IBEX_POSTGRES_ADMIN_DSN" not in wait_env and "IBEX_KEY_PEPPER" not in wait_env
    assert wait["resources"]["requests"] and wait["securityContext"]["readOnlyRootFilesystem"] is True
    off = helm.template("--set", "dataPlane.waitForSchema.enabled=false,dataPlane.waitForSchema.timeoutSeconds=5")
    (deployment,) = [d for d in off if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-ibex-dataplane"]
    assert "initContainers" not in deployment["spec"]["template"]["spec"]
    services = [d for d in docs if d["kind"] == "Service"]
    assert [s["metadata"]["name"] for s in services] == ["rel-ibex-dataplane"]
    assert services[0]["spec"]["ports"][0]["targetPort"] == "http"  # the proxy, only
    assert ("PodDisruptionBudget", "rel-ibex-dataplane") in by and (
        "HorizontalPodAutoscaler",
        "rel-ibex-dataplane",
    ) in by
    assert {("NetworkPolicy", "rel-ibex-dataplane"), ("NetworkPolicy", "rel-ibex-operator")} <= set(by)

    operator = by[("Deployment", "rel-ibex-operator")]["spec"]["template"]["spec"]
    (op,) = operator["containers"]
    assert op["args"][0] == "operator" and "--lease-name=rel-ibex-operator" in op["args"] and "--migrate" in op["args"]
    env = {e["name"] for e in op["env"]}
    assert {"POD_NAME", "IBEX_POSTGRES_ADMIN_DSN", "IBEX_KEY_PEPPER", "IBEX_REDIS_URL"} <= env

    # the chart's CRDs are the generated ones
    crds = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert sorted(crds) == sorted(CRD_NAMES)
    for kind in KIND_ORDER:
        committed = yaml.safe_load((REPO / "crds" / f"{GROUP}_{PLURALS[kind]}.yaml").read_text())
        assert crds[f"{PLURALS[kind]}.{GROUP}"]["spec"] == committed["spec"]
    assert helm.template("--set", "crds.install=false") and not [
        d for d in helm.template("--set", "crds.install=false") if d["kind"] == "CustomResourceDefinition"
    ]


def test_the_proxy_runs_the_configured_number_of_workers(helm: Helm) -> None:
    from ibex_dataplane.cli import _proxy_workers, build_parser
    from ibex_dataplane.runtime.workers import usable_cpus
    from ibex_dataplane.settings import Settings

    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    for value, workers in (("4", 4), ("1", 1), ("0", usable_cpus())):
        docs = helm.template("--set", f"dataPlane.proxy.workers={value}")
        (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-ibex-dataplane"]
        (proxy,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "proxy"]
        assert proxy["args"] == ["proxy", "--workers", value]
        assert _proxy_workers(build_parser().parse_args(proxy["args"]), settings) == workers


def test_rbac_is_namespaced_by_default_and_cluster_wide_only_on_opt_in(helm: Helm) -> None:
    def rbac(docs: list[dict[str, Any]]) -> tuple[set[tuple[str, str]], list[list[str]]]:
        roles = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "Role"}
        (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
        return roles, [r["resources"] for r in cluster_role["rules"]]

    def namespace_args(docs: list[dict[str, Any]]) -> list[str]:
        (op,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-ibex-operator"]
        return [a for a in op["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--namespace")]

    # Default: the release namespace only, through a Role; the ClusterRole only reads CRDs and namespaces.
    docs = helm.template()
    roles, cluster_rules = rbac(docs)
    assert roles == {("ibex-system", "rel-ibex-operator"), ("ibex-system", "rel-ibex-operator-leader-election")}
    assert cluster_rules == [["customresourcedefinitions"], ["namespaces"]]
    assert namespace_args(docs) == ["--namespace=ibex-system"]

    docs = helm.template("--set", "operator.watchNamespaces={tenants,team-b}")
    roles, cluster_rules = rbac(docs)
    assert roles == {
        ("tenants", "rel-ibex-operator"),
        ("team-b", "rel-ibex-operator"),
        ("ibex-system", "rel-ibex-operator-leader-election"),
    }
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert cluster_rules == [["customresourcedefinitions"], ["namespaces"]]
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in cluster_role["rules"])
    assert namespace_args(docs) == ["--namespace=tenants", "--namespace=team-b"]
    (tenant_role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] == "tenants"]
    (secret_rule,) = [r for r in tenant_role["rules"] if r["resources"] == ["secrets"]]
    assert sorted(secret_rule["verbs"]) == ["create", "get", "update"]

    # A glob needs the cluster-wide opt-in; with it, Secrets are writable everywhere (documented), and watching
    # every namespace passes no --namespace at all.
    refused = helm("template", "rel", str(CHART), *KEYS, "--set", "operator.watchNamespaces={team-*}", check=False)
    assert refused.returncode != 0 and "operator.clusterWide=true" in refused.stderr
    docs = helm.template("--set", "operator.clusterWide=true")
    roles, cluster_rules = rbac(docs)
    assert roles == {("ibex-system", "rel-ibex-operator-leader-election")}
    assert ["secrets"] in cluster_rules and ["namespaces"] not in cluster_rules
    assert namespace_args(docs) == []
    docs = helm.template("--set", "operator.clusterWide=true,operator.watchNamespaces={team-*}")
    assert namespace_args(docs) == ["--namespace=team-*"]


def test_renders_are_reproducible_and_never_invent_the_pepper(helm: Helm) -> None:
    # GitOps: a render cannot see the cluster, so two renders must agree (a generated pepper would not).
    first = helm("template", "rel", str(CHART), "--namespace", "ibex-system", *KEYS).stdout
    assert first == helm("template", "rel", str(CHART), "--namespace", "ibex-system", *KEYS).stdout
    (keys,) = [
        d for d in yaml.safe_load_all(first) if d and d["kind"] == "Secret" and d["metadata"]["name"] == "rel-ibex-keys"
    ]
    assert base64.b64decode(keys["data"]["key-pepper"]) == b"p" * 48
    assert keys["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    missing = helm("template", "rel", str(CHART), check=False)
    assert missing.returncode != 0 and "secrets.keyPepper: set existingSecret" in missing.stderr
    short = helm("template", "rel", str(CHART), "--set", "secrets.keyPepper.value=short", check=False)
    assert short.returncode != 0 and "secrets.keyPepper.value: at least 32 characters" in short.stderr

    # Both from one existing Secret: the chart renders no keys Secret and points every container at that one.
    docs = helm.template(
        "--set", "secrets.keyPepper.existingSecret=own-keys,secrets.internalSecret.existingSecret=own-keys", keys=()
    )
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "rel-ibex-keys"]
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
        for d in docs
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
        if e["name"] in ("IBEX_KEY_PEPPER", "IBEX_INTERNAL_SECRET")
    }
    assert refs == {"IBEX_KEY_PEPPER": "own-keys", "IBEX_INTERNAL_SECRET": "own-keys"}


PROVIDERS = {
    "models": [
        {"name": "llama-3.1-8b", "provider": "local-vllm", "context_window": 131072, "max_output_tokens": 4096,
         "input_price_per_mtok": "0", "output_price_per_mtok": "0"}
    ],
    "providers": {
        "openai": {"type": "openai_compat", "api_key_env": "OPENAI_API_KEY"},
        "local-vllm": {"type": "openai_compat", "base_url": "http://vllm.models:8000/v1"},
    },
}  # fmt: skip
API_KEYS = [{"env": "OPENAI_API_KEY", "secretName": "openai", "secretKey": "api-key"}]


def data_plane_containers(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-ibex-dataplane"]
    pod = deployment["spec"]["template"]["spec"]
    return pod, {c["name"]: c for c in pod["containers"]}


def test_provider_keys_come_from_secrets_and_the_providers_file_is_mounted(helm: Helm, tmp_path: Path) -> None:
    from ibex_dataplane.providers.catalog import CatalogConfigError, ModelCatalog, load_provider_config

    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"providers": {"config": PROVIDERS, "apiKeys": API_KEYS}}))
    out = helm("lint", str(CHART), "--strict", *KEYS, "-f", str(values))
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout
    docs = helm.template("-f", str(values))
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    pod, containers = data_plane_containers(docs)
    env = {name: {e["name"]: e for e in c["env"]} for name, c in containers.items()}
    path = env["proxy"]["IBEX_PROVIDERS_FILE"]["value"]
    assert env["context"]["IBEX_PROVIDERS_FILE"]["value"] == path == env["memory"]["IBEX_PROVIDERS_FILE"]["value"]
    # The callers of providers get the keys: the proxy, and the memory stage for fact extraction (capture: facts).
    for caller in ("proxy", "memory"):
        assert env[caller]["OPENAI_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "openai", "key": "api-key"}}
    assert "OPENAI_API_KEY" not in env["context"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    for name in ("proxy", "memory", "context"):
        (mount,) = [m for m in containers[name]["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True and path == f"{mount['mountPath']}/providers.json"
    for doc in docs:
        for version in VALIDATE_AT if doc["kind"] in ("ConfigMap", "Deployment") else ():
            kubernetes_validate.validate(doc, version, strict=True)

    # The rendered file is one the processes accept, with the proxy's environment and without it.
    rendered = tmp_path / "providers.json"
    rendered.write_text(configmap["data"]["providers.json"])
    assert json.loads(rendered.read_text()) == PROVIDERS
    keys = {n: "sk-from-secret" for n, e in env["proxy"].items() if "secretKeyRef" in e.get("valueFrom", {})}
    config = load_provider_config(rendered, environ=keys)
    assert config["providers"]["openai"]["api_key"] == "sk-from-secret"
    with pytest.raises(CatalogConfigError, match="OPENAI_API_KEY"):
        load_provider_config(rendered, environ={k: v for k, v in keys.items() if k != "OPENAI_API_KEY"})
    assert "llama-3.1-8b" in ModelCatalog.from_config(load_provider_config(rendered, resolve_keys=False))


def test_without_providers_nothing_is_mounted_and_an_existing_configmap_is_used_as_is(helm: Helm) -> None:
    docs = helm.template()
    pod, containers = data_plane_containers(docs)
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert all("IBEX_PROVIDERS_FILE" not in {e["name"] for e in c["env"]} for c in containers.values())

    docs = helm.template("--set", "providers.existingConfigMap=my-providers,providers.configMapKey=models.json")
    pod, containers = data_plane_containers(docs)
    assert not [d for d in docs if d["kind"] == "ConfigMap"]
    assert [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v] == ["my-providers"]
    proxy_env = {e["name"]: e.get("value") for e in containers["proxy"]["env"]}
    assert proxy_env["IBEX_PROVIDERS_FILE"] == "/etc/ibex/providers/models.json"


def test_a_provider_key_without_its_secret_is_refused_at_render(helm: Helm) -> None:
    out = helm("template", "rel", str(CHART), *KEYS, "--set", "providers.apiKeys[0].env=OPENAI_API_KEY", check=False)
    assert out.returncode != 0 and "providers.apiKeys[0].secretName is required" in out.stderr


@pytest.fixture
def release_namespace(kube_apiserver: KubeApiserver, crds: None) -> Iterator[str]:
    name = f"ibex-system-{uuid.uuid4().hex[:6]}"
    yield name
    kube_apiserver.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def can_i(kube: KubeApiserver, sa: str, *args: str) -> bool:
    out = kube.kubectl("auth", "can-i", f"--as={sa}", *args, check=False)
    return out.stdout.strip() == "yes"


def sa_kubeconfig(kube: KubeApiserver, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount with a short-lived token (TokenRequest API)."""
    token = kube.kubectl("-n", namespace, "create", "token", sa, "--duration=1h").stdout.strip()
    config = yaml.safe_load(kube.kubeconfig.read_text())
    config["users"] = [{"name": "admin", "user": {"token": token}}]
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


async def test_helm_install_into_the_apiserver_with_working_least_privilege_rbac(
    kube_apiserver: KubeApiserver,
    helm: Helm,
    release_namespace: str,
    solo_namespace: str,
    embedded: EmbeddedRuntime,
    stores: Stores,  # migrated
    tmp_path: Path,
) -> None:
    kube, ns, release = kube_apiserver, release_namespace, "ibex"
    # The suite already applied the CRDs with kubectl: hand them to the release, as one would adopt them.
    kube.kubectl("label", "crd", *CRD_NAMES, "app.kubernetes.io/managed-by=Helm", "--overwrite")
    kube.kubectl(
        "annotate", "crd", *CRD_NAMES, f"meta.helm.sh/release-name={release}",
        f"meta.helm.sh/release-namespace={ns}", "--overwrite",
    )  # fmt: skip
    # The pepper and internal secret as a user brings them: one Secret made before the install.
    kube.kubectl("create", "namespace", ns)
    pepper = secrets.token_urlsafe(36)
    kube.kubectl(
        "-n", ns, "create", "secret", "generic", "own-keys",
        f"--from-literal=key-pepper={pepper}", f"--from-literal=internal-secret={secrets.token_urlsafe(36)}",
    )  # fmt: skip
    values = [
        "--set", "secrets.keyPepper.existingSecret=own-keys,secrets.internalSecret.existingSecret=own-keys",
        "--set", "stores.postgres.dsn=postgresql://app@postgres/ibex",
        "--set", "stores.postgres.adminDsn=postgresql://admin@postgres/ibex",
        "--set", "stores.redis.url=redis://redis:6379/0",
        "--set", "stores.clickhouse.url=http://clickhouse:8123/ibex",
        # only the test's namespace: the suite's shared operator watches others, and this exercises namespaced RBAC
        "--set", f"operator.watchNamespaces={{{solo_namespace}}}",
    ]  # fmt: skip
    helm("install", release, str(CHART), "--namespace", ns, *values)
    try:
        status = json.loads(helm("status", release, "--namespace", ns, "-o", "json").stdout)
        assert status["info"]["status"] == "deployed"
        deployments = kube.kubectl("-n", ns, "get", "deployments", "-o", "name").stdout.split()
        assert sorted(deployments) == ["deployment.apps/ibex-dataplane", "deployment.apps/ibex-operator"]
        for crd in CRD_NAMES:
            meta = json.loads(kube.kubectl("get", "crd", crd, "-o", "json").stdout)["metadata"]
            assert meta["annotations"]["meta.helm.sh/release-name"] == release
        assert not kube.kubectl("-n", ns, "get", "secret", "ibex-keys", "--ignore-not-found", "-o", "name").stdout
        env = json.loads(kube.kubectl("-n", ns, "get", "deployment", "ibex-operator", "-o", "json").stdout)
        (op_env,) = [
            e for e in env["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"] == "IBEX_KEY_PEPPER"
        ]
        assert op_env["valueFrom"]["secretKeyRef"] == {"name": "own-keys", "key": "key-pepper"}

        # Least privilege, as the apiserver's authorizer sees it.
        sa = f"system:serviceaccount:{ns}:ibex-operator"
        allowed = [
            ("create", "secrets", "-n", solo_namespace), ("get", "secrets", "-n", solo_namespace),
            ("update", "secrets", "-n", solo_namespace), ("patch", "apikeys.ibex.dev", "-n", solo_namespace),
            ("patch", "organizations.ibex.dev/status", "-n", solo_namespace),
            ("create", "events", "-n", solo_namespace), ("watch", "agents.ibex.dev", "-n", solo_namespace),
            ("list", "customresourcedefinitions"), ("list", "namespaces"),
            ("update", "leases/ibex-operator", "-n", ns), ("create", "leases", "-n", ns),
        ]  # fmt: skip
        denied = [
            ("list", "secrets", "-n", solo_namespace), ("delete", "secrets", "-n", solo_namespace),
            ("create", "secrets", "-n", "default"), ("watch", "agents.ibex.dev", "--all-namespaces"),
            ("get", "pods", "-n", ns), ("delete", "apikeys.ibex.dev", "-n", solo_namespace),
            ("create", "organizations.ibex.dev", "-n", solo_namespace), ("update", "leases/other", "-n", ns),
            ("create", "leases", "-n", solo_namespace), ("create", "clusterrolebindings"),
            ("delete", "namespaces"),
        ]  # fmt: skip
        assert [a for a in allowed if not can_i(kube, sa, *a)] == []
        assert [d for d in denied if can_i(kube, sa, *d)] == []
        assert not can_i(kube, f"system:serviceaccount:{ns}:ibex-dataplane", "get", "secrets", "-n", ns)

        # ...and sufficient: an operator authenticated as that ServiceAccount does the whole job.
        config = sa_kubeconfig(kube, ns, "ibex-operator", tmp_path / "sa-kubeconfig")
        pepper_text = secrets.token_hex(16)
        op = spawn_operator(
            kube, embedded.info, tmp_path, identity="chart-sa", namespace=solo_namespace, pepper=pepper_text,
            lease_name="ibex-operator", kubeconfig=config, extra=("--lease-namespace", ns),
        )  # fmt: skip
        try:
            await apply(
                kube, *into(solo_namespace, org("acme"), agent("bot", "acme"), api_key("bot-key", "acme", ["bot"]))
            )
            await wait_condition(kube, "apikey", "bot-key", solo_namespace, timeout=30)
            assert await secret_token(kube, solo_namespace, "bot-key")
            assert "KeyIssued" in {e["reason"] for e in await events(kube, solo_namespace, "bot-key")}
            holder = kube.kubectl("-n", ns, "get", "lease", "ibex-operator", "-o", "jsonpath={.spec.holderIdentity}")
            assert holder.stdout == "chart-sa"
            assert "Forbidden" not in op.log() and "403" not in op.log(), op.log()[-3000:]
        finally:
            op.kill()

        # An upgrade leaves the pepper alone (a new one would invalidate every key).
        helm("upgrade", release, str(CHART), "--namespace", ns, *values, "--set", "logLevel=DEBUG")
        again = kube.kubectl("-n", ns, "get", "secret", "own-keys", "-o", "jsonpath={.data.key-pepper}").stdout
        assert base64.b64decode(again).decode() == pepper
    finally:
        helm("uninstall", release, "--namespace", ns, check=False)
    # CRDs (and with them every tenant resource) and the pepper survive an uninstall
    assert kube.kubectl("get", "crd", *CRD_NAMES, "-o", "name").stdout.count("customresourcedefinition") == 4
    assert kube.kubectl("-n", ns, "get", "secret", "own-keys", "--ignore-not-found", "-o", "name").stdout.strip()
    assert not kube.kubectl("-n", ns, "get", "deployments", "-o", "name").stdout.strip()


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in _leaves(v, f"{prefix}.{k}" if prefix else k)]
    return [prefix]


def test_every_value_is_documented_in_the_chart_readme() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    documented = [line.split("`")[1] for line in readme.splitlines() if line.startswith("| `")]
    assert documented, "no values table in charts/ibex/README.md"
    leaves = _leaves(values)
    undocumented = [p for p in leaves if not any(p == d or p.startswith(d + ".") for d in documented)]
    assert undocumented == []
    unknown = [d for d in documented if not any(p == d or p.startswith(d + ".") for p in leaves)]
    assert unknown == []


def test_every_container_runs_a_real_ibex_subcommand_with_real_flags_and_settings(helm: Helm) -> None:
    """The chart and the CLI agree: each container's command parses with `ibex`'s own parser, and every IBEX_*
    variable the chart sets is a setting the processes read."""
    from ibex_dataplane.cli import build_parser
    from ibex_dataplane.settings import Settings

    parser = build_parser()
    known = {f"IBEX_{name.upper()}" for name in Settings.model_fields}
    seen: set[str] = set()
    for doc in helm.template(*EVERYTHING_ON):
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert container["command"] == ["ibex"], container["name"]
            args = container.get("args", [])
            try:
                parsed = parser.parse_args(args)
            except SystemExit as e:  # argparse exits on unknown subcommands and flags
                raise AssertionError(f"{container['name']}: `ibex {' '.join(args)}` is not a valid command") from e
            assert callable(getattr(parsed, "func", None)), container["name"]
            seen.add(args[0])
            names = {e["name"] for e in container.get("env", []) if e["name"].startswith("IBEX_")}
            assert names <= known, f"{container['name']} sets unknown settings: {sorted(names - known)}"
    assert {"wait-schema", "proxy", "memory", "context", "operator"} <= seen


KIND = REPO / "examples" / "kind"


def test_the_kind_script_parses_and_names_only_files_that_exist() -> None:
    script = KIND / "kind.sh"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, syntax.stderr
    text = script.read_text()
    paths = set(re.findall(r"(?<![\w/.$-])((?:examples|charts|requirements|tests|docs|\.ci)/[\w./-]*\w)", text))
    paths |= {f"examples/kind/{name}" for name in re.findall(r"\$HERE/([\w.-]+)", text)}
    paths |= {p for p in ("Containerfile", "pyproject.toml", "README.md") if p in text}
    assert {"examples/kind/cluster.yaml", "examples/kind/stores.yaml", "examples/kind/values.yaml"} <= paths
    assert [p for p in sorted(paths) if not (REPO / p).exists()] == []
    # The smoke test it runs is the module the cluster test runs.
    assert "-m tests.cluster.smoke" in text
    smoke = subprocess.run(
        [sys.executable, "-m", "tests.cluster.smoke", "--help"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert smoke.returncode == 0 and "--token-file" in smoke.stdout, smoke.stderr


def test_the_kind_values_render_valid_objects_on_the_kind_stores(helm: Helm) -> None:
    values = yaml.safe_load((KIND / "values.yaml").read_text())
    image = f"{values['image']['repository']}:{values['image']['tag']}"
    assert f"IMAGE={image}" in (KIND / "kind.sh").read_text()
    docs = helm.template("-f", str(KIND / "values.yaml"), keys=())  # the keys are an existing Secret
    for doc in docs:
        for version in VALIDATE_AT:
            kubernetes_validate.validate(doc, version, strict=True)
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
    assert {c["image"] for p in pods for c in p.get("initContainers", []) + p["containers"]} == {image}

    stores = [d for d in yaml.safe_load_all((KIND / "stores.yaml").read_text()) if d]
    for doc in stores:
        for version in VALIDATE_AT:
            kubernetes_validate.validate(doc, version, strict=True)
    services = {f"{d['metadata']['name']}.{d['metadata']['namespace']}" for d in stores if d["kind"] == "Service"}
    urls = [
        values["stores"]["postgres"]["dsn"],
        values["stores"]["postgres"]["adminDsn"],
        values["stores"]["redis"]["url"],
    ]
    assert {re.split(r"[@:/]", url.split("@")[-1].split("//")[-1])[0] for url in urls} <= services
    init = next(d for d in stores if d["kind"] == "ConfigMap")["data"]["ibex-app.sql"]
    app_user, app_password = re.match(r"postgresql://([^:]+):([^@]+)@", values["stores"]["postgres"]["dsn"]).groups()
    assert f"CREATE ROLE {app_user} LOGIN" in init and f"PASSWORD '{app_password}'" in init and "NOBYPASSRLS" in init
