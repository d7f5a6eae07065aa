"""Sessions: the client's X-IBEX-Session-ID mapped to a row, one checkpoint per turn, never message text.

Checkpoints keep SHA-256 digests of each message and of the completion, token counts and latency (the text of a
captured turn goes to the capture queue, deleted once processed, never to the checkpoint). Writing them
is after-response work that degrades (a failure is counted, the answer is unaffected). Idle sessions are closed
by :meth:`SessionService.sweep_idle`, which the proxy runs periodically.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from uuid import UUID

from ibex_dataplane.proxy.capture import CAPTURE_TTL, CaptureRequest
from ibex_dataplane.store.postgres import Database


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
        row = await self._db.call_as(
            org_id, agent_id,
            "SELECT ibex_session_turn_capture_as($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::jsonb, $13, $14)"
            " AS turn",
            external_id, request_id, list(message_digests), completion_digest, prompt_tokens, completion_tokens,
            latency_ms, capture.mode if capture else None, capture.model if capture else None,
            capture.payload() if capture else None, capture.observed_at if capture else None, CAPTURE_TTL,
        )  # fmt: skip
        assert row is not None
        turn: int = row["turn"]
        return turn

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
