"""Backfill of SPLADE weights for memories written before migration 0025 (or while no sparse encoder ran).

Owns one loop, started with the memory stage: lease the ids and owners of active memories without sparse weights
(a narrow SECURITY DEFINER function, any org), read their content and store their weights inside each tenant's own
transaction (the trigger of 0025 writes the postings). A memory changed in between (superseded, forgotten, filled
by another replica) is skipped by the statements' own conditions. It stops when nothing is left; new writes get
their weights in the embed stage. Logs carry counts, never content.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from uuid import UUID

from ibex_dataplane.embedding import EmbeddingError, SparseEncoder
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.memory.repository import MemoryRepository
from ibex_dataplane.shared.errors import ServiceError

log = logging.getLogger(__name__)


class SparseBackfill:
    def __init__(self, repo: MemoryRepository, encoder: SparseEncoder, *, batch: int = 64) -> None:
        self._repo = repo
        self._encoder = encoder
        self._batch = batch

    async def run_once(self) -> int:
        """One batch: how many memories got their weights (0: nothing was pending)."""
        pending = await self._repo.sparse_pending(self._batch)
        by_tenant: dict[Tenant, list[UUID]] = defaultdict(list)
        for memory_id, tenant in pending:
            by_tenant[tenant].append(memory_id)
        filled = 0
        for tenant, ids in by_tenant.items():
            content = await self._repo.sparse_content(tenant, ids)
            if not content:
                continue
            order = list(content)
            vectors = await self._encoder.encode([content[i] for i in order])
            filled += await self._repo.fill_sparse(tenant, dict(zip(order, vectors, strict=True)))
        return filled

    async def run(self) -> int:
        """Batches until nothing is pending or a batch makes no progress; the total filled."""
        total = 0
        try:
            while (filled := await self.run_once()) > 0:
                total += filled
        except (EmbeddingError, ServiceError) as e:
            log.warning("sparse backfill stopped after %d memories: %s", total, e)
        if total:
            log.info("sparse backfill: %d memories got SPLADE weights", total)
        return total
