"""The operator's Kubernetes API client: kubernetes_asyncio's ``ApiClient`` on the operator's credentials.

:class:`KubeApi` logs in with a :data:`~ibex_operator.kubeconfig.Login` (tokens, client certificates, exec plugins,
the in-cluster service account), keeps one ``ApiClient`` while the credentials last, logs in again shortly before
they expire (exec plugins give an expiry) and once on 401, bounds every call by a timeout, and turns the client's
failures into :class:`~ibex_operator.errors.KubeApiError` (with the HTTP status when there is one). Used with the
typed APIs by :mod:`~ibex_operator.kube_secrets` (``CoreV1Api``) and :mod:`~ibex_operator.kube_lease`
(``CoordinationV1Api``); kopf logs in from the same credentials (:mod:`~ibex_operator.handlers`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import aiohttp
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from ibex_operator.errors import KubeApiError
from ibex_operator.kubeconfig import Credentials, Login

EXPIRY_MARGIN = timedelta(seconds=30)  # log in again this long before expiring credentials expire

T = TypeVar("T")


class KubeApi:
    """Calls to the API server through one ``ApiClient`` per login (see the module docstring)."""

    def __init__(self, login: Login, timeout: float = 10.0) -> None:
        self._login = login
        self._timeout = timeout
        self._credentials: Credentials | None = None
        self._client: ApiClient | None = None
        self._login_lock = asyncio.Lock()  # concurrent calls share one login

    def _expired(self) -> bool:
        expiration = self._credentials.expiration if self._credentials is not None else None
        if expiration is None:
            return False
        if expiration.tzinfo is None:
            expiration = expiration.replace(tzinfo=UTC)
        return datetime.now(UTC) >= expiration - EXPIRY_MARGIN

    async def _connect(self) -> ApiClient:
        async with self._login_lock:
            if self._expired():
                await self.close()
            if self._client is None:
                self._credentials = await self._login()
                self._client = ApiClient(self._credentials.configuration)
            return self._client

    async def _attempt(self, what: str, operation: Callable[[ApiClient], Awaitable[T]]) -> T:
        client = await self._connect()
        try:
            async with asyncio.timeout(self._timeout):
                return await operation(client)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise KubeApiError(f"{what}: {type(e).__name__}") from e

    async def call(self, what: str, operation: Callable[[ApiClient], Awaitable[T]]) -> T:
        """Run ``operation`` (e.g. ``lambda c: CoreV1Api(c).read_namespaced_secret(name, ns)``) and return its
        result; any failure is a :class:`KubeApiError` whose message starts with ``what``."""
        try:
            return await self._attempt(what, operation)
        except ApiException as e:
            if e.status != 401:
                raise api_failure(what, e) from e
        await self.close()  # the server no longer takes the credentials (expired, rotated): log in again, once
        try:
            return await self._attempt(what, operation)
        except ApiException as e:
            raise api_failure(what, e) from e

    async def close(self) -> None:
        client, self._client, self._credentials = self._client, None, None
        if client is not None:
            await client.close()


def api_failure(what: str, e: ApiException) -> KubeApiError:
    """The API server's answer as a :class:`KubeApiError`: status, and the ``reason`` and ``message`` of its Status
    body when it sent one."""
    try:
        payload = json.loads(e.body or b"")
    except ValueError:
        payload = None
    reason = payload.get("reason") if isinstance(payload, dict) else e.reason
    message = payload.get("message") if isinstance(payload, dict) else None
    return KubeApiError(f"{what}: {e.status} {reason or ''} {message or ''}".strip(), e.status)
