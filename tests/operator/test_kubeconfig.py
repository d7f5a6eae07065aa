"""The operator's logins against the real apiserver: a kubeconfig's token, client certificate (files and data),
tokenFile, exec credential plugins (how EKS, GKE and AKS log in) giving a token or a certificate, the oidc id-token,
and the in-cluster service account. Each is checked twice: through :class:`KubeApi` (kubernetes_asyncio's client)
and through the ``kopf.ConnectionInfo`` kopf's login handler makes of it. Expiring exec credentials are renewed,
a 401 logs in again once, failures say why."""

from __future__ import annotations

import base64
import json
import re
import secrets
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import yaml
from kubernetes_asyncio.client import CoreV1Api

from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import Stores
from ibex_operator.errors import KubeApiError, OperatorError
from ibex_operator.handlers import connection_info
from ibex_operator.kube import KubeApi
from ibex_operator.kubeconfig import Login, kubeconfig_credentials, login_function, service_account_credentials
from tests.operator.support import apply, spawn_operator, wait_condition
from tests.operator.test_resources import agent, api_key, into, org, secret_token

if TYPE_CHECKING:
    from tests.operator.conftest import KubeApiserver

# An exec credential plugin: appends the KUBERNETES_EXEC_INFO it was given to a log, then prints an ExecCredential
# the way aws/gke-gcloud-auth-plugin/kubelogin do: the n-th run gives the n-th of its comma-separated tokens (the
# last one from then on), or the client certificate and key in the files it names ("cert:<crt>:<key>").
PLUGIN = """\
import json, os, sys
log, tokens, expires = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
runs = len(open(log).readlines()) if os.path.exists(log) else 0
with open(log, "a") as f:
    f.write(os.environ["KUBERNETES_EXEC_INFO"] + "\\n")
token = tokens[min(runs, len(tokens) - 1)]
if token == "FAIL":
    print("plugin: not logged in to the cloud", file=sys.stderr)
    sys.exit(3)
if token.startswith("cert:"):
    _, crt, key = token.split(":")
    status = {"clientCertificateData": open(crt).read(), "clientKeyData": open(key).read()}
else:
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
    tmp_path: Path, tokens: str, expires: datetime | None = None, api_version: str = "client.authentication.k8s.io/v1"
) -> dict[str, Any]:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    stamp = expires.strftime("%Y-%m-%dT%H:%M:%SZ") if expires else "-"
    return {
        "exec": {
            "apiVersion": api_version,
            "command": sys.executable,
            "args": [str(plugin), str(tmp_path / "calls.log"), tokens, stamp],
            "env": [{"name": "PLUGIN_API_VERSION", "value": api_version}],
            "interactiveMode": "Never",
        }
    }


def calls(tmp_path: Path) -> list[dict[str, Any]]:
    log = tmp_path / "calls.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


async def list_namespaces(api: KubeApi) -> int:
    """A call that needs an authenticated and authorized user (an anonymous one gets 403): 200, or the error's
    status."""
    try:
        await api.call("list namespaces", lambda c: CoreV1Api(c).list_namespace(limit=1))
    except KubeApiError as e:
        return e.status or 0
    return 200


async def status_via_client(login: Login) -> int:
    api = KubeApi(login)
    try:
        return await list_namespaces(api)
    finally:
        await api.close()


async def status_via_kopf(login: Login) -> int:
    """The same call the way kopf makes its requests from the ConnectionInfo our login handler returns."""
    info = await connection_info(await login())
    connector = aiohttp.TCPConnector(ssl=info.as_ssl_context())
    async with (
        aiohttp.ClientSession(connector=connector, headers=info.as_http_headers()) as session,
        session.get(f"{info.server}/api/v1/namespaces", params={"limit": "1"}) as resp,
    ):
        return resp.status


def same_content(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def from_file(config: Path) -> Login:
    return login_function(config)


async def test_a_token_logs_in_and_kopf_gets_the_same_server_ca_and_token(kube_apiserver: KubeApiserver) -> None:
    login = from_file(kube_apiserver.kubeconfig)
    assert await status_via_client(login) == 200
    assert await status_via_kopf(login) == 200
    info = await connection_info(await login())
    assert (info.server, info.scheme, info.token) == (kube_apiserver.server, "Bearer", kube_apiserver.token)
    assert info.ca_path and same_content(Path(str(info.ca_path)), kube_apiserver.certs / "ca.crt")
    assert info.expiration is None


async def test_client_certificates_log_in_from_files_and_from_data(
    kube_apiserver: KubeApiserver, tmp_path: Path
) -> None:
    certs = kube_apiserver.certs
    (tmp_path / "client.crt").write_bytes((certs / "client.crt").read_bytes())
    (tmp_path / "client.key").write_bytes((certs / "client.key").read_bytes())
    files = {"client-certificate": "client.crt", "client-key": "client.key"}  # relative to the kubeconfig
    data = {
        "client-certificate-data": base64.b64encode((certs / "client.crt").read_bytes()).decode(),
        "client-key-data": base64.b64encode((certs / "client.key").read_bytes()).decode(),
    }
    for name, user in (("files", files), ("data", data)):
        login = from_file(kubeconfig_with_user(kube_apiserver, tmp_path / f"kubeconfig-{name}", user))
        assert await status_via_client(login) == 200, name
        assert await status_via_kopf(login) == 200, name
    # Without the certificate the same kubeconfig is anonymous, which may not list namespaces.
    nobody = from_file(kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig-nobody", {}))
    assert await status_via_client(nobody) == 403


@pytest.mark.parametrize("api_version", ["client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"])
async def test_an_exec_plugin_logs_in_with_exec_info(
    kube_apiserver: KubeApiserver, tmp_path: Path, api_version: str
) -> None:
    user = exec_user(tmp_path, kube_apiserver.token, api_version=api_version)
    login = from_file(kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", user))
    assert await status_via_client(login) == 200
    assert await status_via_kopf(login) == 200
    first, second = calls(tmp_path)  # each login runs the plugin
    assert first == second
    assert first["apiVersion"] == api_version and first["kind"] == "ExecCredential"
    assert first["spec"]["interactive"] is False


async def test_an_exec_plugin_may_give_a_client_certificate(kube_apiserver: KubeApiserver, tmp_path: Path) -> None:
    certs = kube_apiserver.certs
    user = exec_user(tmp_path, f"cert:{certs / 'client.crt'}:{certs / 'client.key'}")
    login = from_file(kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", user))
    assert await status_via_client(login) == 200
    assert await status_via_kopf(login) == 200
    assert len(calls(tmp_path)) == 2


async def test_expiring_exec_credentials_are_renewed_and_lasting_ones_reused(
    kube_apiserver: KubeApiserver, tmp_path: Path
) -> None:
    # Expiring within the renewal margin: every request logs in again.
    soon = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=5)
    config = kubeconfig_with_user(
        kube_apiserver, tmp_path / "kubeconfig", exec_user(tmp_path, kube_apiserver.token, soon)
    )
    api = KubeApi(from_file(config))
    try:
        for _ in range(3):
            assert await list_namespaces(api) == 200
    finally:
        await api.close()
    assert len(calls(tmp_path)) == 3
    # kopf is told when they expire, and logs in again then.
    assert (await connection_info(await from_file(config)())).expiration == soon

    # Valid for an hour: one login serves every request.
    (tmp_path / "calls.log").unlink()
    later = datetime.now(UTC) + timedelta(hours=1)
    config = kubeconfig_with_user(
        kube_apiserver, tmp_path / "kubeconfig", exec_user(tmp_path, kube_apiserver.token, later)
    )
    api = KubeApi(from_file(config))
    try:
        for _ in range(3):
            assert await list_namespaces(api) == 200
    finally:
        await api.close()
    assert len(calls(tmp_path)) == 1


async def test_a_rejected_token_logs_in_again_once(kube_apiserver: KubeApiserver, tmp_path: Path) -> None:
    # The plugin's first token is rejected (revoked, rotated): the 401 logs in again and the call goes through.
    user = exec_user(tmp_path, f"not-a-valid-token,{kube_apiserver.token}")
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", user)
    assert await status_via_client(from_file(config)) == 200
    assert len(calls(tmp_path)) == 2

    # Rejected again after the new login: the 401 is the answer, with no third login.
    (tmp_path / "calls.log").unlink()
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", exec_user(tmp_path, "not-a-valid-token"))
    assert await status_via_client(from_file(config)) == 401
    assert len(calls(tmp_path)) == 2


async def test_exec_plugin_failures_name_the_cause(kube_apiserver: KubeApiserver, tmp_path: Path) -> None:
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", exec_user(tmp_path, "FAIL"))
    with pytest.raises(OperatorError, match=r"returned 3\. plugin: not logged in to the cloud"):
        await kubeconfig_credentials(config)

    missing = exec_user(tmp_path, "x")
    missing["exec"]["command"] = str(tmp_path / "no-such-plugin")
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", missing)
    with pytest.raises(OperatorError, match=r"No such file or directory.*no-such-plugin"):
        await kubeconfig_credentials(config)

    wrong = exec_user(tmp_path, "x")
    wrong["exec"]["env"] = [{"name": "PLUGIN_API_VERSION", "value": "client.authentication.k8s.io/v1alpha1"}]
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", wrong)
    with pytest.raises(OperatorError, match=r"v1alpha1 does not match client\.authentication\.k8s\.io/v1"):
        await kubeconfig_credentials(config)

    with pytest.raises(OperatorError, match="cannot read kubeconfig"):
        await kubeconfig_credentials(tmp_path / "no-such-kubeconfig")


async def test_token_file_is_read_at_every_login(kube_apiserver: KubeApiserver, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("stale-token\n")
    config = kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", {"tokenFile": "token"})  # relative
    api = KubeApi(from_file(config))
    try:
        token_file.write_text(kube_apiserver.token)  # rotated before the first login
        assert await list_namespaces(api) == 200
        token_file.write_text("revoked-token")
        await api.close()  # the next request logs in again and reads the file again
        assert await list_namespaces(api) == 401
    finally:
        await api.close()


def service_account_token(kube: KubeApiserver, namespace: str) -> str:
    """A TokenRequest token (a JWT) of a fresh ServiceAccount that may list namespaces and nothing else."""
    sa = f"reader-{uuid.uuid4().hex[:6]}"
    kube.kubectl("-n", namespace, "create", "serviceaccount", sa)
    role = f"{namespace}-{sa}"  # the built-in "view" is aggregated: this control plane does not fill it in
    kube.kubectl("create", "clusterrole", role, "--verb=list", "--resource=namespaces")
    kube.kubectl("create", "clusterrolebinding", role, f"--clusterrole={role}", f"--serviceaccount={namespace}:{sa}")
    return kube.kubectl("-n", namespace, "create", "token", sa, "--duration=1h").stdout.strip()


async def test_oidc_auth_provider_uses_its_id_token(
    kube_apiserver: KubeApiserver, solo_namespace: str, tmp_path: Path
) -> None:
    # Any JWT the apiserver accepts stands in for an identity provider's id-token (this one has no OIDC issuer).
    token = service_account_token(kube_apiserver, solo_namespace)
    oidc = {"auth-provider": {"name": "oidc", "config": {"id-token": token, "idp-issuer-url": "https://idp.invalid"}}}
    login = from_file(kubeconfig_with_user(kube_apiserver, tmp_path / "kubeconfig", oidc))
    assert await status_via_client(login) == 200
    assert await status_via_kopf(login) == 200


async def test_in_cluster_service_account_logs_in_with_the_kubelets_variables(
    kube_apiserver: KubeApiserver, solo_namespace: str, tmp_path: Path
) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(service_account_token(kube_apiserver, solo_namespace))
    (account / "ca.crt").write_bytes((kube_apiserver.certs / "ca.crt").read_bytes())
    (account / "namespace").write_text(solo_namespace)
    host, _, port = kube_apiserver.server.removeprefix("https://").rpartition(":")
    environ = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}

    # No kubeconfig: the service account, when its token is mounted.
    login = login_function(None, service_account_dir=account, environ=environ)
    assert await status_via_client(login) == 200
    assert await status_via_kopf(login) == 200
    credentials = await login()
    assert credentials.namespace == solo_namespace
    assert credentials.configuration.host == kube_apiserver.server

    # The kubelet always sets the variables; without them this is not a pod.
    with pytest.raises(OperatorError, match="Service host/port is not set"):
        service_account_credentials(account, {})


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
    # Two logins at least: the operator's client (the Lease, the Secret) and kopf's (the watches, the status).
    assert len(calls(tmp_path)) >= 2, "the operator did not log in through the exec plugin"
    # A 401 status, not the digits inside a log line's timestamp (",401" milliseconds).
    assert not re.search(r"(?<![,.\d])401(?!\d)", op.log()) and "Unauthorized" not in op.log(), op.log()[-3000:]
