"""API key tokens in Kubernetes Secrets: :class:`KubernetesSecretSink`, the Secret sink the reconciler writes
issued tokens to (:mod:`~ibex_operator.secrets` has the protocol and the file sink of ``ibex dev``)."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from ibex_operator.errors import SecretConflict
from ibex_operator.kube import KubeApi, api_failure
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

    @staticmethod
    def _path(namespace: str, name: str = "") -> str:
        base = f"/api/v1/namespaces/{quote(namespace)}/secrets"
        return f"{base}/{quote(name)}" if name else base

    async def _get(self, namespace: str, name: str) -> dict[str, Any] | None:
        status, payload = await self._api.request("GET", self._path(namespace, name))
        if status == 404:
            return None
        if status != 200:
            raise api_failure("GET", self._path(namespace, name), status, payload)
        secret: dict[str, Any] = payload
        return secret

    @staticmethod
    def _ours(secret: Mapping[str, Any]) -> bool:
        labels = (secret.get("metadata") or {}).get("labels") or {}
        return bool(labels.get(MANAGED_BY_LABEL) == MANAGED_BY)

    @staticmethod
    def _owner_name(secret: Mapping[str, Any]) -> str | None:
        for ref in (secret.get("metadata") or {}).get("ownerReferences") or []:
            if ref.get("kind") == "ApiKey" and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
                return str(ref.get("name"))
        return None

    async def read(self, namespace: str, secret_name: str) -> str | None:
        secret = await self._get(namespace, secret_name)
        if secret is None or not self._ours(secret):
            return None
        raw = (secret.get("data") or {}).get(TOKEN_KEY)
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
        metadata: dict[str, Any] = {
            "name": secret_name,
            "namespace": namespace,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY, "app.kubernetes.io/part-of": "ibex"},
        }
        if owner_name:
            metadata["annotations"] = {f"{GROUP}/api-key": owner_name}
        if owner:
            metadata["ownerReferences"] = [{**owner, "controller": True}]
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": metadata,
            "type": "Opaque",
            "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
        }
        if existing is None:
            method, path = "POST", self._path(namespace)
        else:
            metadata["resourceVersion"] = existing["metadata"]["resourceVersion"]
            method, path = "PUT", self._path(namespace, secret_name)
        status, payload = await self._api.request(method, path, body)
        if status not in (200, 201):
            # 409: someone changed it meanwhile; the reconcile is retried and starts from a fresh read.
            raise api_failure(method, path, status, payload)
