"""The kopf glue: with :mod:`~ibex_operator.kubeconfig` (credentials), the only module that imports kopf, and the only
one that talks to the Kubernetes API.

Called by :mod:`ibex_operator.app`, which builds an :class:`OperatorContext` and runs :func:`serve` once this replica
holds the leader lease. Per kind it registers one reconcile for create, update and resume (plus a periodic timer
that runs the same reconcile: level-based), and one deletion handler behind the finalizer ``ibex.dev/cleanup``.
Everything a handler decides comes from :mod:`~ibex_operator.reconcile` and :mod:`~ibex_operator.purge`; here it
only becomes Kubernetes: ``.status`` (``observedGeneration``, ``conditions`` with ``Ready``), Events for
transitions, and kopf retries (``TemporaryError`` with exponential backoff) for ``Ready=False`` that may fix itself
(a missing reference, a store outage).

Also here, because they are Kubernetes API calls: :class:`KubeApi` (a small aiohttp client on kopf's credentials),
:class:`KubernetesSecretSink` (API key tokens into Secrets owned by their ApiKey) and :class:`KubeLeaseStore`
(the Lease behind :mod:`~ibex_operator.lease`). kopf's own state lives under our group: the finalizer
``ibex.dev/cleanup`` and annotations ``ibex.dev/last-handled-configuration`` and ``ibex.dev/<handler>``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote
from uuid import UUID

import aiohttp
import kopf
from pydantic import ValidationError

from ibex_dataplane.store.errors import StoreUnavailable
from ibex_operator.errors import KubeApiError, LeaseConflict, SecretConflict
from ibex_operator.health import OperatorState
from ibex_operator.lease import LeaseRecord
from ibex_operator.models import (
    API_VERSION,
    GROUP,
    KIND_ORDER,
    PLURALS,
    SPEC_MODELS,
    VERSION,
    AgentSpec,
    ApiKeySpec,
    DirectiveSpec,
    OrganizationSpec,
)
from ibex_operator.options import OperatorOptions
from ibex_operator.purge import TenantPurger
from ibex_operator.reconcile import Reconciler
from ibex_operator.repository import TenantConfigRepository
from ibex_operator.status import Condition, ReconcileOutcome

log = logging.getLogger(__name__)

FINALIZER = f"{GROUP}/cleanup"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "ibex-operator"
TOKEN_KEY = "token"  # noqa: S105 - the name of the key inside the Secret, not a secret
EXPIRY_MARGIN = timedelta(seconds=30)  # log in again this long before expiring credentials expire


# -- a small Kubernetes API client ---------------------------------------------------------------------------------
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


def _failure(method: str, path: str, status: int, payload: Any) -> KubeApiError:
    reason = payload.get("reason") if isinstance(payload, dict) else None
    message = payload.get("message") if isinstance(payload, dict) else None
    return KubeApiError(f"{method} {path}: {status} {reason or ''} {message or ''}".strip(), status)


# -- Secrets ---------------------------------------------------------------------------------------------------------
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
            raise _failure("GET", self._path(namespace, name), status, payload)
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
            raise _failure(method, path, status, payload)


# -- the leader Lease ------------------------------------------------------------------------------------------------
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
            raise _failure("GET", self._base, status, payload)
        return self._record(payload)

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        status, payload = await self._api.request("POST", self._base, self._body(record))
        if status == 409:
            raise LeaseConflict("the lease was created by someone else")
        if status != 201:
            raise _failure("POST", self._base, status, payload)
        return self._record(payload)

    async def replace(self, record: LeaseRecord) -> LeaseRecord:
        path = f"{self._base}/{quote(self._name)}"
        status, payload = await self._api.request("PUT", path, self._body(record))
        if status == 409:
            raise LeaseConflict("the lease changed meanwhile")
        if status != 200:
            raise _failure("PUT", path, status, payload)
        return self._record(payload)


# -- kopf handlers ---------------------------------------------------------------------------------------------------
@dataclass
class OperatorContext:
    """Everything the handlers need; built by ``app`` (no module-level state)."""

    reconciler: Reconciler
    repo: TenantConfigRepository
    purger: TenantPurger
    options: OperatorOptions
    login: Callable[[], kopf.ConnectionInfo]
    state: OperatorState = field(default_factory=OperatorState)
    _locks: dict[tuple[str, str, str], asyncio.Lock] = field(default_factory=dict)

    def lock(self, kind: str, namespace: str, name: str) -> asyncio.Lock:
        # The timer and the change handlers of one object may overlap in kopf; reconciles of one object may not.
        return self._locks.setdefault((kind, namespace, name), asyncio.Lock())

    def forget(self, kind: str, namespace: str, name: str) -> None:
        self._locks.pop((kind, namespace, name), None)


def _plain(value: Any) -> Any:
    """kopf hands out read-only mapping views; pydantic and json want plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _uuid(value: Any) -> UUID | None:
    try:
        return UUID(str(value)) if value else None
    except ValueError:
        return None


def _validation_message(e: ValidationError) -> str:
    problems = []
    for err in e.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "spec"
        problems.append(f"spec.{where}: {err['msg']}")
    return "; ".join(problems)


def _ready(status: Mapping[str, Any]) -> tuple[str, str] | None:
    for c in status.get("conditions") or []:
        if c.get("type") == "Ready":
            return str(c.get("status")), str(c.get("reason"))
    return None


def _event(body: kopf.Body, kind: str, reason: str, message: str) -> None:
    kopf.event(body, type=kind, reason=reason, message=message[:1000])


async def _reconcile_once(
    ctx: OperatorContext, kind: str, namespace: str, name: str, uid: str, spec: Any, previous: dict[str, Any], gen: int
) -> ReconcileOutcome:
    try:
        model = SPEC_MODELS[kind].model_validate(spec)
    except ValidationError as e:
        msg = _validation_message(e)
        return ReconcileOutcome(
            kind, namespace, name, ready=False, reason="InvalidSpec", message=msg,
            conditions=(Condition("SpecValid", "False", "InvalidSpec", msg),),
        )  # fmt: skip
    r = ctx.reconciler
    try:
        if isinstance(model, OrganizationSpec):
            return await r.organization(namespace, name, model, generation=gen, known_id=previous.get("orgId"))
        if isinstance(model, AgentSpec):
            return await r.agent(namespace, name, model, generation=gen, known_id=previous.get("agentId"))
        if isinstance(model, DirectiveSpec):
            return await r.directive(namespace, name, model, generation=gen)
        assert isinstance(model, ApiKeySpec)
        owner = {"apiVersion": API_VERSION, "kind": "ApiKey", "name": name, "uid": uid}
        return await r.api_key(namespace, name, model, generation=gen, owner=owner)
    except SecretConflict as e:
        return ReconcileOutcome(
            kind, namespace, name, ready=False, reason="SecretConflict", message=str(e), retryable=True,
            conditions=(Condition("SecretWritten", "False", "SecretConflict", str(e)),),
        )  # fmt: skip
    except (KubeApiError, StoreUnavailable) as e:
        return ReconcileOutcome(
            kind, namespace, name, ready=False, reason="Unavailable", message=str(e), retryable=True
        )
    except Exception as e:  # never crash the operator; the reason is logged, the class name goes to status
        log.exception("reconcile of %s %s/%s failed", kind, namespace, name)
        return ReconcileOutcome(
            kind, namespace, name, ready=False, reason="ReconcileFailed", message=type(e).__name__, retryable=True
        )


def _announce(body: kopf.Body, kind: str, previous: Mapping[str, Any], outcome: ReconcileOutcome) -> None:
    """Events for transitions only (a timer re-run that changes nothing stays quiet)."""
    before = _ready(previous)
    after = ("True" if outcome.ready else "False", outcome.reason)
    if before != after:
        if outcome.ready:
            _event(body, "Normal", "Ready", outcome.message or f"{kind} is reconciled")
        elif outcome.reason == "Revoked":
            _event(body, "Normal", "Revoked", outcome.message)
        else:
            _event(body, "Warning", outcome.reason, outcome.message)
    fields = outcome.fields
    if kind == "Directive" and fields.get("version") and fields.get("version") != previous.get("version"):
        _event(body, "Normal", "VersionActivated", f"directive version {fields['version']} is active")
    if kind == "ApiKey" and fields.get("keyId"):
        secret = (fields.get("secretRef") or {}).get("name")
        if not previous.get("keyId"):
            _event(body, "Normal", "KeyIssued", f"key {fields['keyId']} issued; token in Secret {secret}")
        elif int(fields.get("rotation") or 0) > int(previous.get("rotation") or 0):
            _event(body, "Normal", "KeyRotated", f"key {fields['keyId']} has a new secret in Secret {secret}")


async def _reconcile(
    ctx: OperatorContext, kind: str, body: kopf.Body, patch: kopf.Patch, *, quiet_unchanged: bool
) -> ReconcileOutcome:
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    generation = int(meta.get("generation") or 1)
    previous = _plain(body.get("status") or {})
    async with ctx.lock(kind, namespace, name):
        outcome = await _reconcile_once(ctx, kind, namespace, name, uid, _plain(body.get("spec")), previous, generation)
    ctx.state.count_reconcile(kind, outcome.reason)
    status = outcome.status(generation, previous)
    if not quiet_unchanged or {**previous, **status} != previous:
        for key, value in status.items():
            patch.status[key] = value
    _announce(body, kind, previous, outcome)
    level = logging.INFO if outcome.ready or outcome.reason == "Revoked" else logging.WARNING
    log.log(level, "%s: Ready=%s %s %s", outcome.ref, outcome.ready, outcome.reason, outcome.message)
    return outcome


async def _cleanup(ctx: OperatorContext, kind: str, body: kopf.Body) -> tuple[str, str]:
    """The finalizer's work; returns the (reason, message) of the Event that records it."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    status = _plain(body.get("status") or {})
    if kind == "Organization":
        org_id = _uuid(status.get("orgId"))
        if org_id is None and (org := await ctx.repo.find_org(namespace, name)) is not None:
            org_id = org.id
        report = await ctx.purger.purge_organization(uid, namespace, name, org_id)
        return "DataDeleted", f"organization data removed: {report.summary()}"
    if kind == "Agent":
        agent_id, org_id = _uuid(status.get("agentId")), _uuid(status.get("orgId"))
        if agent_id is None or org_id is None:
            row = await ctx.repo.find_agent(namespace, name)
            if row is not None:
                agent_id, org_id = row.id, row.org_id
        agent_report = await ctx.purger.purge_agent(uid, namespace, name, org_id, agent_id)
        return "DataDeleted", f"agent data removed: {agent_report.summary()}"
    if kind == "Directive":
        versions = await ctx.repo.delete_directive(namespace, name)
        return "DirectiveRemoved", f"directive and its {versions} version(s) removed; the agent has no directive now"
    key_id = await ctx.repo.retire_key(namespace, name, status.get("keyId"))
    if key_id is None:
        return "KeyRevoked", "the key never reached the stores"
    return "KeyRevoked", f"key {key_id} revoked on every replica; its token no longer validates"


def _register(registry: kopf.OperatorRegistry, ctx: OperatorContext, kind: str) -> None:
    plural = PLURALS[kind]

    async def reconcile(body: kopf.Body, patch: kopf.Patch, retry: int, **_: Any) -> None:
        outcome = await _reconcile(ctx, kind, body, patch, quiet_unchanged=False)
        if not outcome.ready and outcome.retryable:
            raise kopf.TemporaryError(f"{outcome.reason}: {outcome.message}", delay=ctx.options.backoff(retry))

    async def resync(body: kopf.Body, patch: kopf.Patch, **kwargs: Any) -> None:
        if body["metadata"].get("deletionTimestamp"):
            return
        outcome = await _reconcile(ctx, kind, body, patch, quiet_unchanged=True)
        # e.g. its Organization was deleted since: retry with backoff, not only at the next resync
        if not outcome.ready and outcome.retryable:
            retry = int(kwargs.get("retry") or 0)  # kopf passes it to timers too; its TimerFn type omits it
            raise kopf.TemporaryError(f"{outcome.reason}: {outcome.message}", delay=ctx.options.backoff(retry))

    async def cleanup(body: kopf.Body, retry: int, **_: Any) -> None:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        try:
            async with ctx.lock(kind, namespace, name):
                reason, message = await _cleanup(ctx, kind, body)
        except (StoreUnavailable, KubeApiError) as e:
            if retry == 0:
                _event(body, "Warning", "CleanupPending", f"waiting for the stores before removing data: {e}")
            log.warning("clean-up of %s %s/%s waits: %s", kind, namespace, name, e)
            raise kopf.TemporaryError(str(e), delay=ctx.options.backoff(retry)) from e
        except Exception as e:
            log.exception("clean-up of %s %s/%s failed", kind, namespace, name)
            raise kopf.TemporaryError(type(e).__name__, delay=ctx.options.backoff(retry)) from e
        ctx.forget(kind, namespace, name)
        ctx.state.deletions[kind] += 1
        _event(body, "Normal", reason, message)
        log.info("%s %s/%s: %s", kind, namespace, name, message)

    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(GROUP, VERSION, plural, id="reconcile", registry=registry)(reconcile)
    kopf.timer(
        GROUP,
        VERSION,
        plural,
        id="resync",
        registry=registry,
        interval=ctx.options.resync_interval,
        initial_delay=ctx.options.resync_interval,
    )(resync)
    kopf.on.delete(GROUP, VERSION, plural, id="cleanup", registry=registry)(cleanup)


def build_registry(ctx: OperatorContext) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    for kind in KIND_ORDER:
        _register(registry, ctx, kind)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return ctx.login()

    return registry


def configure(settings: kopf.OperatorSettings, options: OperatorOptions) -> None:
    """kopf's settings: our group for its finalizer and annotations, no peering (we lead by Lease)."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.peering.standalone = True
    # Kubernetes 1.20 has no WatchList (sendInitialEvents): list first, then watch.
    settings.watching.initial_streaming = False
    # Only the Events posted here on purpose; kopf's own handler chatter stays in the log.
    settings.posting.level = logging.CRITICAL
    settings.networking.request_timeout = 30


async def serve(ctx: OperatorContext, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
    """Run kopf until ``stop`` is set (or SIGTERM when this is the main thread)."""
    settings = kopf.OperatorSettings()
    configure(settings, ctx.options)
    namespaces = list(ctx.options.namespaces)
    await kopf.operator(
        registry=build_registry(ctx),
        settings=settings,
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        stop_flag=stop,
        ready_flag=ready,
        memo=kopf.Memo(),
    )
