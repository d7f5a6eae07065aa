"""Kubeconfig logins beyond a static token, against the real apiserver: exec credential plugins (how EKS, GKE and AKS
log in), tokenFile, and the oidc auth-provider; expiring exec credentials are renewed, failures say why."""

from __future__ import annotations

import json
import secrets
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import Stores
from ibex_operator.errors import OperatorError
from ibex_operator.kube import KubeApi
from ibex_operator.kubeconfig import kubeconfig_connection
from tests.operator.support import apply, spawn_operator, wait_condition
from tests.operator.test_resources import agent, api_key, into, org, secret_token

if TYPE_CHECKING:
    from tests.operator.conftest import KubeApiserver

# An exec credential plugin: appends the KUBERNETES_EXEC_INFO it was given to a log, then prints an ExecCredential
# with the token (and expiry) it was configured with, the way aws/gke-gcloud-auth-plugin/kubelogin do.
PLUGIN = """\
import json, os, sys
log, token, expires = sys.argv[1], sys.argv[2], sys.argv[3]
with open(log, "a") as f:
    f.write(os.environ["KUBERNETES_EXEC_INFO"] + "\\n")
if token == "FAIL":
    print("plugin: not logged in to the cloud", file=sys.stderr)
    sys.exit(3)
status = {"token": token}
if expires != "-":
    status["expirationTimestamp"] = expires
print(json.dumps({"apiVersion": os.environ.get("PLUGIN_API_VERSION"), "kind": "ExecCredential", "status": status}))
"""


def kubeconfig_with_user(kube: KubeApiserver, path: Path, user: dict[str, Any]) -> Path:
    config = yaml.safe_load(kube.kubeconfig.read_text())
    (context,) = [c for c in config["contexts"] if c["name"] == config["current-context"]]
    config["users"] = [{"name": context["context"]["user"], "user": user}]
    path.write_text(yaml.safe_dump(config))
    return path


def exec_user(
    tmp_path: Path, token: str, expires: datetime | None = None, api_version: str = "client.authentication.k8s.io/v1"
) -> dict[str, Any]:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    stamp = expires.strftime("%Y-%m-%dT%H:%M:%SZ") if expires else "-"
    return {
        "exec": {
            "apiVersion": api_version,
            "command": sys.executable,
            "args": [str(plugin), str(tmp_path / "calls.log"), token, stamp],
            "env": [{"name": "PLUGIN_API_VERSION", "value": api_version}],
            "provideClusterInfo": True,
            "interactiveMode": "Never",
            "installHint": "install the cloud CLI",
        }
    }


def calls(tmp_path: Path) -> list[dict[str, Any]]:
    log = tmp_path / "calls.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def namespaces_status(config: Path) -> int:
    api = KubeApi(lambda: kubeconfig_connection(config))
    try:
        status, _ = await api.request("GET", "/api/v1/namespaces?limit=1")
        return status
    finally:
        await api.close()


@pytest.mark.parametrize("api_version", ["client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"])
async def test_an_exec_plugin_logs_in_with_exec_info_and_cluster(
    kube_apiserver: KubeApiserver, tmp_path: Path, api_version: str
) -> None:
    user = exec_user(tmp_path, kube_apiserver.token, api_version=api_version)
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", user)
    assert await namespaces_status(config) == 200
    (info,) = calls(tmp_path)
    assert info["apiVersion"] == api_version and info["kind"] == "ExecCredential"
    assert info["spec"]["interactive"] is False
    assert info["spec"]["cluster"]["server"] == kube_apiserver.server


async def test_expiring_exec_credentials_are_renewed_and_lasting_ones_reused(
    kube_apiserver: KubeApiserver, tmp_path: Path
) -> None:
    # Expiring within the renewal margin: every request logs in again.
    soon = datetime.now(UTC) + timedelta(seconds=5)
    config = kubeconfig_with_user(
        kube_apiserver, tmp_path / "kubeconfig", exec_user(tmp_path, kube_apiserver.token, soon)
    )
    api = KubeApi(lambda: kubeconfig_connection(config))
    try:
        for _ in range(3):
            assert (await api.request("GET", "/api/v1/namespaces?limit=1"))[0] == 200
    finally:
        await api.close()
    assert len(calls(tmp_path)) == 3

    # Valid for an hour: one login serves every request.
    (tmp_path / "calls.log").unlink()
    later = datetime.now(UTC) + timedelta(hours=1)
    config = kubeconfig_with_user(
        kube_apiserver, tmp_path / "kubeconfig", exec_user(tmp_path, kube_apiserver.token, later)
    )
    api = KubeApi(lambda: kubeconfig_connection(config))
    try:
        for _ in range(3):
            assert (await api.request("GET", "/api/v1/namespaces?limit=1"))[0] == 200
    finally:
        await api.close()
    assert len(calls(tmp_path)) == 1


async def test_a_rejected_exec_token_logs_in_again_once_then_gives_the_401(
    kube_apiserver: KubeApiserver, tmp_path: Path
) -> None:
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", exec_user(tmp_path, "not-a-valid-token"))
    assert await namespaces_status(config) == 401
    assert len(calls(tmp_path)) == 2  # the first login, and one more after the 401


def test_exec_plugin_failures_name_the_cause(kube_apiserver: KubeApiserver, tmp_path: Path) -> None:
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", exec_user(tmp_path, "FAIL"))
    with pytest.raises(OperatorError, match="exited 3: plugin: not logged in to the cloud"):
        kubeconfig_connection(config)

    missing = exec_user(tmp_path, "x")
    missing["exec"]["command"] = "./no-such-plugin"
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", missing)
    with pytest.raises(OperatorError, match=r"no-such-plugin' not found \(install the cloud CLI\)"):
        kubeconfig_connection(config)

    interactive = exec_user(tmp_path, "x")
    interactive["exec"]["interactiveMode"] = "Always"
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", interactive)
    with pytest.raises(OperatorError, match="needs a terminal"):
        kubeconfig_connection(config)

    wrong = exec_user(tmp_path, "x")
    wrong["exec"]["env"] = [{"name": "PLUGIN_API_VERSION", "value": "client.authentication.k8s.io/v1alpha1"}]
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", wrong)
    with pytest.raises(OperatorError, match=r"not client\.authentication\.k8s\.io/v1 ExecCredential"):
        kubeconfig_connection(config)


async def test_token_file_is_read_at_every_login(kube_apiserver: KubeApiserver, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("stale-token\n")
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", {"tokenFile": "token"})  # relative
    api = KubeApi(lambda: kubeconfig_connection(config))
    try:
        token_file.write_text(kube_apiserver.token + "\n")  # rotated before the first login
        assert (await api.request("GET", "/api/v1/namespaces?limit=1"))[0] == 200
        token_file.write_text("revoked-token\n")
        await api.close()  # the next request logs in again and reads the file again
        assert (await api.request("GET", "/api/v1/namespaces?limit=1"))[0] == 401
    finally:
        await api.close()


async def test_oidc_auth_provider_uses_its_id_token_and_dropped_providers_are_refused(
    kube_apiserver: KubeApiserver, tmp_path: Path
) -> None:
    oidc = {"auth-provider": {"name": "oidc", "config": {"id-token": kube_apiserver.token, "idp-issuer-url": "x"}}}
    assert await namespaces_status(kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", oidc)) == 200
    gcp = {"auth-provider": {"name": "gcp", "config": {"access-token": "x"}}}
    with pytest.raises(OperatorError, match="gke-gcloud-auth-plugin"):
        kubeconfig_connection(kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", gcp))


async def test_an_operator_logged_in_through_an_exec_plugin_does_the_whole_job(
    kube_apiserver: KubeApiserver,
    solo_namespace: str,
    embedded: EmbeddedRuntime,
    stores: Stores,  # migrated
    tmp_path: Path,
) -> None:
    kube, ns = kube_apiserver, solo_namespace
    later = datetime.now(UTC) + timedelta(hours=1)
    config = kubeconfig_with_user(kube, tmp_path / "kubeconfig", exec_user(tmp_path, kube.token, later))
    op = spawn_operator(
        kube, embedded.info, tmp_path / "op", identity="exec-login", namespace=ns, pepper=secrets.token_hex(16),
        lease_name=f"exec-{ns}", kubeconfig=config, extra=("--lease-namespace", ns),
    )  # fmt: skip
    try:
        await apply(kube, *into(ns, org("acme"), agent("bot", "acme"), api_key("bot-key", "acme", ["bot"])))
        await wait_condition(kube, "apikey", "bot-key", ns, timeout=30)
        assert await secret_token(kube, ns, "bot-key")
    finally:
        op.kill()
    assert calls(tmp_path), "the operator never ran the exec plugin"
    assert "401" not in op.log() and "Unauthorized" not in op.log(), op.log()[-3000:]


def test_in_cluster_server_comes_from_the_kubelets_service_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from ibex_operator.kubeconfig import IN_CLUSTER_SERVER, in_cluster_server

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert in_cluster_server() == "https://10.0.0.1:443"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert in_cluster_server() == "https://[fd00::1]:443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert in_cluster_server() == IN_CLUSTER_SERVER
