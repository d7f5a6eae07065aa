"""Answers settled and checkpointed in batches per agent (migration 0034, ``proxy/settles.py``): every hold settled
once, the budget rows moved by the batch's sums, turns numbered in order, a failing checkpoint leaving the settles
standing, and one statement in flight per agent with what arrives meanwhile going in the next one."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from decimal import Decimal
from typing import Any
from uuid import UUID

from ibex_dataplane.proxy.capture import CaptureRequest
from ibex_dataplane.proxy.sessions import SessionService, Turn
from ibex_dataplane.proxy.settles import AnswerSettles
from ibex_dataplane.runtime.stores import Stores
from ibex_dataplane.shared.budget import BudgetPolicy, BudgetService, Enforcement, Settlement
from ibex_dataplane.shared.budget_repository import HoldStatus
from tests.support.capture import queued_turns
from tests.support.tenants import Tenant, TenantFactory

POLICY = BudgetPolicy(org_limit_usd=Decimal("10.00"), agent_limit_usd=Decimal("5.00"), enforcement=Enforcement.HARD_CAP)


async def answers(
    stores: Stores, t: Tenant, sessions: list[str], *, capture: CaptureRequest | None = None
) -> list[tuple[Settlement, Turn]]:
    """One held answer per entry of ``sessions`` (0.10 held, 0.01 * (i + 1) actual), in that order."""
    budgets = BudgetService(stores.db)
    out = []
    for i, session in enumerate(sessions):
        hold = await budgets.hold(t.org_id, t.agents["alpha"], f"srv-{i}", Decimal("0.10"), POLICY)
        settlement = budgets.settlement(hold, Decimal("0.01") * (i + 1), model="echo", prompt_tokens=3,
                                        completion_tokens=2)  # fmt: skip
        out.append((settlement, Turn(session, f"req-{i}", [f"m{i}"], f"c{i}", 3, 2, 1.5, capture)))
    return out


async def period(stores: Stores, org_id: UUID, scope_id: UUID) -> tuple[Decimal, Decimal]:
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT spent_usd, held_usd FROM budget_periods WHERE org_id = $1 AND scope_id = $2", org_id, scope_id
        )
    return row["spent_usd"], row["held_usd"]


async def transactions(stores: Stores, org_id: UUID) -> int:
    """How many transactions wrote the org's ledger rows (rows written by one statement share an xmin)."""
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        n: int = await conn.fetchval("SELECT count(DISTINCT xmin::text) FROM budget_ledger WHERE org_id = $1", org_id)
    return n


async def test_a_batch_settles_every_hold_and_numbers_each_sessions_turns(
    tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(directive=None)
    agent = t.agents["alpha"]
    batch = await answers(stores, t, ["b", "a", "b", "a", "b"])
    assert await period(stores, t.org_id, agent) == (Decimal(0), Decimal("0.50"))
    written = await SessionService(stores.db).settle_and_record_turns(t.org_id, agent, batch)
    # In the order given, although the statement takes them by session.
    assert [(w.hold_before, w.turn, w.checkpoint_error) for w in written] == [
        (HoldStatus.HELD, 1, None), (HoldStatus.HELD, 1, None), (HoldStatus.HELD, 2, None),
        (HoldStatus.HELD, 2, None), (HoldStatus.HELD, 3, None),
    ]  # fmt: skip
    spent = Decimal("0.15")  # 0.01 + 0.02 + 0.03 + 0.04 + 0.05
    assert await period(stores, t.org_id, agent) == (spent, Decimal(0))
    assert await period(stores, t.org_id, t.org_id) == (spent, Decimal(0))
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        turns = await conn.fetch(
            "SELECT s.external_id, c.turn, c.request_id FROM session_checkpoints c"
            " JOIN sessions s ON s.id = c.session_id WHERE c.org_id = $1 ORDER BY s.external_id, c.turn",
            t.org_id,
        )
    assert [tuple(r) for r in turns] == [
        ("a", 1, "req-1"), ("a", 2, "req-3"), ("b", 1, "req-0"), ("b", 2, "req-2"), ("b", 3, "req-4"),
    ]  # fmt: skip
    # Settling again changes no money (the checkpoints are not idempotent: that is the caller's business).
    again = await SessionService(stores.db).settle_and_record_turns(t.org_id, agent, batch[:2])
    assert [w.hold_before for w in again] == [HoldStatus.SETTLED, HoldStatus.SETTLED]
    assert await period(stores, t.org_id, agent) == (spent, Decimal(0))
    assert await transactions(stores, t.org_id) == 1


async def test_a_failing_checkpoint_in_a_batch_leaves_every_settle_standing(
    tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(directive=None)
    agent = t.agents["alpha"]
    good = await answers(stores, t, ["s", "s"])
    broken = CaptureRequest("bogus", None, [{"role": "user", "content": "hi"}], None)  # the queue's CHECK refuses it
    settlement, turn = good[1]
    batch = [good[0], (settlement, Turn(turn.external_id, turn.request_id, turn.message_digests,
                                        turn.completion_digest, 3, 2, 1.5, broken))]  # fmt: skip
    written = await SessionService(stores.db).settle_and_record_turns(t.org_id, agent, batch)
    assert [(w.hold_before, w.turn, w.checkpoint_error) for w in written] == [
        (HoldStatus.HELD, 1, None),
        (HoldStatus.HELD, None, "23514"),
    ]
    assert await period(stores, t.org_id, agent) == (Decimal("0.03"), Decimal(0))


async def test_a_batch_numbers_on_from_a_sessions_count_reopens_it_and_queues_each_capture(
    tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(directive=None)
    agent = t.agents["alpha"]
    sessions = SessionService(stores.db)
    for n in (1, 2):
        await sessions.record_turn(
            t.org_id, agent, "old", request_id=f"early-{n}", message_digests=["e"], completion_digest=None,
            prompt_tokens=1, completion_tokens=1, latency_ms=1.0,
        )  # fmt: skip
    assert await sessions.terminate(t.org_id, agent, "old")
    capture = CaptureRequest("turns", None, [{"role": "user", "content": "hi"}], None)
    batch = await answers(stores, t, ["old", "new", "old"], capture=capture)
    written = await sessions.settle_and_record_turns(t.org_id, agent, batch)
    assert [(w.hold_before, w.turn, w.checkpoint_error) for w in written] == [
        (HoldStatus.HELD, 3, None), (HoldStatus.HELD, 1, None), (HoldStatus.HELD, 4, None),
    ]  # fmt: skip
    assert stores.admin_pool is not None
    async with stores.admin_pool.acquire() as conn:
        opened = await conn.fetch(
            "SELECT external_id, status, turn_count, closed_at FROM sessions WHERE org_id = $1 ORDER BY external_id",
            t.org_id,
        )
        turns = await conn.fetch(
            "SELECT s.external_id, c.turn, c.request_id FROM session_checkpoints c"
            " JOIN sessions s ON s.id = c.session_id WHERE c.org_id = $1 ORDER BY s.external_id, c.turn",
            t.org_id,
        )
    assert [tuple(r) for r in opened] == [("new", "active", 1, None), ("old", "active", 4, None)]
    assert [tuple(r) for r in turns] == [
        ("new", 1, "req-1"), ("old", 1, "early-1"), ("old", 2, "early-2"), ("old", 3, "req-0"), ("old", 4, "req-2"),
    ]  # fmt: skip
    assert await queued_turns(stores, t.org_id) == [("new", 1), ("old", 3), ("old", 4)]


class Spawned:
    """A ``spawn`` for :class:`AnswerSettles` that keeps its tasks, and waits for them and what they spawn."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Future[object]] = set()

    def __call__(self, name: str, coro: Coroutine[Any, Any, object]) -> None:
        self.tasks.add(asyncio.ensure_future(coro))

    async def drained(self) -> None:
        while self.tasks:
            await asyncio.gather(*self.tasks)
            self.tasks = {task for task in self.tasks if not task.done()}


async def test_one_statement_per_agent_is_in_flight_and_the_rest_waits_for_the_next(
    tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(directive=None)
    agent = t.agents["alpha"]
    batch = await answers(stores, t, [f"s{i}" for i in range(12)])
    spawn, failed = Spawned(), list[str]()
    budgets = BudgetService(stores.db)
    settles = AnswerSettles(SessionService(stores.db), budgets, spawn, lambda: failed.append("checkpoint"), max_batch=4)
    settles.add(*batch[0])
    await asyncio.sleep(0)  # the writer starts and takes the first answer alone
    for answer in batch[1:]:  # these arrive while it is in flight: 11 answers, at most 4 per statement
        settles.add(*answer)
    await spawn.drained()  # the writer and anything it spawned
    assert failed == []
    assert await transactions(stores, t.org_id) == 4  # 1, then 4, 4 and 3
    spent = sum((Decimal("0.01") * (i + 1) for i in range(12)), Decimal(0))
    assert await period(stores, t.org_id, agent) == (spent, Decimal(0))
    assert await period(stores, t.org_id, t.org_id) == (spent, Decimal(0))


async def test_with_a_gather_window_answers_arriving_one_after_another_share_one_statement(
    tenants: TenantFactory, stores: Stores
) -> None:
    t = await tenants.create(directive=None)
    agent = t.agents["alpha"]
    batch = await answers(stores, t, [f"g{i}" for i in range(5)])
    spawn = Spawned()
    settles = AnswerSettles(SessionService(stores.db), BudgetService(stores.db), spawn, lambda: None, gather_s=0.2)
    settles.add(*batch[0])
    await asyncio.sleep(0)  # the writer starts; without a window it would send the first answer alone here
    for answer in batch[1:]:
        settles.add(*answer)
    await spawn.drained()
    assert await transactions(stores, t.org_id) == 1
    spent = sum((Decimal("0.01") * (i + 1) for i in range(5)), Decimal(0))
    assert await period(stores, t.org_id, agent) == (spent, Decimal(0))


class HeldSessions(SessionService):
    """A :class:`SessionService` whose first settle statement waits for ``release``; records when each statement
    was sent (loop time) and which answers it took."""

    def __init__(self, stores: Stores) -> None:
        super().__init__(stores.db)
        self.release = asyncio.Event()
        self.first_sent = asyncio.Event()
        self.first_returned = asyncio.Event()
        self.sent: list[tuple[float, list[str]]] = []

    async def settle_and_record_turns(self, org_id: UUID, agent_id: UUID, answers: Any) -> Any:
        self.sent.append((asyncio.get_running_loop().time(), [turn.request_id for _, turn in answers]))
        if len(self.sent) == 1:
            self.first_sent.set()
            await self.release.wait()
        written = await super().settle_and_record_turns(org_id, agent_id, answers)
        self.first_returned.set()
        return written


async def test_with_a_gather_window_every_statement_waits_for_its_oldest_answers_window_not_only_the_first(
    tenants: TenantFactory, stores: Stores
) -> None:
    """The answers that come while a statement is in flight do not go out the moment it returns: they wait out the
    window of the oldest of them, and what comes meanwhile joins them (before, a client sending one request after
    another was settled one or two answers per statement once the first window had passed)."""
    t = await tenants.create(directive=None)
    batch = await answers(stores, t, [f"w{i}" for i in range(3)])
    spawn, sessions, gather = Spawned(), HeldSessions(stores), 0.2
    settles = AnswerSettles(sessions, BudgetService(stores.db), spawn, lambda: None, gather_s=gather)
    loop = asyncio.get_running_loop()
    settles.add(*batch[0])
    await sessions.first_sent.wait()  # the first answer's window passed and its statement went out (held)
    came = loop.time()
    settles.add(*batch[1])  # comes while the first statement is in flight
    sessions.release.set()
    await sessions.first_returned.wait()
    settles.add(*batch[2])  # comes after it returned: within the second answer's window
    await spawn.drained()
    assert [taken for _, taken in sessions.sent] == [["req-0"], ["req-1", "req-2"]]
    assert sessions.sent[1][0] - came >= gather - 0.01  # the loop's timers may fire a clock tick early
    assert await transactions(stores, t.org_id) == 2
