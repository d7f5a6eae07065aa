"""The operator's Kubernetes credentials, loaded by kubernetes_asyncio's config loaders.

:func:`login_function` picks the source (``--kubeconfig``, else the in-cluster service account, else
``~/.kube/config``) and returns a :data:`Login`: each call loads the credentials afresh into a new
``kubernetes_asyncio.client.Configuration``, so a rotated ``tokenFile`` or service account token is read again and an
exec plugin runs again. :class:`~ibex_operator.kube.KubeApi` makes its requests with them and kopf logs in from them
(:mod:`~ibex_operator.handlers`).

The library does the parsing and the logins: ``token`` and ``tokenFile``, client certificates (files, relative to the
kubeconfig, or ``-data``), ``username``/``password``, exec credential plugins (``client.authentication.k8s.io/v1``
or ``v1beta1``, a token or a client certificate, how EKS, GKE and AKS log in), the ``oidc`` auth-provider (its
``id-token``, refreshed when it has a ``refresh-token``), and the in-cluster service account (the API server from
``KUBERNETES_SERVICE_HOST``/``PORT``, the token file re-read every minute). What is here fills what it lacks: the
expiry an exec plugin gives (the library keeps it on its loader, not on the configuration), the default namespace
(the context's, or the service account's ``namespace`` file, which the library does not read), a deadline on a
login (the library runs an exec plugin without one), and its errors as :class:`OperatorError`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import yaml
from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.config import ConfigException, load_kube_config
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader

from ibex_operator.errors import OperatorError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
LOGIN_TIMEOUT = 60.0  # an exec plugin (a cloud CLI) may take seconds; one that hangs must not hang the operator


@dataclass(frozen=True)
class Credentials:
    """One login: the client configuration (server, CA, client certificate, ``Authorization``), when it expires
    (``None``: when the server says so, with a 401), and the default namespace of the context."""

    configuration: Configuration
    expiration: datetime | None = None
    namespace: str | None = None


Login = Callable[[], Awaitable[Credentials]]


async def kubeconfig_credentials(path: Path) -> Credentials:
    """The current context of a kubeconfig file (or of several, ``KUBECONFIG``-style, separated by ``:``)."""
    # ASYNC240: the library reads these files synchronously too (they are small and local)
    if not any(Path(p).expanduser().is_file() for p in str(path).split(os.pathsep) if p):  # noqa: ASYNC240
        raise OperatorError(f"cannot read kubeconfig {path}: no such file")
    configuration = Configuration()
    try:
        async with asyncio.timeout(LOGIN_TIMEOUT):
            loader = await load_kube_config(
                config_file=str(path), client_configuration=configuration, persist_config=False
            )
    except TimeoutError as e:
        raise OperatorError(f"kubeconfig {path}: the login took longer than {LOGIN_TIMEOUT:.0f} s") from e
    except (ConfigException, OSError, ValueError, yaml.YAMLError) as e:
        raise OperatorError(f"kubeconfig {path}: {e}") from e
    context = (loader.current_context or {}).get("context") or {}
    return Credentials(configuration, getattr(loader, "exec_plugin_expiry", None), context.get("namespace") or None)


def service_account_credentials(
    directory: Path = SERVICE_ACCOUNT_DIR, environ: dict[str, str] | None = None
) -> Credentials:
    """The pod's service account (``token``, ``ca.crt``, ``namespace`` in ``directory``) and the API server the
    kubelet names in ``KUBERNETES_SERVICE_HOST``/``PORT`` (``environ``, default the process environment)."""
    configuration = Configuration()
    try:
        InClusterConfigLoader(
            token_filename=str(directory / "token"),
            cert_filename=str(directory / "ca.crt"),
            environ=environ if environ is not None else os.environ,
        ).load_and_set(configuration)
    except (ConfigException, OSError) as e:
        raise OperatorError(f"in-cluster service account ({directory}): {e}") from e
    return Credentials(configuration, None, in_cluster_namespace(directory))


def login_function(
    kubeconfig: Path | None, *, service_account_dir: Path = SERVICE_ACCOUNT_DIR, environ: dict[str, str] | None = None
) -> Login:
    """How to get credentials: ``kubeconfig``, else the in-cluster service account, else ``~/.kube/config``."""
    if kubeconfig is not None:
        path = kubeconfig
    elif (service_account_dir / "token").exists():

        async def in_cluster() -> Credentials:
            return service_account_credentials(service_account_dir, environ)

        return in_cluster
    else:
        path = Path("~/.kube/config").expanduser()
        if not path.exists():
            raise OperatorError("no Kubernetes credentials: pass --kubeconfig, set KUBECONFIG, or run in a cluster")

    async def from_kubeconfig() -> Credentials:
        return await kubeconfig_credentials(path)

    return from_kubeconfig


def in_cluster_namespace(directory: Path = SERVICE_ACCOUNT_DIR) -> str | None:
    path = directory / "namespace"
    return (path.read_text().strip() or None) if path.exists() else None
