"""Sessions: the client's X-IBEX-Session-ID mapped to a row, one checkpoint per turn, never message text.

Checkpoints keep SHA-256 digests of each message and of the completion, token counts and latency (the text of a
captured turn goes to the capture queue, deleted once processed, never to the checkpoint). Writing them
is after-response work that degrades (a failure is counted, the answer is unaffected). Idle sessions are closed
by :meth:`SessionService.sweep_idle`, which the proxy runs periodically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

import orjson

from ibex_dataplane.proxy.capture import CAPTURE_TTL, CaptureRequest
from ibex_dataplane.shared.budget import Settlement
from ibex_dataplane.shared.budget_repository import HoldStatus
from ibex_dataplane.store.postgres import Database

_TURN = "$3, $4, $5, $6, $7, $8, $9, $10, $11, $12::jsonb, $13, $14"
_SETTLE_TURNS = "SELECT hold_status, turn, checkpoint_error FROM ibex_answer_settle_batch_as($1, $2, $3::jsonb, $4)"


@dataclass(frozen=True)
class Turn:
    """One answered turn's checkpoint: digests, counts and latency, never text (the capture carries text)."""

    external_id: str
    request_id: str
    message_digests: Sequence[str]
    completion_digest: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    capture: CaptureRequest | None = None

    def args(self) -> tuple[object, ...]:
        """The checkpoint's statement arguments."""
        c = self.capture
        return (
            self.external_id, self.request_id, list(self.message_digests), self.completion_digest, self.prompt_tokens,
            self.completion_tokens, self.latency_ms, c.mode if c else None, c.model if c else None,
            c.payload() if c else None, c.observed_at if c else None, CAPTURE_TTL,
        )  # fmt: skip


def _answer_item(settlement: Settlement, turn: Turn) -> dict[str, object]:
    """One answer as ``ibex_answer_settle_batch_as`` reads it (migrations 0034-0037): the settle's usage is the
    turn's; a request drawn from a lease carries its drawn amount."""
    c = turn.capture
    return {
        "hold": str(settlement.hold.id), "actual": f"{settlement.actual_usd:f}", "model": settlement.model,
        "prompt_tokens": settlement.prompt_tokens, "completion_tokens": settlement.completion_tokens,
        "session": turn.external_id, "request_id": turn.request_id, "messages": list(turn.message_digests),
        "completion": turn.completion_digest, "latency_ms": turn.latency_ms, "mode": c.mode if c else None,
        "capture_model": c.model if c else None, "capture": orjson.Fragment(c.payload()) if c else None,
        "observed_at": c.observed_at.isoformat() if c and c.observed_at else None,
        **({"drawn": f"{settlement.hold.amount_usd:f}"} if settlement.hold.lease else {}),
    }  # fmt: skip


@dataclass(frozen=True)
class SettledTurn:
    """What :meth:`SessionService.settle_and_record_turns` wrote for one answer: the hold's status before (None:
    no such hold), and the turn number, or the SQLSTATE of the checkpoint that failed while the settle stood."""

    hold_before: HoldStatus | None
    turn: int | None
    checkpoint_error: str | None


class SessionService:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def record_turn(
        self,
        org_id: UUID,
        agent_id: UUID,
        external_id: str,
        *,
        request_id: str,
        message_digests: Sequence[str],
        completion_digest: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        latency_ms: float,
        capture: CaptureRequest | None = None,
    ) -> int:
        """Append a checkpoint (reopening a closed session of the same id); returns the turn number.

        One round trip (``ibex_session_turn_capture_as``): it runs after every answer. With ``capture``, the same
        statement queues the turn's capture job, so a checkpointed turn is never missing from the queue.
        """
        turn = Turn(external_id, request_id, message_digests, completion_digest, prompt_tokens, completion_tokens,
                    latency_ms, capture)  # fmt: skip
        row = await self._db.call_as(
            org_id, agent_id, f"SELECT ibex_session_turn_capture_as($1, $2, {_TURN}) AS turn", *turn.args()
        )
        assert row is not None
        number: int = row["turn"]
        return number

    async def settle_and_record_turns(
        self, org_id: UUID, agent_id: UUID, answers: Sequence[tuple[Settlement, Turn]]
    ) -> list[SettledTurn]:
        """Settle the budget holds of answers of one agent and checkpoint their turns, in one statement
        (``ibex_answer_settle_batch_as``): one transaction, one commit, and the budget rows moved once by the sums.
        Returns what was written for each answer, in the order given.

        A checkpoint that fails does not undo its settle (the checkpoints run in a subtransaction of their own, and
        when one fails each is retried alone); an error of the statement itself means none of it may have been
        written, and since settling is idempotent and a checkpoint is not, the caller settles each answer again and
        leaves the checkpoints. The statement takes the turns in order of session id (a session's turns keep their
        order), so that two batches of one agent written at the same time (several workers) lock session rows in
        the same order and cannot deadlock."""
        order = sorted(range(len(answers)), key=lambda i: answers[i][1].external_id)
        items = [_answer_item(*answers[i]) for i in order]
        rows = await self._db.call_as_rows(org_id, agent_id, _SETTLE_TURNS, orjson.dumps(items).decode(), CAPTURE_TTL)
        written = {
            i: SettledTurn(HoldStatus(r["hold_status"]) if r["hold_status"] is not None else None, r["turn"],
                           r["checkpoint_error"])
            for i, r in zip(order, rows, strict=True)
        }  # fmt: skip
        return [written[i] for i in range(len(answers))]

    async def terminate(self, org_id: UUID, agent_id: UUID, external_id: str) -> bool:
        """Close the session; False when the agent has no such session (or it is already closed)."""
        async with self._db.tenant(org_id, agent_id) as conn:
            status = await conn.execute(
                "UPDATE sessions SET status = 'closed', closed_at = now(), close_reason = 'terminated'"
                " WHERE org_id = $1 AND agent_id = $2 AND external_id = $3 AND status = 'active'",
                org_id,
                agent_id,
                external_id,
            )
        return str(status).endswith(" 1")

    async def sweep_idle(self, idle: timedelta) -> int:
        async with self._db.unscoped() as conn:
            closed: int = await conn.fetchval("SELECT ibex_sweep_idle_sessions($1)", idle)
            return closed
