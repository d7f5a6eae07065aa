"""A small Kubernetes API client: JSON requests to the API server with the operator's credentials.

:class:`KubeApi` gets its credentials from a login callable (kopf's, backed by :mod:`~ibex_operator.kubeconfig`:
tokens, client certificates, exec plugins, the in-cluster service account), logs in again before they expire and
once on 401. Used by :mod:`~ibex_operator.kube_secrets` and :mod:`~ibex_operator.kube_lease`; the kopf wiring is in
:mod:`~ibex_operator.handlers`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import kopf

from ibex_operator.errors import KubeApiError

EXPIRY_MARGIN = timedelta(seconds=30)  # log in again this long before expiring credentials expire


class KubeApi:
    """JSON requests to the API server with the operator's credentials (:mod:`~ibex_operator.kubeconfig`); logs in
    again when the credentials expire (exec plugins give an expiry) and once on 401."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo], timeout: float = 10.0) -> None:
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None

    def _expired(self) -> bool:
        expiration = self._info.expiration if self._info is not None else None
        if expiration is None:
            return False
        if expiration.tzinfo is None:
            expiration = expiration.replace(tzinfo=UTC)
        return datetime.now(UTC) >= expiration - EXPIRY_MARGIN

    async def _connect(self) -> tuple[aiohttp.ClientSession, kopf.ConnectionInfo]:
        if self._expired():
            await self.close()
        if self._session is None or self._info is None:
            # In a thread: an exec credential plugin may take seconds.
            self._info = await asyncio.to_thread(self._login)
            https = self._info.server.startswith("https")
            ssl_context: ssl.SSLContext | bool = self._info.as_ssl_context() if https else False
            self._session = aiohttp.ClientSession(
                base_url=self._info.server.rstrip("/") + "/",
                connector=aiohttp.TCPConnector(ssl=ssl_context),
                timeout=self._timeout,
                headers=self._info.as_http_headers(),
            )
        return self._session, self._info

    async def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> tuple[int, Any]:
        """Returns (HTTP status, decoded JSON body); raises :class:`KubeApiError` when the server is unreachable."""
        for attempt in (1, 2):
            session, _ = await self._connect()
            try:
                async with session.request(method, path.lstrip("/"), json=body) as resp:
                    payload = await resp.json(content_type=None)
                    if resp.status == 401 and attempt == 1:
                        await self.close()  # credentials expired: log in again and retry once
                        continue
                    return resp.status, payload
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                raise KubeApiError(f"{method} {path}: {type(e).__name__}") from e
        raise KubeApiError(f"{method} {path}: unauthorized", 401)

    async def close(self) -> None:
        session, self._session, self._info = self._session, None, None
        if session is not None:
            await session.close()


def api_failure(method: str, path: str, status: int, payload: Any) -> KubeApiError:
    reason = payload.get("reason") if isinstance(payload, dict) else None
    message = payload.get("message") if isinstance(payload, dict) else None
    return KubeApiError(f"{method} {path}: {status} {reason or ''} {message or ''}".strip(), status)
