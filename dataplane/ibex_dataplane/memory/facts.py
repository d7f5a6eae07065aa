"""Fact extraction for ``capture: facts``: one job's messages in, candidate memories out, every call billed.

The capture worker hands a ``facts`` job here. The extraction model (the job's, chosen by the proxy from the
agent's ``extractionModel`` or its default model) is checked against the org's model policy and the catalog at
the time of the call, and each call is billed like a chat: a budget hold of its worst-case cost on the org and the
agent (``HardCap`` refuses), the provider call through the registry (fallback chains and circuit breakers as for
the proxy), then the hold settled to the priced usage, with a ``usage_facts`` row so ``/v1/usage`` counts it. A
call that fails before any usage releases its hold.

A malformed answer (not the schema of :mod:`ibex_dataplane.memory.extraction`) is billed and asked once more, with
the problem named; a second malformed answer fails the job for good. Outages (provider 5xx, timeouts, rate
limits, Postgres down) are :class:`ExtractionUnavailable`: the worker retries the job with backoff. A refusal that
no retry can change (model not allowed or unknown, budget exhausted, tenant suspended, upstream 4xx) is
:class:`ExtractionRefused`. Logs carry codes and counts, never conversation text.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from ibex_dataplane.memory.extraction import Fact, MalformedExtraction, correction, extraction_body, parse_facts
from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.providers.base import ChatRequest
from ibex_dataplane.providers.catalog import ModelCatalog, ModelInfo, ModelKind
from ibex_dataplane.providers.errors import ProviderError, ProviderTimeout, ProviderUnavailable
from ibex_dataplane.providers.registry import ProviderRegistry
from ibex_dataplane.providers.tokens import estimate_chat_tokens
from ibex_dataplane.shared.budget import BudgetExceeded, BudgetHold, BudgetPolicy, BudgetService, Enforcement
from ibex_dataplane.shared.model_policy import model_allowed
from ibex_dataplane.shared.usage import USAGE_COLUMNS
from ibex_dataplane.store.clickhouse import ClickHouse
from ibex_dataplane.store.errors import StoreError

log = logging.getLogger(__name__)


class ExtractionUnavailable(Exception):
    """The extraction could not run now (provider or store outage): retry the job later."""


class ExtractionRefused(Exception):
    """The extraction can never succeed as configured: the job fails for good."""


def answer_of(body: dict[str, Any]) -> str:
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return str(message["content"])
    return ""


class FactExtractor:
    def __init__(
        self,
        repo: MemoryRepository,
        catalog: ModelCatalog,
        budgets: BudgetService,
        clickhouse: ClickHouse,
        metrics: MemoryMetrics,
        *,
        timeout: float = 60.0,
        max_output: int = 1024,
    ) -> None:
        self._repo = repo
        self._catalog = catalog
        self._budgets = budgets
        self._clickhouse = clickhouse
        self._metrics = metrics
        self._timeout = timeout
        self._max_output = max_output
        self.registry: ProviderRegistry | None = None  # set by the memory app once its HTTP session is open

    async def facts(
        self,
        tenant: Tenant,
        *,
        model: str,
        earlier: Sequence[dict[str, str]],
        latest: Sequence[dict[str, str]],
        observed_at: datetime,
        request_id: str,
    ) -> tuple[list[Fact], str]:
        """The facts of ``latest`` and the model that answered."""
        info, policy = await self._checked(tenant, model)
        body = extraction_body(info.name, earlier, latest, observed_at, min(self._max_output, info.max_output_tokens))
        answer, served_by = await self._call(tenant, info, policy, body, request_id)
        try:
            return parse_facts(answer), served_by
        except MalformedExtraction as e:
            self._metrics.extraction_calls.labels("malformed").inc()
            log.warning("extraction answer malformed (request_id=%s): %s; asking once more", request_id, e)
            retried = correction(body, answer, str(e))
            answer, served_by = await self._call(tenant, info, policy, retried, request_id)
            try:
                return parse_facts(answer), served_by
            except MalformedExtraction as again:
                self._metrics.extraction_calls.labels("malformed").inc()
                raise ExtractionRefused(f"the extraction model answered malformed JSON twice: {again}") from again

    async def _checked(self, tenant: Tenant, model: str) -> tuple[ModelInfo, BudgetPolicy]:
        try:
            row = await self._repo.extraction_policy(tenant)
        except StoreError as e:
            raise ExtractionUnavailable(type(e).__name__) from e
        if row is None:
            raise ExtractionRefused("the agent or its organization no longer exists")
        if row["org_suspended"] or row["agent_suspended"]:
            raise ExtractionRefused("the organization or the agent is suspended")
        if not model_allowed(model, row["models_allow"], row["models_deny"]):
            raise ExtractionRefused(f"MODEL_NOT_ALLOWED: model '{model}' is not allowed for this organization")
        info = self._catalog.get(model)
        if info is None or info.kind is not ModelKind.CHAT:
            raise ExtractionRefused(f"the extraction model '{model}' is not a chat model of this gateway's catalog")
        policy = BudgetPolicy(
            org_limit_usd=row["org_limit"], agent_limit_usd=row["agent_limit"],
            enforcement=Enforcement(row["budget_enforcement"]),
        )  # fmt: skip
        return info, policy

    async def _call(
        self, tenant: Tenant, info: ModelInfo, policy: BudgetPolicy, body: dict[str, Any], request_id: str
    ) -> tuple[str, str]:
        if self.registry is None:
            raise ExtractionUnavailable("the provider registry is not open")
        call_id = f"{request_id}.facts-{uuid.uuid4().hex[:12]}"  # one budget hold per call, never reused
        prompt = estimate_chat_tokens(body["messages"], info.tokenizer_family).tokens
        amount = self._catalog.worst_case_cost(info, prompt, body["max_tokens"])
        try:
            hold = await self._budgets.hold(tenant.org_id, tenant.agent_id, call_id, amount, policy)
        except BudgetExceeded as e:
            raise ExtractionRefused(f"BUDGET_EXCEEDED: the {e.scope} budget for this month is exhausted") from e
        except StoreError as e:
            raise ExtractionUnavailable(type(e).__name__) from e
        started = time.monotonic()
        try:
            response = await self.registry.complete(
                ChatRequest(body=body, model=info.name, deadline=started + self._timeout, request_id=call_id)
            )
        except BaseException as e:
            await self._release(hold)
            outcome = "timeout" if isinstance(e, ProviderTimeout) else "unavailable"
            if isinstance(e, ProviderTimeout | ProviderUnavailable) or (
                isinstance(e, ProviderError) and e.status >= 500
            ):
                self._metrics.extraction_calls.labels(outcome).inc()
                raise ExtractionUnavailable(f"{e.code}: {e}") from e
            if isinstance(e, ProviderError):
                self._metrics.extraction_calls.labels("refused").inc()
                raise ExtractionRefused(f"{e.code}: {e}") from e
            raise
        usage = response.usage
        cost = self._catalog.cost(response.model, usage.prompt_tokens, usage.completion_tokens)
        await self._budgets.settle(
            hold, cost, model=response.model, prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
        )  # fmt: skip
        self._metrics.extraction_calls.labels("answered").inc()
        self._metrics.extraction_tokens.labels("prompt").inc(usage.prompt_tokens)
        self._metrics.extraction_tokens.labels("completion").inc(usage.completion_tokens)
        await self._usage_fact(tenant, call_id, response.model, usage.prompt_tokens, usage.completion_tokens, cost)
        return answer_of(response.body), response.model

    async def _release(self, hold: BudgetHold) -> None:
        try:
            await self._budgets.release(hold)
        except StoreError as e:  # the hold expires with its ttl
            log.warning("release of an extraction hold failed (request_id=%s): %s", hold.request_id, e)

    async def _usage_fact(
        self, tenant: Tenant, call_id: str, model: str, prompt: int, completion: int, cost: Decimal
    ) -> None:
        """The analytics row ``/v1/usage`` reads (the budget ledger row was written by the settle)."""
        row = [tenant.org_id, tenant.agent_id, call_id, datetime.now(UTC), model, prompt, completion, cost]
        try:
            await self._clickhouse.insert("usage_facts", [row], USAGE_COLUMNS)
        except StoreError as e:
            self._metrics.extraction_usage_dropped.inc()
            log.warning("usage row of an extraction call dropped (request_id=%s): %s", call_id, e)
