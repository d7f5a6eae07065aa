"""The embedded stack the benchmarks run on: fresh stores, migrations, the embedder, the PII redactor, and a
tenant factory that goes through the real reconcile code. Used by ``memory_bench.py`` and ``context_bench.py``."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client import CollectorRegistry  # noqa: E402

from bench.durability import production_durability  # noqa: E402
from ibex_dataplane.embedding.onnx import OnnxMiniLMEmbedder  # noqa: E402
from ibex_dataplane.pii.redactor import PiiRedactor  # noqa: E402
from ibex_dataplane.runtime.embedded import EmbeddedRuntime  # noqa: E402
from ibex_dataplane.runtime.heap import HeapMetrics  # noqa: E402
from ibex_dataplane.runtime.stores import Stores, StoreUrls, migrate_all  # noqa: E402
from ibex_dataplane.settings import Settings  # noqa: E402
from ibex_dataplane.store.clickhouse import ClickHouse  # noqa: E402
from ibex_operator.reconcile import Reconciler  # noqa: E402
from ibex_operator.repository import TenantConfigRepository  # noqa: E402
from ibex_operator.secrets import FileSecretSink  # noqa: E402
from tests.support.proxy import MemoryDeps  # noqa: E402
from tests.support.tenants import TenantFactory  # noqa: E402

T = TypeVar("T")


def event_loop_name(plain: bool) -> str:
    return "asyncio" if plain else "uvloop"


def run_loop(main: Coroutine[Any, Any, T], *, plain: bool = False) -> T:
    """Run ``main`` on the event loop the stages run on in production: uvloop, as ``ibex dev`` and ``ibex serve``
    start it; asyncio's own loop with ``plain`` (``--no-uvloop``), for comparison. The benchmark's client shares the
    loop with the stages it drives, as the in-process stack requires."""
    if plain:
        return asyncio.run(main)
    import uvloop

    return uvloop.run(main)


def freeze_heap() -> int:
    """Freeze the heap as every serving command does once its stages are up (``runtime/heap.py``): one collection,
    then every survivor moved to the permanent generation. Without it, each full collection in the benchmark's
    process walks every module, model wrapper and recognizer it loaded, and stops the stages it measures for far
    longer than a stage of ``ibex dev`` or ``ibex serve`` would stop. Call it after the warm-up; returns the
    objects frozen."""
    return HeapMetrics("bench", CollectorRegistry()).freeze()


@dataclass
class Stack:
    root: Path
    settings: Settings
    stores: Stores
    embedder: OnnxMiniLMEmbedder
    redactor: PiiRedactor
    pepper: bytes
    tenants: TenantFactory
    durability: dict[str, str]  # the Postgres settings the benchmark ran with (production_durability)

    @property
    def memory_deps(self) -> MemoryDeps:
        return MemoryDeps(self.embedder, self.redactor)


@asynccontextmanager
async def embedded_stack(prefix: str) -> AsyncIterator[Stack]:
    root = Path(tempfile.mkdtemp(prefix=prefix))
    runtime = EmbeddedRuntime(root)
    runtime.start()
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    try:
        urls = StoreUrls.from_runtime(runtime.info)
        clickhouse = ClickHouse(urls.clickhouse_url)
        try:
            await migrate_all(urls, settings, clickhouse)
        finally:
            await clickhouse.close()
        durability = await production_durability(runtime.info.postgres_admin_dsn)
        stores = await Stores.open(urls, settings, admin=True)
        embedder = OnnxMiniLMEmbedder.from_installed_packages()
        redactor = PiiRedactor()
        try:
            assert stores.admin_pool is not None
            pepper = secrets.token_bytes(32)
            sink = FileSecretSink(root / "s.json")
            reconciler = Reconciler(TenantConfigRepository(stores.admin_pool, stores.redis), sink, pepper)
            tenants = TenantFactory(reconciler, sink)
            yield Stack(root, settings, stores, embedder, redactor, pepper, tenants, durability)
        finally:
            redactor.close()
            embedder.close()
            await stores.close()
    finally:
        runtime.stop()
        shutil.rmtree(root, ignore_errors=True)
