"""Kubernetes credentials of the operator: a kubeconfig's current context, or the in-cluster service account.

A kubeconfig user may authenticate with:

- ``token`` or ``tokenFile`` (the file is read at every login, so a rotated token is picked up);
- a client certificate and key (``client-certificate``/``client-key`` files, relative to the kubeconfig, or the
  ``-data`` fields);
- ``username``/``password`` (basic auth);
- an **exec credential plugin** (``client.authentication.k8s.io/v1`` or ``v1beta1``): how EKS
  (``aws eks get-token``), GKE (``gke-gcloud-auth-plugin``) and AKS (``kubelogin``) log in. The plugin runs at every
  login, non-interactively, with ``KUBERNETES_EXEC_INFO`` set (and the cluster when ``provideClusterInfo``); its token
  or client certificate is used until its ``expirationTimestamp``, after which the next request logs in again;
- the ``oidc`` auth-provider (its ``id-token``). The other auth-providers (``gcp``, ``azure``) were removed from
  Kubernetes clients in 1.26 in favour of the exec plugins above and are refused with a message saying so.

Logins are synchronous (kopf runs its login handler in a thread; :class:`~ibex_operator.kube.KubeApi` calls
:func:`login_function`'s result in a thread too).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import kopf
import yaml

from ibex_operator.errors import OperatorError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
IN_CLUSTER_SERVER = "https://kubernetes.default.svc"
EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
EXEC_TIMEOUT = 60.0


def kubeconfig_connection(path: Path) -> kopf.ConnectionInfo:
    """The current context of a kubeconfig file."""
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise OperatorError(f"cannot read kubeconfig {path}: {e}") from e
    if not isinstance(config, dict):
        raise OperatorError(f"kubeconfig {path}: not a mapping")

    def named(section: str, name: str) -> dict[str, Any]:
        for item in config.get(section) or []:
            if isinstance(item, dict) and item.get("name") == name:
                value: dict[str, Any] = item.get(section[:-1]) or {}
                return value
        raise OperatorError(f"kubeconfig {path}: no {section[:-1]} named {name!r}")

    current = config.get("current-context")
    if not current:
        raise OperatorError(f"kubeconfig {path}: current-context is not set")
    context = named("contexts", current)
    cluster, user = named("clusters", context["cluster"]), named("users", context["user"])

    def local(value: str | None) -> str | None:
        return str((path.parent / value).resolve()) if value else None

    credentials: dict[str, Any] = {
        "certificate_path": local(user.get("client-certificate")),
        "certificate_data": user.get("client-certificate-data"),
        "private_key_path": local(user.get("client-key")),
        "private_key_data": user.get("client-key-data"),
        "username": user.get("username"),
        "password": user.get("password"),
        "token": user.get("token"),
    }
    if not credentials["token"] and user.get("tokenFile"):
        credentials["token"] = _read_token_file(Path(local(user["tokenFile"]) or ""), path)
    if user.get("auth-provider"):
        credentials["token"] = _auth_provider_token(user["auth-provider"], path)
    if user.get("exec"):
        credentials.update(_exec_credentials(user["exec"], cluster, path))
    return kopf.ConnectionInfo(
        server=cluster["server"],
        ca_path=local(cluster.get("certificate-authority")),
        ca_data=cluster.get("certificate-authority-data"),
        insecure=cluster.get("insecure-skip-tls-verify"),
        default_namespace=context.get("namespace"),
        **credentials,
    )


def _read_token_file(token_file: Path, kubeconfig: Path) -> str:
    try:
        token = token_file.read_text().strip()
    except OSError as e:
        raise OperatorError(f"kubeconfig {kubeconfig}: cannot read tokenFile {token_file}: {e}") from e
    if not token:
        raise OperatorError(f"kubeconfig {kubeconfig}: tokenFile {token_file} is empty")
    return token


def _auth_provider_token(provider: Mapping[str, Any], kubeconfig: Path) -> str:
    name = provider.get("name")
    settings = provider.get("config") or {}
    if name == "oidc":
        token = settings.get("id-token")
        if not token:
            raise OperatorError(
                f"kubeconfig {kubeconfig}: the oidc auth-provider has no id-token (refreshing one needs a browser"
                " flow: use an exec plugin such as kubelogin instead)"
            )
        return str(token)
    raise OperatorError(
        f"kubeconfig {kubeconfig}: auth-provider {name!r} is not supported (Kubernetes clients dropped the"
        " gcp and azure providers: use their exec plugins, gke-gcloud-auth-plugin or kubelogin)"
    )


def _exec_credentials(spec: Mapping[str, Any], cluster: Mapping[str, Any], kubeconfig: Path) -> dict[str, Any]:
    """Runs an exec credential plugin and returns ConnectionInfo fields (token or client certificate, expiry)."""
    api_version = spec.get("apiVersion")
    if api_version not in EXEC_API_VERSIONS:
        raise OperatorError(
            f"kubeconfig {kubeconfig}: exec apiVersion {api_version!r} is not one of {', '.join(EXEC_API_VERSIONS)}"
        )
    if spec.get("interactiveMode") == "Always":
        raise OperatorError(f"kubeconfig {kubeconfig}: the exec plugin needs a terminal (interactiveMode: Always)")
    command = str(spec.get("command") or "")
    if not command:
        raise OperatorError(f"kubeconfig {kubeconfig}: exec has no command")
    if os.sep in command and not os.path.isabs(command):
        command = str((kubeconfig.parent / command).resolve())  # as kubectl: relative to the kubeconfig
    exec_spec: dict[str, Any] = {"interactive": False}
    if spec.get("provideClusterInfo"):
        info = {
            k: cluster[k] for k in ("server", "certificate-authority-data", "insecure-skip-tls-verify") if k in cluster
        }
        for extension in cluster.get("extensions") or []:
            if extension.get("name") == "client.authentication.k8s.io/exec":
                info["config"] = extension.get("extension")
        exec_spec["cluster"] = info
    env = {**os.environ, **{e["name"]: str(e["value"]) for e in spec.get("env") or []}}
    env["KUBERNETES_EXEC_INFO"] = json.dumps({"apiVersion": api_version, "kind": "ExecCredential", "spec": exec_spec})
    hint = f" ({spec['installHint']})" if spec.get("installHint") else ""
    try:
        done = subprocess.run(
            [command, *(str(a) for a in spec.get("args") or [])],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=EXEC_TIMEOUT,
            check=False,
        )
    except FileNotFoundError as e:
        raise OperatorError(f"kubeconfig {kubeconfig}: exec plugin {command!r} not found{hint}") from e
    except subprocess.TimeoutExpired as e:
        raise OperatorError(f"kubeconfig {kubeconfig}: exec plugin {command!r} timed out") from e
    if done.returncode != 0:
        raise OperatorError(
            f"kubeconfig {kubeconfig}: exec plugin {command!r} exited {done.returncode}: {done.stderr.strip()[-500:]}"
        )
    try:
        credential = json.loads(done.stdout)
        status = credential["status"]
    except (ValueError, KeyError, TypeError) as e:
        raise OperatorError(f"kubeconfig {kubeconfig}: exec plugin {command!r} printed no ExecCredential") from e
    if credential.get("apiVersion") != api_version or credential.get("kind") != "ExecCredential":
        raise OperatorError(
            f"kubeconfig {kubeconfig}: exec plugin {command!r} answered {credential.get('apiVersion')!r}"
            f" {credential.get('kind')!r}, not {api_version} ExecCredential"
        )
    out: dict[str, Any] = {}
    if status.get("token"):
        out["token"] = str(status["token"])
    elif status.get("clientCertificateData") and status.get("clientKeyData"):
        out.update(certificate_data=status["clientCertificateData"], private_key_data=status["clientKeyData"])
        out.update(certificate_path=None, private_key_path=None)
    else:
        raise OperatorError(f"kubeconfig {kubeconfig}: exec plugin {command!r} gave neither a token nor a certificate")
    if status.get("expirationTimestamp"):
        try:
            out["expiration"] = datetime.fromisoformat(str(status["expirationTimestamp"]).replace("Z", "+00:00"))
        except ValueError as e:
            raise OperatorError(f"kubeconfig {kubeconfig}: bad expirationTimestamp from {command!r}") from e
    return out


def in_cluster_server() -> str:
    """The API server as every pod is told by the kubelet (the ``kubernetes`` Service's address), as client-go's
    in-cluster config reads it; the DNS name only when those variables are missing (a cluster without DNS works)."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return IN_CLUSTER_SERVER
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def service_account_connection() -> kopf.ConnectionInfo:
    # Read on every login: projected service account tokens are rotated by the kubelet.
    token = (SERVICE_ACCOUNT_DIR / "token").read_text().strip()
    namespace_file = SERVICE_ACCOUNT_DIR / "namespace"
    return kopf.ConnectionInfo(
        server=in_cluster_server(),
        ca_path=str(SERVICE_ACCOUNT_DIR / "ca.crt"),
        token=token,
        default_namespace=namespace_file.read_text().strip() if namespace_file.exists() else None,
    )


def login_function(kubeconfig: Path | None) -> Callable[[], kopf.ConnectionInfo]:
    """How to get credentials: ``kubeconfig``, else the in-cluster service account, else ``~/.kube/config``."""
    if kubeconfig is not None:
        path = kubeconfig
        return lambda: kubeconfig_connection(path)
    if (SERVICE_ACCOUNT_DIR / "token").exists():
        return service_account_connection
    default = Path("~/.kube/config").expanduser()
    if default.exists():
        return lambda: kubeconfig_connection(default)
    raise OperatorError("no Kubernetes credentials: pass --kubeconfig, set KUBECONFIG, or run in a cluster")


def in_cluster_namespace() -> str | None:
    path = SERVICE_ACCOUNT_DIR / "namespace"
    return path.read_text().strip() if path.exists() else None
