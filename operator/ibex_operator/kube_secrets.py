"""API key tokens in Kubernetes Secrets: :class:`KubernetesSecretSink`, the Secret sink the reconciler writes
issued tokens to (:mod:`~ibex_operator.secrets` has the protocol and the file sink of ``ibex dev``)."""

from __future__ import annotations

import base64

from kubernetes_asyncio.client import CoreV1Api, V1ObjectMeta, V1OwnerReference, V1Secret

from ibex_operator.errors import KubeApiError, SecretConflict
from ibex_operator.kube import KubeApi
from ibex_operator.models import GROUP

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "ibex-operator"
TOKEN_KEY = "token"  # noqa: S105 - the name of the key inside the Secret, not a secret


class KubernetesSecretSink:
    """API key tokens in Secrets (key ``token``), labelled as ours and owned by their ApiKey (garbage-collected with
    it). A Secret of that name that the operator does not manage, or that another ApiKey owns, is never read or
    overwritten: the ApiKey becomes ``Ready=False`` with ``SecretConflict``."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api

    async def _get(self, namespace: str, name: str) -> V1Secret | None:
        try:
            return await self._api.call(
                f"read Secret {namespace}/{name}", lambda c: CoreV1Api(c).read_namespaced_secret(name, namespace)
            )
        except KubeApiError as e:
            if e.status == 404:
                return None
            raise

    @staticmethod
    def _ours(secret: V1Secret) -> bool:
        labels = (secret.metadata.labels if secret.metadata else None) or {}
        return bool(labels.get(MANAGED_BY_LABEL) == MANAGED_BY)

    @staticmethod
    def _owner_name(secret: V1Secret) -> str | None:
        for ref in (secret.metadata.owner_references if secret.metadata else None) or []:
            if ref.kind == "ApiKey" and str(ref.api_version or "").startswith(f"{GROUP}/"):
                return str(ref.name)
        return None

    async def read(self, namespace: str, secret_name: str) -> str | None:
        secret = await self._get(namespace, secret_name)
        if secret is None or not self._ours(secret):
            return None
        raw = (secret.data or {}).get(TOKEN_KEY)
        if not raw:
            return None
        try:
            return base64.b64decode(raw).decode()
        except ValueError:
            return None

    async def write(self, namespace: str, secret_name: str, token: str, owner: dict[str, str] | None) -> None:
        existing = await self._get(namespace, secret_name)
        owner_name = owner.get("name") if owner else None
        if existing is not None:
            if not self._ours(existing):
                raise SecretConflict(f"Secret {secret_name} exists and is not managed by the IBEX operator")
            current_owner = self._owner_name(existing)
            if owner_name and current_owner and current_owner != owner_name:
                raise SecretConflict(f"Secret {secret_name} belongs to ApiKey {current_owner}")
        metadata = V1ObjectMeta(
            name=secret_name,
            namespace=namespace,
            labels={MANAGED_BY_LABEL: MANAGED_BY, "app.kubernetes.io/part-of": "ibex"},
            annotations={f"{GROUP}/api-key": owner_name} if owner_name else None,
        )
        if owner:
            metadata.owner_references = [
                V1OwnerReference(
                    api_version=owner["apiVersion"], kind=owner["kind"], name=owner["name"], uid=owner["uid"],
                    controller=True,
                )
            ]  # fmt: skip
        body = V1Secret(
            api_version="v1",
            kind="Secret",
            metadata=metadata,
            type="Opaque",
            data={TOKEN_KEY: base64.b64encode(token.encode()).decode()},
        )
        # 409: someone changed it meanwhile; the reconcile is retried and starts from a fresh read.
        if existing is None:
            await self._api.call(
                f"create Secret {namespace}/{secret_name}",
                lambda c: CoreV1Api(c).create_namespaced_secret(namespace, body),
            )
        else:
            metadata.resource_version = existing.metadata.resource_version
            await self._api.call(
                f"replace Secret {namespace}/{secret_name}",
                lambda c: CoreV1Api(c).replace_namespaced_secret(secret_name, namespace, body),
            )
