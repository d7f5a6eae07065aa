"""A throwaway embedded Postgres for the benchmarks that need nothing else (``budget_bench.py``,
``settle_batch_bench.py``, ``rls_bench.py``): started in a temporary folder, stopped and removed on the way out."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ibex_dataplane.runtime.embedded import EmbeddedPostgres


@contextmanager
def throwaway_postgres(prefix: str) -> Iterator[EmbeddedPostgres]:
    root = Path(tempfile.mkdtemp(prefix=prefix))
    pg = EmbeddedPostgres(root / "postgres")
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
