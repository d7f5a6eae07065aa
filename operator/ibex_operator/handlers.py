"""The kopf glue: the handlers kopf runs for our four kinds, and the operator's kopf settings.

Called by :mod:`ibex_operator.app`, which builds an :class:`OperatorContext` and runs :func:`serve` once this replica
holds the leader lease. Per kind it registers one reconcile for create, update and resume (plus a periodic timer
that runs the same reconcile: level-based), and one deletion handler behind the finalizer ``ibex.dev/cleanup``.
Everything a handler decides comes from :mod:`~ibex_operator.reconcile` and :mod:`~ibex_operator.purge`; here it
only becomes Kubernetes: ``.status`` (``observedGeneration``, ``conditions`` with ``Ready``), Events for
transitions, and kopf retries (``TemporaryError`` with exponential backoff) for ``Ready=False`` that may fix itself
(a missing reference, a store outage).

The Kubernetes API calls of the operator live next to it: :mod:`~ibex_operator.kube` (the client,
kubernetes_asyncio's), :mod:`~ibex_operator.kube_secrets` (API key tokens into Secrets owned by their ApiKey) and
:mod:`~ibex_operator.kube_lease` (the Lease behind :mod:`~ibex_operator.lease`). kopf logs in from the same
credentials (:mod:`~ibex_operator.kubeconfig`): its login handler turns each login into a ``kopf.ConnectionInfo``
(:func:`connection_info`). kopf's own state lives under our group: the finalizer ``ibex.dev/cleanup`` and
annotations ``ibex.dev/last-handled-configuration`` and ``ibex.dev/<handler>``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import kopf
from pydantic import ValidationError

from ibex_dataplane.store.errors import StoreUnavailable
from ibex_operator.errors import KubeApiError, SecretConflict
from ibex_operator.health import OperatorState
from ibex_operator.kubeconfig import Credentials, Login
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


# -- kopf handlers ---------------------------------------------------------------------------------------------------
@dataclass
class OperatorContext:
    """Everything the handlers need; built by ``app`` (no module-level state)."""

    reconciler: Reconciler
    repo: TenantConfigRepository
    purger: TenantPurger
    options: OperatorOptions
    login: Login
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
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await connection_info(await ctx.login())

    return registry


async def connection_info(credentials: Credentials) -> kopf.ConnectionInfo:
    """kopf's view of one login: the server, CA and client certificate files, the ``Authorization`` scheme and
    token (bearer, or basic from a username and password), and the expiry of exec plugin credentials, after which
    kopf logs in again (it also does on a 401)."""
    c = credentials.configuration
    # "Bearer <token>" or "Basic <base64>"; asking for it runs the in-cluster loader's hook that re-reads the token.
    authorization = await c.get_api_key_with_prefix("BearerToken") or ""
    scheme, _, token = authorization.partition(" ")
    return kopf.ConnectionInfo(
        server=c.host or "",
        ca_path=c.ssl_ca_cert,
        insecure=not c.verify_ssl,
        certificate_path=c.cert_file,
        private_key_path=c.key_file,
        scheme=scheme or None,
        token=token or None,
        proxy_url=c.proxy,
        default_namespace=credentials.namespace,
        expiration=credentials.expiration,
    )


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
