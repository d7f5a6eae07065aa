"""The leader Lease in Kubernetes: :class:`KubeLeaseStore`, a ``coordination.k8s.io/v1`` Lease read and written
with compare-and-swap, the store behind the election of :mod:`~ibex_operator.lease`."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import quote

from ibex_operator.errors import LeaseConflict
from ibex_operator.kube import KubeApi, api_failure
from ibex_operator.lease import LeaseRecord


def _micro_time(value: datetime | None) -> str | None:
    return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if value else None


def _parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


class KubeLeaseStore:
    """A ``coordination.k8s.io/v1`` Lease read and written with compare-and-swap on its resourceVersion."""

    def __init__(self, api: KubeApi, namespace: str, name: str) -> None:
        self._api = api
        self._namespace = namespace
        self._name = name
        self._base = f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace)}/leases"

    def _record(self, payload: Mapping[str, Any]) -> LeaseRecord:
        spec = payload.get("spec") or {}
        return LeaseRecord(
            holder=spec.get("holderIdentity") or None,
            duration_s=int(spec.get("leaseDurationSeconds") or 1),
            acquire_time=_parse_time(spec.get("acquireTime")),
            renew_time=_parse_time(spec.get("renewTime")),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str(payload["metadata"]["resourceVersion"]),
        )

    def _body(self, record: LeaseRecord) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self._name, "namespace": self._namespace}
        if record.resource_version is not None:
            metadata["resourceVersion"] = record.resource_version
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": record.holder,
                "leaseDurationSeconds": record.duration_s,
                "acquireTime": _micro_time(record.acquire_time),
                "renewTime": _micro_time(record.renew_time),
                "leaseTransitions": record.transitions,
            },
        }

    async def get(self) -> LeaseRecord | None:
        status, payload = await self._api.request("GET", f"{self._base}/{quote(self._name)}")
        if status == 404:
            return None
        if status != 200:
            raise api_failure("GET", self._base, status, payload)
        return self._record(payload)

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        status, payload = await self._api.request("POST", self._base, self._body(record))
        if status == 409:
            raise LeaseConflict("the lease was created by someone else")
        if status != 201:
            raise api_failure("POST", self._base, status, payload)
        return self._record(payload)

    async def replace(self, record: LeaseRecord) -> LeaseRecord:
        path = f"{self._base}/{quote(self._name)}"
        status, payload = await self._api.request("PUT", path, self._body(record))
        if status == 409:
            raise LeaseConflict("the lease changed meanwhile")
        if status != 200:
            raise api_failure("PUT", path, status, payload)
        return self._record(payload)
