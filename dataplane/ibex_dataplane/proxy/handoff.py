"""What the provider handoff of every generation route shares: the envelope for a provider failure, the render
context of an answer and the header that says a fallback model answered."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from ibex_dataplane.providers.errors import ProviderError, UpstreamRejected
from ibex_dataplane.proxy.accounting import GenerationPlan
from ibex_dataplane.proxy.edge import Edge, RenderContext
from ibex_dataplane.proxy.gates import GateState
from ibex_dataplane.proxy.metrics import ProxyMetrics
from ibex_dataplane.shared.errors import error_response

FALLBACK_HEADER = "X-IBEX-Fallback-Model"
log = logging.getLogger(__name__)


async def keep_answer(edge: Edge, state: GateState, answer: dict[str, Any], metrics: ProxyMetrics) -> None:
    """Let the edge keep a finished answer (the Responses API stores it) before the client sees its end, so a
    retrieval right after the answer finds it. A failure degrades (counted), it never fails the answer."""
    caller = state.require_caller()
    _, agent = state.require_agent()
    work = edge.served(caller.org_id, agent.id, answer)
    if work is None:
        return
    try:
        await asyncio.shield(work)
    except Exception as e:
        metrics.degradations.labels(f"{edge.route}_store").inc()
        log.warning("keeping the answer failed: %s request_id=%s", type(e).__name__, state.request_id)


def provider_error_response(e: ProviderError, state: GateState) -> web.Response:
    """The envelope for a provider failure before the first byte: 429/503 carry ``Retry-After``."""
    headers = dict(state.response_headers)
    if e.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(e.retry_after)))
    elif e.status in (429, 503):  # the upstream named no time (or none was asked): say when to come back
        headers["Retry-After"] = "1"
    if isinstance(e, UpstreamRejected):
        err = e.body.get("error") if isinstance(e.body, dict) else None
        message = err.get("message") if isinstance(err, dict) and isinstance(err.get("message"), str) else e.message
        code = "UNPROCESSABLE" if e.status == 422 else "VALIDATION_ERROR" if e.status == 400 else "PROVIDER_ERROR"
        status = e.status if 400 <= e.status < 500 else 502
        return error_response(status, code, f"upstream rejected the request: {message}", state.request_id,
                              headers=headers)  # fmt: skip
    return error_response(e.status, e.code, e.message, state.request_id, headers=headers)


def render_context(state: GateState, plan: GenerationPlan, served_by: str) -> RenderContext:
    return RenderContext(
        request_id=state.request_id, model=served_by, created=int(time.time()), prompt_tokens=plan.prompt_tokens,
        client_body=state.json_or_none(),
    )  # fmt: skip
