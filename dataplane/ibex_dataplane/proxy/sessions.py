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

from ibex_dataplane.proxy.capture import CAPTURE_TTL, CaptureRequest
from ibex_dataplane.shared.budget import Settlement
from ibex_dataplane.shared.budget_repository import HoldStatus
from ibex_dataplane.store.postgres import Database

_TURN = "$3, $4, $5, $6, $7, $8, $9, $10, $11, $12::jsonb, $13, $14"
_SETTLE_TURN = (
    "SELECT hold_status, turn, checkpoint_error FROM ibex_answer_settle_as($1, $2, $3, $4, $5, $6, $7,"
    " $8, $9, $10, $11, $12, $13, $14, $15::jsonb, $16, $17)"
)


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

    def args(self, *, tokens: bool = True) -> tuple[object, ...]:
        """The checkpoint's statement arguments; without ``tokens`` when the statement has them already (the
        settle's usage is the turn's)."""
        c = self.capture
        counts = (self.prompt_tokens, self.completion_tokens) if tokens else ()
        return (
            self.external_id, self.request_id, list(self.message_digests), self.completion_digest, *counts,
            self.latency_ms, c.mode if c else None, c.model if c else None, c.payload() if c else None,
            c.observed_at if c else None, CAPTURE_TTL,
        )  # fmt: skip


@dataclass(frozen=True)
class SettledTurn:
    """What :meth:`SessionService.settle_and_record_turn` wrote: the hold's status before (None: no such hold),
    and the turn number, or the SQLSTATE of the checkpoint that failed while the settle stood."""

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

    async def settle_and_record_turn(self, settlement: Settlement, turn: Turn) -> SettledTurn:
        """Settle the answer's budget hold and checkpoint its turn in one statement (``ibex_answer_settle_as``):
        one transaction and one commit instead of two. A checkpoint that fails does not undo the settle (it runs in
        its own subtransaction); an error of the statement itself means neither may have been written, and since
        settling is idempotent and a checkpoint is not, the caller settles again and leaves the checkpoint."""
        hold = settlement.hold
        row = await self._db.call_as(
            hold.org_id, hold.agent_id, _SETTLE_TURN, hold.id, settlement.actual_usd, settlement.model,
            settlement.prompt_tokens, settlement.completion_tokens, *turn.args(tokens=False),
        )  # fmt: skip
        assert row is not None
        before = row["hold_status"]
        return SettledTurn(HoldStatus(before) if before is not None else None, row["turn"], row["checkpoint_error"])

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
