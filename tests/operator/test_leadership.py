"""Real ``ibex operator`` processes: a SIGKILL in the middle of a reconcile leaves nothing half-done that a restart
does not repair, and two replicas never apply at once (the Lease decides; a standby takes over when it expires,
at once when the leader shuts down cleanly)."""

from __future__ import annotations

import json
import secrets
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import asyncpg

from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import Stores, load_or_create_secret
from ibex_dataplane.security.apikeys import parse_token, secret_matches
from tests.operator.support import (
    OperatorProcess,
    apply,
    lease_holder,
    spawn_operator,
    wait_condition,
    wait_until,
)
from tests.operator.test_resources import agent, api_key, directive, into, org, secret_token

if TYPE_CHECKING:
    from tests.operator.conftest import KubeApiserver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def blocked_statements(stores: Stores, *tables: str) -> list[str]:
    """Statements waiting for a table lock, one per table named."""
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        rows = await conn.fetch("SELECT query FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
    return [t for t in tables if any(t in r["query"] for r in rows)]


LONG_LEASE = 30.0  # seconds: an expiry this long is far above any takeover after a release


async def test_an_operator_killed_mid_reconcile_converges_after_a_restart_without_duplicates(
    kube_apiserver: KubeApiserver, solo_namespace: str, embedded: EmbeddedRuntime, stores: Stores, tmp_path: Path
) -> None:
    kube, ns = kube_apiserver, solo_namespace
    running: list[OperatorProcess] = []
    locker = await asyncpg.connect(embedded.info.postgres_admin_dsn)

    def spawn() -> OperatorProcess:
        # attached like `ibex operator --data-dir` next to `ibex dev`: stores from runtime.json, the local pepper
        op = spawn_operator(kube, embedded.info, tmp_path, identity="solo-a", namespace=ns, data_dir=embedded.data_dir)
        running.append(op)
        return op

    try:
        spawn()
        await apply(kube, *into(ns, org("acme"), agent("bot", "acme"), directive("bot-directive", "bot", "One.")))
        await wait_condition(kube, "directive", "bot-directive", ns)

        # Hold the next writes inside their transactions: the key is generated and its row is being written,
        # the second directive version is being inserted. Then kill the operator right there.
        tx = locker.transaction()
        await tx.start()
        await locker.execute("LOCK TABLE api_keys, directive_versions IN SHARE MODE")
        await apply(kube, *into(ns, api_key("bot-key", "acme", ["bot"]), directive("bot-directive", "bot", "Two.")))

        async def both_blocked() -> bool:
            return len(await blocked_statements(stores, "api_keys", "directive_versions")) == 2

        await wait_until(both_blocked, timeout=30, what="both reconciles to block on the held locks")
        running[0].kill()
        await tx.rollback()

        # Same identity (the chart uses the pod name): the restarted process takes its lease back at once.
        started = time.monotonic()
        spawn()
        k = await wait_condition(kube, "apikey", "bot-key", ns, timeout=30)
        d = await wait_condition(kube, "directive", "bot-directive", ns, generation=2, timeout=30)
        assert time.monotonic() - started < 20
        assert lease_holder(kube, ns, "ibex-operator") == "solo-a"

        assert stores.admin_pool is not None
        async with stores.admin_pool.acquire() as conn:
            keys = await conn.fetch("SELECT id, secret_hash FROM api_keys WHERE namespace = $1", ns)
            versions = await conn.fetch(
                "SELECT v.version, v.content FROM directive_versions v JOIN directives d ON d.id = v.directive_id"
                " WHERE d.namespace = $1 ORDER BY 1",
                ns,
            )
            orgs = await conn.fetchval("SELECT count(*) FROM organizations WHERE namespace = $1", ns)
        assert orgs == 1
        assert [(v["version"], v["content"]) for v in versions] == [(1, "One."), (2, "Two.")]
        assert d["status"]["version"] == 2
        (key,) = keys
        assert key["id"] == k["status"]["keyId"]
        token = await secret_token(kube, ns, "bot-key")
        assert token is not None
        key_id, secret = parse_token(token)
        pepper = load_or_create_secret(embedded.data_dir / "pepper")
        assert key_id == key["id"] and secret_matches(pepper, secret, bytes(key["secret_hash"]))
    finally:
        await locker.close()
        for op in running:
            op.kill()


async def test_two_replicas_never_apply_at_once_and_a_standby_takes_over(
    kube_apiserver: KubeApiserver, solo_namespace: str, embedded: EmbeddedRuntime, tmp_path: Path
) -> None:
    kube, ns = kube_apiserver, solo_namespace
    pepper = secrets.token_hex(16)
    ops: dict[str, OperatorProcess] = {}

    def spawn(identity: str, *extra: str, lease_duration: float = 3) -> OperatorProcess:
        ops[identity] = spawn_operator(
            kube, embedded.info, tmp_path, identity=identity, namespace=ns, pepper=pepper,
            lease_duration=lease_duration, extra=extra,
        )  # fmt: skip
        return ops[identity]

    async def probe(port: int, path: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}{path}") as resp:
            return resp.status, await resp.text()

    async def holder_is(identity: str) -> bool:
        return lease_holder(kube, ns, "ibex-operator") == identity

    async def waiting(op: OperatorProcess) -> bool:
        return "waiting, the lease is held by" in op.log()

    try:
        a = spawn("replica-a")
        await wait_until(lambda: holder_is("replica-a"), timeout=30, what="replica-a to lead")
        health_port = free_port()
        # replica-b writes a long lease when it leads, so its release (below) cannot be mistaken for an expiry
        b = spawn("replica-b", "--health-port", str(health_port), lease_duration=LONG_LEASE)
        await wait_until(lambda: waiting(b), timeout=30, what="replica-b to wait for the lease")
        # a standby is alive and ready (or a rolling update could never bring it up), and says it does not lead
        assert (await probe(health_port, "/healthz"))[0] == 200
        status, body = await probe(health_port, "/readyz")
        assert status == 200 and json.loads(body)["leader"] is False
        assert "ibex_operator_leader 0" in (await probe(health_port, "/metrics"))[1]

        await apply(kube, *into(ns, org("acme")))
        await wait_condition(kube, "organization", "acme", ns)
        assert "Organization" in a.log() and "Ready=" in a.log()
        assert "Ready=" not in b.log() and "holds the lease" not in b.log()

        # The leader dies without a word: the standby waits for the lease to expire (3 s), then leads.
        killed = time.monotonic()
        a.kill()
        await wait_until(lambda: holder_is("replica-b"), timeout=20, what="replica-b to take over")
        assert time.monotonic() - killed >= 2.0, "the standby must not take a lease that has not expired"
        await apply(kube, *into(ns, agent("bot", "acme")))
        await wait_condition(kube, "agent", "bot", ns, timeout=20)
        assert "Agent" in b.log() and "bot: Ready=True" in b.log()
        metrics = (await probe(health_port, "/metrics"))[1]
        assert "ibex_operator_leader 1" in metrics
        assert 'ibex_operator_reconcile_total{kind="Agent",reason="Reconciled"}' in metrics

        # A clean shutdown releases the lease: the next standby leads without waiting for it to expire.
        c = spawn("replica-c")
        await wait_until(lambda: waiting(c), timeout=30, what="replica-c to wait for the lease")
        stopped = time.monotonic()
        assert b.terminate() == 0
        await wait_until(lambda: holder_is("replica-c"), timeout=LONG_LEASE, what="replica-c to take over")
        assert time.monotonic() - stopped < LONG_LEASE / 2, "replica-c waited for the lease to expire"
        assert "released the lease" in b.log()
    finally:
        for op in ops.values():
            op.kill()
