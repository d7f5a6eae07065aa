"""What of a chat turn is captured into memory (``spec.memory.capture``), decided after the answer.

The proxy only chooses the messages and hands them to the durable queue with the turn's session checkpoint (one
statement, :meth:`SessionService.record_turn`); the memory stage's workers turn them into memories. Captured are
the client's own messages of this turn (the user messages after the last assistant message, as the client sent
them: never the directive or the memory context the proxy injected) and, when the agent captures the ``assistant``
role, the text of the answer. Only text is kept: image and audio parts, tool calls and tool results are not. A
``facts`` job also carries a few earlier messages, as context for the extraction model.

``X-IBEX-Observed-At`` (RFC 3339) tells when the turn happened, for clients that replay or import conversations;
it defaults to the time of the answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from aiohttp import web

from ibex_dataplane.proxy.repository import AgentPolicy
from ibex_dataplane.shared.errors import ApiError

OBSERVED_AT_HEADER = "X-IBEX-Observed-At"
# Text is kept until a worker has processed it; this bounds it when no worker runs.
CAPTURE_TTL = timedelta(days=7)
_FUTURE_SKEW = timedelta(minutes=5)
# How many earlier messages a facts job carries for the extraction model to resolve references with.
FACTS_CONTEXT_MESSAGES = 6


@dataclass(frozen=True)
class CaptureRequest:
    mode: str  # turns | facts
    model: str | None  # extraction model (facts)
    messages: list[dict[str, Any]]  # [{"role", "content"}, with "context": true for earlier ones (facts)]
    observed_at: datetime | None

    def payload(self) -> str:
        return orjson.dumps(self.messages).decode()


def observed_at_of(request: web.Request) -> datetime | None:
    """The client's ``X-IBEX-Observed-At``, or None; a malformed or future value is a 400."""
    raw = request.headers.get(OBSERVED_AT_HEADER)
    if raw is None:
        return None
    problem = "must be an RFC 3339 date-time with a time zone, not in the future"
    try:
        value = datetime.fromisoformat(raw.strip().replace("Z", "+00:00"))
    except ValueError:
        value = None
    if value is None or value.tzinfo is None or value > datetime.now(UTC) + _FUTURE_SKEW:
        raise ApiError(
            400, "INVALID_REQUEST", f"the {OBSERVED_AT_HEADER} header is invalid",
            field_errors=[{"field": f"header {OBSERVED_AT_HEADER}", "message": problem}],
        )  # fmt: skip
    return value


def text_of(content: Any) -> str:
    """The text of a message's ``content``: the string itself, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        parts = [
            p["text"].strip()
            for p in content
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        ]
        return "\n".join(p for p in parts if p)
    return ""


def answer_text(choices: Any) -> str:
    """The text of the first choice of a chat completion body's ``choices``."""
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        message = choices[0].get("message")
        if isinstance(message, Mapping):
            return text_of(message.get("content"))
    return ""


def streamed_answer_text(payloads: Iterable[bytes]) -> str:
    """The content text of the first choice carried by ``chat.completion.chunk`` payloads (tool calls excluded)."""
    parts: list[str] = []
    for payload in payloads:
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list):
            continue
        for choice in choices:
            if isinstance(choice, Mapping) and choice.get("index", 0) == 0:
                delta = choice.get("delta")
                if isinstance(delta, Mapping) and isinstance(delta.get("content"), str):
                    parts.append(delta["content"])
    return "".join(parts).strip()


def capture_of(
    agent: AgentPolicy,
    client_messages: Sequence[Any],
    answer: str,
    observed_at: datetime | None,
    org_default_model: str | None = None,
) -> CaptureRequest | None:
    """The capture job of this turn, or None (capture off, memory off, or nothing to capture).

    For ``facts`` the job also carries up to :data:`FACTS_CONTEXT_MESSAGES` earlier user and assistant messages of
    the conversation, marked ``"context": true``, so the extraction model can resolve references; facts are only
    taken from the turn's own messages. Its model is the agent's ``extractionModel``, else the agent's default
    model, else the org's."""
    if agent.memory_capture not in ("turns", "facts") or not agent.memory_enabled:
        return None
    captured: list[dict[str, Any]] = []
    earlier: list[dict[str, Any]] = []
    latest: list[dict[str, Any]] = []
    for message in client_messages:
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            continue
        text = text_of(message.get("content"))
        if message.get("role") == "assistant":
            earlier.extend(latest)
            latest = []
            if text:
                earlier.append({"role": "assistant", "content": text, "context": True})
        elif text:
            latest.append({"role": "user", "content": text})
    if "user" in agent.memory_capture_roles:
        captured.extend(latest)
    else:
        earlier.extend(latest)
    if "assistant" in agent.memory_capture_roles and answer:
        captured.append({"role": "assistant", "content": answer})
    if not captured:
        return None
    if agent.memory_capture == "turns":
        return CaptureRequest("turns", None, captured, observed_at)
    context = [{**m, "context": True} for m in earlier[-FACTS_CONTEXT_MESSAGES:]]
    model = agent.memory_extraction_model or agent.default_model or org_default_model
    return CaptureRequest("facts", model, [*context, *captured], observed_at)
