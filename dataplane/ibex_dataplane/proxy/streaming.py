"""The streaming relay of the generation pipeline: provider chunks out to the client as they arrive.

:func:`relay` opens the provider stream (everything that can fail before the first byte fails there, and the
client still gets a proper HTTP status), then forwards each ``chat.completion.chunk`` through the edge's encoder
(Chat Completions chunks, Responses ``response.*`` events or Anthropic Messages events). The first event is written
at once; after it, events the upstream sent together (chunks marked ``more``) are written together, one write for a
run instead of one per event, and the last ones with the stream's end. A provider failure after
the first byte closes the stream with the edge's error frames. A client disconnect cancels the task, which leaves
the provider's context and so closes the upstream connection at once. Whatever was served is accounted: the
provider's usage, or a conservative estimate of what was forwarded.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from aiohttp import web

from ibex_dataplane.providers.base import ChatRequest, StreamChunk, StreamDone, Usage
from ibex_dataplane.providers.errors import ProviderError
from ibex_dataplane.providers.registry import ProviderRegistry
from ibex_dataplane.proxy.accounting import Accounting, GenerationPlan, streamed_usage
from ibex_dataplane.proxy.capture import streamed_answer_text
from ibex_dataplane.proxy.edge import Edge, RenderContext, StreamEncoder
from ibex_dataplane.proxy.gates import GateState
from ibex_dataplane.proxy.handoff import FALLBACK_HEADER, keep_answer, provider_error_response, render_context
from ibex_dataplane.proxy.metrics import ProxyMetrics


async def relay(
    state: GateState,
    plan: GenerationPlan,
    chat: ChatRequest,
    edge: Edge,
    providers: ProviderRegistry,
    metrics: ProxyMetrics,
    accounting: Accounting,
) -> web.StreamResponse:
    usage: Usage | None = None
    served_by = plan.model.name
    response: web.StreamResponse | None = None
    encoder: StreamEncoder | None = None
    digest = hashlib.sha256()
    forwarded: list[bytes] = []  # chunks already sent: what a stream cut short is billed from
    upstream_failed = False  # the provider failed after the stream began: the answer is not whole
    started = time.perf_counter()
    opened: list[str] = []

    def served() -> Usage | None:
        return usage if usage is not None else streamed_usage(plan, forwarded)

    try:
        async with providers.stream(chat, on_open=opened.append) as events:
            served_by = opened[-1] if opened else plan.model.name
            headers = {**state.response_headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                       "X-Accel-Buffering": "no", "X-Request-ID": state.request_id}  # fmt: skip
            if served_by != plan.model.name:
                headers[FALLBACK_HEADER] = served_by
            response = web.StreamResponse(status=200, headers=headers)  # X-Request-ID: before the middleware runs
            ctx: RenderContext = render_context(state, plan, served_by)
            encoder = edge.encoder(ctx)
            await response.prepare(state.request)
            finish_reason: str | None = None
            held: list[bytes] = []  # frames of chunks marked ``more``: written with the next ones, in one write
            first = True
            try:
                async for event in events:
                    if isinstance(event, StreamChunk):
                        digest.update(event.data)
                        forwarded.append(event.data)
                        held += encoder.chunk(event.data)
                        if held and (first or not event.more):  # the first event goes out at once, alone
                            await response.write(b"".join(held))
                            held.clear()
                            first = False
                    elif isinstance(event, StreamDone):
                        usage, served_by, plan.provider = event.usage, event.model, event.provider
                        finish_reason = event.finish_reason
            except ProviderError as e:
                upstream_failed = True
                metrics.provider_calls.labels(e.provider, e.code).inc()
                await response.write(b"".join([*held, *encoder.error(e.code, e.message, state.request_id)]))
            else:
                frames = encoder.finish(usage, finish_reason)
                final = encoder.final()
                if final is not None:  # kept before the last event, so a retrieval right after finds it
                    await keep_answer(edge, state, final, metrics)
                await response.write(b"".join([*held, *frames]))
            await response.write_eof()
    except ProviderError as e:
        metrics.provider_calls.labels(e.provider, e.code).inc()
        state.extra["error_code"] = e.code
        accounting.after(state, plan, served(), served_by)
        if response is None:
            return provider_error_response(e, state)
        return response
    except (ConnectionResetError, asyncio.CancelledError):
        accounting.after(state, plan, served(), served_by)
        raise
    except BaseException:
        accounting.after(state, plan, served(), served_by)
        raise
    plan.upstream_ms = (time.perf_counter() - started) * 1000
    metrics.gathered_counter(metrics.provider_calls, plan.provider or plan.model.provider, "ok").inc()
    answer = None if upstream_failed else streamed_answer_text(forwarded)
    accounting.after(state, plan, served(), served_by, digest.hexdigest(), answer)
    assert response is not None
    return response
