"""One operator process: stores, leader election, health endpoint, then kopf; and a clean stop.

``ibex operator`` (the CLI, the composition root) calls :func:`main` with settings and options. Tests call
:func:`run` directly with stores they already opened. Order: health endpoint up (a standby is alive), wait for
the leader Lease, run kopf until asked to stop or the lease is lost (then exit 1 so
the Deployment restarts us as a standby), release the lease on the way out. With ``--migrate`` pending migrations
are applied first, before any pool opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from ibex_dataplane.runtime.errors import EmbeddedStoreError
from ibex_dataplane.runtime.stores import Stores, StoreUrls, load_or_create_secret, migrate_all
from ibex_dataplane.settings import Settings
from ibex_dataplane.store.clickhouse import ClickHouse
from ibex_dataplane.store.errors import StoreError
from ibex_dataplane.store.redis import ping as redis_ping
from ibex_operator import handlers, kubeconfig
from ibex_operator.errors import LeaseLost, OperatorError
from ibex_operator.health import HealthServer, OperatorState
from ibex_operator.kube import KubeApi
from ibex_operator.kube_lease import KubeLeaseStore
from ibex_operator.kube_secrets import KubernetesSecretSink
from ibex_operator.lease import LeaderElector
from ibex_operator.options import OperatorOptions
from ibex_operator.purge import TenantPurger
from ibex_operator.reconcile import Reconciler
from ibex_operator.repository import TenantConfigRepository

log = logging.getLogger(__name__)


async def run(
    options: OperatorOptions,
    stores: Stores,
    pepper: bytes,
    *,
    stop: asyncio.Event,
    state: OperatorState | None = None,
    ready: asyncio.Event | None = None,
) -> None:
    """Lead and reconcile until ``stop`` is set; raises :class:`LeaseLost` when leadership ends involuntarily."""
    if stores.admin_pool is None:
        raise OperatorError("the operator needs the privileged Postgres DSN (IBEX_POSTGRES_ADMIN_DSN)")
    admin_pool = stores.admin_pool
    state = state or OperatorState()
    login = kubeconfig.login_function(options.kubeconfig)
    api = KubeApi(login)

    async def check_stores() -> None:
        async with admin_pool.acquire() as conn:
            await conn.execute("SELECT 1")
        await redis_ping(stores.redis)

    health = (
        HealthServer(state, check_stores, options.health_host, options.health_port)
        if options.health_port is not None
        else None
    )
    try:
        if health is not None:
            await health.start()
        lease_namespace = options.lease_namespace or kubeconfig.in_cluster_namespace() or "default"
        elector = LeaderElector(
            KubeLeaseStore(api, lease_namespace, options.lease_name), options.identity, options.lease
        )
        if not await elector.acquire(stop):
            return
        state.leader = True
        try:
            repo = TenantConfigRepository(admin_pool, stores.redis)
            ctx = handlers.OperatorContext(
                reconciler=Reconciler(repo, KubernetesSecretSink(api), pepper),
                repo=repo,
                purger=TenantPurger(admin_pool, stores.redis, stores.clickhouse, repo),
                options=options,
                login=login,
                state=state,
            )
            await _lead(ctx, elector, stop, ready)
        finally:
            state.leader = state.running = False
            await elector.release()
    finally:
        if health is not None:
            await health.stop()
        await api.close()


async def _lead(
    ctx: handlers.OperatorContext, elector: LeaderElector, stop: asyncio.Event, ready: asyncio.Event | None
) -> None:
    kopf_stop = asyncio.Event()

    async def keep() -> None:
        try:
            await elector.keep(kopf_stop)
        finally:
            kopf_stop.set()

    async def relay() -> None:
        await stop.wait()
        kopf_stop.set()

    keeper = asyncio.create_task(keep(), name="ibex-lease-keeper")
    relay_task = asyncio.create_task(relay(), name="ibex-stop-relay")
    ctx.state.running = True
    try:
        await handlers.serve(ctx, kopf_stop, ready)
    finally:
        kopf_stop.set()
        relay_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relay_task
        try:
            await keeper
        except LeaseLost:
            raise
        except asyncio.CancelledError:
            pass


def _pepper(settings: Settings) -> bytes:
    if settings.key_pepper is not None:
        return settings.key_pepper.get_secret_value().encode()
    if settings.postgres_dsn and settings.redis_url and settings.clickhouse_url:
        raise OperatorError("IBEX_KEY_PEPPER is required with external stores (the proxy must use the same one)")
    # Attached to an embedded runtime (``--data-dir``): the same pepper file ``ibex dev`` uses.
    return load_or_create_secret(settings.data_dir / "pepper")


async def _main(options: OperatorOptions, settings: Settings) -> None:
    urls = StoreUrls.from_settings(settings)
    pepper = _pepper(settings)
    if options.migrate:
        # Before the pools open (they need the schema's types). Every replica may do this at once: the Postgres
        # runner takes an advisory lock and the ClickHouse statements are idempotent.
        clickhouse = ClickHouse(urls.clickhouse_url)
        try:
            await migrate_all(urls, settings, clickhouse)
        finally:
            await clickhouse.close()
    stores = await Stores.open(urls, settings, admin=True)
    stop, started = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    async def reclaim_signals() -> None:
        # kopf installs its own SIGINT/SIGTERM handlers when it starts; ours stop it the same way and also end
        # the lease keeper, so shutdown does not wait on kopf's stop-flag waiter.
        await started.wait()
        on_signals()

    on_signals()
    reclaimer = asyncio.create_task(reclaim_signals())
    try:
        await run(options, stores, pepper, stop=stop, ready=started)
    finally:
        reclaimer.cancel()
        await stores.close()


def main(options: OperatorOptions, settings: Settings) -> int:
    """Entry point of ``ibex operator``; returns the process exit code."""
    try:
        asyncio.run(_main(options, settings))
    except LeaseLost as e:
        log.error("stopping: %s", e)
        return 1
    except (OperatorError, StoreError, EmbeddedStoreError) as e:
        print(f"ibex operator: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
