"""The settles of served answers with their session checkpoints, gathered per agent.

One statement per agent is in flight at a time (:meth:`SessionService.settle_and_record_turns`); the answers of
that agent that finish meanwhile wait and go together in the next one: a busy proxy sends a batch per commit, so
the agent's and the org's budget rows, which every budget hold also takes, are locked once per batch instead of
once per answer. Nothing here delays the answer itself.

With a gather window (``IBEX_SETTLE_GATHER_MS``), a statement goes out once the oldest answer it takes has waited
that long (or once it is full), so that the answers of a client sending one request after another also go together:
each of them is sent at most the window after it came (or when the statement in flight returns, if that is later),
and its hold covers it meanwhile. Without a window, the answers that came while a statement was in flight go out as
soon as it returns, so a client sending one request after another was settled in statements of one or two answers.

When a statement fails it is unknown whether it committed: each of its answers is settled again alone
(idempotent, retried until Postgres is back, so no money is lost, :meth:`BudgetService.settle_again`), and its
checkpoints, which are not idempotent, count as failed.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any
from uuid import UUID

from ibex_dataplane.proxy.sessions import SessionService, Turn
from ibex_dataplane.shared.budget import BudgetService, Settlement

log = logging.getLogger(__name__)

Spawn = Callable[[str, Coroutine[Any, Any, object]], None]
Answer = tuple[Settlement, Turn]

MAX_BATCH = 64
"""Answers per statement at most: a longer queue goes in several, one after the other."""


class _Queue:
    """An agent's answers waiting for its writer, and when the oldest of them arrived (loop time)."""

    __slots__ = ("answers", "since")

    def __init__(self, first: Answer, now: float) -> None:
        self.answers = [first]
        self.since = now


class AnswerSettles:
    """Settles and checkpoints answers, one statement in flight per agent."""

    def __init__(
        self,
        sessions: SessionService,
        budgets: BudgetService,
        spawn: Spawn,
        on_checkpoint_failed: Callable[[], None],
        *,
        max_batch: int = MAX_BATCH,
        gather_s: float = 0.0,
    ) -> None:
        if max_batch < 1 or gather_s < 0:
            raise ValueError("max_batch must be positive and gather_s not negative")
        self._sessions = sessions
        self._budgets = budgets
        self._spawn = spawn
        self._checkpoint_failed = on_checkpoint_failed
        self._max_batch = max_batch
        self._gather_s = gather_s
        self._waiting: dict[tuple[UUID, UUID], _Queue] = {}

    def add(self, settlement: Settlement, turn: Turn) -> None:
        """Settle and checkpoint this answer: now when nothing of its agent is in flight, else with the next batch."""
        key = (settlement.hold.org_id, settlement.hold.agent_id)
        queue = self._waiting.get(key)
        if queue is not None:  # that agent's writer is running; it takes this answer next
            if not queue.answers:
                queue.since = asyncio.get_running_loop().time()
            queue.answers.append((settlement, turn))
            return
        self._waiting[key] = _Queue((settlement, turn), asyncio.get_running_loop().time())
        self._spawn("settle", self._write_all(key))

    async def _write_all(self, key: tuple[UUID, UUID]) -> None:
        queue = self._waiting[key]
        waiting = queue.answers
        loop = asyncio.get_running_loop()
        try:
            while waiting:
                if self._gather_s > 0 and len(waiting) < self._max_batch:
                    # the agent's next answers join this statement, up to the window of the oldest one here
                    left = queue.since + self._gather_s - loop.time()
                    if left > 0:
                        await asyncio.sleep(left)
                batch = waiting[: self._max_batch]
                del waiting[: self._max_batch]
                queue.since = -math.inf  # any left over waited the window already; new ones restart it
                await self._write(key, batch)
        finally:
            del self._waiting[key]  # no await since the queue was seen empty: nothing was added after it
            if waiting:  # cut short (cancelled at shutdown): what was not written is settled alone
                self._settle_alone(waiting, "cut short")

    async def _write(self, key: tuple[UUID, UUID], batch: list[Answer]) -> None:
        org_id, agent_id = key
        try:
            written = await self._sessions.settle_and_record_turns(org_id, agent_id, batch)
        except Exception as e:
            self._settle_alone(batch, type(e).__name__)
            return
        for (settlement, _), row in zip(batch, written, strict=True):
            self._budgets.settled(settlement, row.hold_before)
            if row.checkpoint_error is not None:
                self._checkpoint_failed()
                log.warning("session checkpoint failed (SQLSTATE %s); the settle stands", row.checkpoint_error)

    def _settle_alone(self, answers: list[Answer], why: str) -> None:
        log.warning("settle of %d answers with their checkpoints failed (%s); settling each alone", len(answers), why)
        for settlement, _ in answers:
            self._checkpoint_failed()
            self._spawn("settle", self._budgets.settle_again(settlement))
