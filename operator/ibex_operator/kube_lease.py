"""The leader Lease in Kubernetes: :class:`KubeLeaseStore`, a ``coordination.k8s.io/v1`` Lease read and written
with compare-and-swap, the store behind the election of :mod:`~ibex_operator.lease`."""

from __future__ import annotations

from datetime import UTC, datetime

from kubernetes_asyncio.client import CoordinationV1Api, V1Lease, V1LeaseSpec, V1ObjectMeta

from ibex_operator.errors import KubeApiError, LeaseConflict
from ibex_operator.kube import KubeApi
from ibex_operator.lease import LeaseRecord


class _MicroTime(datetime):
    """A Lease's times are MicroTime, which the API server parses with exactly six fractional digits; the client
    writes datetimes with ``isoformat()``, which drops the fraction when it is zero."""

    def isoformat(self, sep: str = "T", timespec: str = "microseconds") -> str:
        return super().isoformat(sep, timespec)


def _micro_time(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    value = value.astimezone(UTC)
    return _MicroTime(
        value.year, value.month, value.day, value.hour, value.minute, value.second, value.microsecond, UTC
    )


class KubeLeaseStore:
    """A ``coordination.k8s.io/v1`` Lease read and written with compare-and-swap on its resourceVersion."""

    def __init__(self, api: KubeApi, namespace: str, name: str) -> None:
        self._api = api
        self._namespace = namespace
        self._name = name
        self._ref = f"Lease {namespace}/{name}"

    @staticmethod
    def _record(lease: V1Lease) -> LeaseRecord:
        spec = lease.spec or V1LeaseSpec()
        return LeaseRecord(
            holder=spec.holder_identity or None,
            duration_s=int(spec.lease_duration_seconds or 1),
            acquire_time=spec.acquire_time,
            renew_time=spec.renew_time,
            transitions=int(spec.lease_transitions or 0),
            resource_version=str(lease.metadata.resource_version),
        )

    def _body(self, record: LeaseRecord) -> V1Lease:
        return V1Lease(
            api_version="coordination.k8s.io/v1",
            kind="Lease",
            metadata=V1ObjectMeta(name=self._name, namespace=self._namespace, resource_version=record.resource_version),
            spec=V1LeaseSpec(
                holder_identity=record.holder,
                lease_duration_seconds=record.duration_s,
                acquire_time=_micro_time(record.acquire_time),
                renew_time=_micro_time(record.renew_time),
                lease_transitions=record.transitions,
            ),
        )

    async def get(self) -> LeaseRecord | None:
        try:
            lease = await self._api.call(
                f"read {self._ref}",
                lambda c: CoordinationV1Api(c).read_namespaced_lease(self._name, self._namespace),
            )
        except KubeApiError as e:
            if e.status == 404:
                return None
            raise
        return self._record(lease)

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        body = self._body(record)
        try:
            lease = await self._api.call(
                f"create {self._ref}", lambda c: CoordinationV1Api(c).create_namespaced_lease(self._namespace, body)
            )
        except KubeApiError as e:
            if e.status == 409:
                raise LeaseConflict("the lease was created by someone else") from e
            raise
        return self._record(lease)

    async def replace(self, record: LeaseRecord) -> LeaseRecord:
        body = self._body(record)
        try:
            lease = await self._api.call(
                f"replace {self._ref}",
                lambda c: CoordinationV1Api(c).replace_namespaced_lease(self._name, self._namespace, body),
            )
        except KubeApiError as e:
            if e.status == 409:
                raise LeaseConflict("the lease changed meanwhile") from e
            raise
        return self._record(lease)
