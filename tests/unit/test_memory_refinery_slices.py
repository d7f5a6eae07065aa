"""The pipelined refinery: cut into steps at ``cut_at``, each step runs one slice ahead of the next, every item gets
one result, exact duplicates are found across slices, a failure or a cancellation leaves nothing running, and the
deadline stops the slices it reaches.

The stages here are small fakes (the real ones are exercised through HTTP in the integration tests): they record
what they see and wait on events, so the overlap is shown by who waits for whom, never by timing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import pytest

from ibex_dataplane.memory.metrics import MemoryMetrics
from ibex_dataplane.memory.models import Tenant
from ibex_dataplane.memory.refinery import ExactDedup, Refinery, WriteBatch, WriteOutcome, WriteResult
from ibex_dataplane.shared.errors import DeadlineExceeded

TENANT = Tenant(uuid.uuid4(), uuid.uuid4())


class Record:
    """A stage that notes the indexes of each batch it is given, in call order."""

    def __init__(self, name: str, log: list[tuple[str, list[int]]], *, interruptible: bool = True) -> None:
        self.name = name
        self.interruptible = interruptible
        self._log = log

    async def __call__(self, batch: WriteBatch) -> Counter[str]:
        self._log.append((self.name, [c.index for c in batch.in_flight()]))
        return Counter(ok=len(batch.in_flight()))


class Settle:
    """The last stage: settles what reaches it as created."""

    name = "persist"
    interruptible = False

    def __init__(self, log: list[tuple[str, list[int]]]) -> None:
        self._log = log

    async def __call__(self, batch: WriteBatch) -> Counter[str]:
        todo = batch.in_flight()
        self._log.append((self.name, [c.index for c in todo]))
        for c in todo:
            c.settle(WriteResult(WriteOutcome.CREATED))
        return Counter(created=len(todo))


def refinery(
    *stages: object, slice_size: int = 2, clock: object = None, cut_at: tuple[str, ...] = ("embed",)
) -> Refinery:
    extra = {} if clock is None else {"clock": clock}
    return Refinery(list(stages), MemoryMetrics(), cut_at=cut_at, slice_size=slice_size, **extra)  # type: ignore[arg-type]


async def test_every_slice_goes_through_every_stage_in_order_and_every_item_gets_one_result() -> None:
    log: list[tuple[str, list[int]]] = []
    r = refinery(Record("validate", log), Record("embed", log), Record("near_dedup", log), Settle(log), slice_size=2)
    results, reports = await r.run(TENANT, ["a", "b", "c", "d", "e"], request_id="req_1", deadline=1e12)
    assert [x.status for x in results] == [201] * 5
    # Each stage takes the slices in input order, and each slice goes through the stages in order.
    for stage in ("validate", "embed", "near_dedup", "persist"):
        assert [entry[1] for entry in log if entry[0] == stage] == [[0, 1], [2, 3], [4]], stage
    for k, batch in enumerate(([0, 1], [2, 3], [4])):
        order = [log.index((stage, batch)) for stage in ("validate", "embed", "near_dedup", "persist")]
        assert order == sorted(order), k
    # One report per stage, outcomes summed over the slices.
    assert [(rep.stage, rep.outcomes) for rep in reports] == [
        ("validate", {"ok": 5}),
        ("embed", {"ok": 5}),
        ("near_dedup", {"ok": 5}),
        ("persist", {"created": 5}),
    ]


async def test_the_next_slice_is_embedded_while_this_one_is_persisted() -> None:
    second_embedding_started = asyncio.Event()
    seen: list[str] = []

    class Embed:
        name = "embed"
        interruptible = True

        async def __call__(self, batch: WriteBatch) -> Counter[str]:
            first = batch.in_flight()[0].index
            seen.append(f"embed {first}")
            if first == 2:
                second_embedding_started.set()
            return Counter(ok=len(batch.in_flight()))

    class WaitingPersist(Settle):
        async def __call__(self, batch: WriteBatch) -> Counter[str]:
            first = batch.in_flight()[0].index
            if first == 0:
                # Only returns if the second slice's embed ran meanwhile; a refinery that took turns would wait here
                # forever (the timeout below turns that into a failure).
                await second_embedding_started.wait()
            seen.append(f"persist {first}")
            return await super().__call__(batch)

    r = refinery(Embed(), WaitingPersist([]), slice_size=2, cut_at=("persist",))
    async with asyncio.timeout(10):
        results, _ = await r.run(TENANT, ["a", "b", "c", "d"], request_id="req_2", deadline=1e12)
    assert [x.status for x in results] == [201] * 4
    assert seen == ["embed 0", "embed 2", "persist 0", "persist 2"]


async def test_a_failing_later_stage_cancels_the_slice_running_ahead() -> None:
    ahead_started = asyncio.Event()
    ahead_cancelled = asyncio.Event()

    class Embed:
        name = "embed"
        interruptible = True

        async def __call__(self, batch: WriteBatch) -> Counter[str]:
            if batch.in_flight()[0].index == 0:
                return Counter(ok=len(batch.in_flight()))
            ahead_started.set()
            try:
                await asyncio.Event().wait()  # never set: only a cancellation ends it
            except asyncio.CancelledError:
                ahead_cancelled.set()
                raise
            return Counter()

    class Broken:
        name = "near_dedup"
        interruptible = True

        async def __call__(self, batch: WriteBatch) -> Counter[str]:
            await ahead_started.wait()
            raise RuntimeError("store fell over")

    r = refinery(Embed(), Broken(), Settle([]), slice_size=1, cut_at=("near_dedup",))
    async with asyncio.timeout(10):
        with pytest.raises(RuntimeError, match="store fell over"):
            await r.run(TENANT, ["a", "b"], request_id="req_3", deadline=1e12)
    assert ahead_cancelled.is_set()


async def test_the_deadline_stops_the_slices_it_reaches_and_keeps_the_committed_ones() -> None:
    now = [0.0]
    log: list[tuple[str, list[int]]] = []

    class Persist(Settle):
        async def __call__(self, batch: WriteBatch) -> Counter[str]:
            outcome = await super().__call__(batch)
            now[0] = 100.0  # the deadline passes while the first slice commits
            return outcome

    r = refinery(Record("embed", log), Record("near_dedup", log), Persist(log), slice_size=2, clock=lambda: now[0],
                 cut_at=("near_dedup",))  # fmt: skip
    results, reports = await r.run(TENANT, ["a", "b", "c", "d", "e"], request_id="req_4", deadline=50.0)
    assert [x.status for x in results] == [201, 201, 503, 503, 503]
    assert all(isinstance(x.error, DeadlineExceeded) for x in results[2:])
    # The later slices stopped at the first stage they reached after the deadline; nothing of them reached persist.
    assert ("persist", [2, 3]) not in log and ("persist", [4]) not in log
    by_stage = {rep.stage: rep.outcomes for rep in reports}
    assert by_stage["persist"] == {"created": 2}
    assert sum(outcomes.get("deadline", 0) for outcomes in by_stage.values()) == 3


async def test_three_steps_work_on_three_slices_at_once() -> None:
    """The memory stage's shape: while slice 0 is stored, slice 1 is embedded and slice 2 is checked for PII."""
    all_three = asyncio.Barrier(3)
    seen: list[str] = []

    class Meeting:
        """A stage whose call for slice ``meets`` waits until the other two steps are busy too."""

        interruptible = True

        def __init__(self, name: str, meets: int) -> None:
            self.name, self._meets = name, meets

        async def __call__(self, batch: WriteBatch) -> Counter[str]:
            first = batch.in_flight()[0].index
            if first == self._meets:
                seen.append(f"{self.name} {first}")
                await all_three.wait()  # a refinery that ran one step at a time would wait here forever
            return Counter(ok=len(batch.in_flight()))

    class MeetingPersist(Settle):
        async def __call__(self, batch: WriteBatch) -> Counter[str]:
            if batch.in_flight()[0].index == 0:
                seen.append("persist 0")
                await all_three.wait()
            return await super().__call__(batch)

    r = refinery(Meeting("pii", 2), Meeting("embed", 1), MeetingPersist([]), slice_size=1, cut_at=("embed", "persist"))
    async with asyncio.timeout(10):
        results, _ = await r.run(TENANT, ["a", "b", "c", "d"], request_id="req_5", deadline=1e12)
    assert [x.status for x in results] == [201] * 4
    assert sorted(seen) == ["embed 1", "persist 0", "pii 2"]


async def test_exact_duplicates_are_found_across_slices_before_the_first_is_stored() -> None:
    """Exact dedup runs ahead of persist: an item equal to one of an earlier, not yet committed slice follows it."""
    bumped: list[list[bytes]] = []

    class Repo:
        async def bump_duplicates(self, tenant: Tenant, hashes: list[bytes]) -> dict[bytes, object]:
            bumped.append(hashes)
            return {}  # nothing stored yet

    class Texts:
        name = "pii"
        interruptible = True

        async def __call__(self, batch: WriteBatch) -> Counter[str]:
            for c in batch.in_flight():
                c.content = str(c.raw)
            return Counter(ok=len(batch.in_flight()))

    persisted: list[tuple[str, list[int]]] = []
    r = refinery(Texts(), ExactDedup(Repo(), MemoryMetrics()), Settle(persisted), slice_size=2,  # type: ignore[arg-type]
                 cut_at=("persist",))  # fmt: skip
    items = ["Paris", "Berlin", "Rome", "  berlin ", "Oslo"]
    results, reports = await r.run(TENANT, items, request_id="req_6", deadline=1e12)
    assert [x.status for x in results] == [201] * 5  # the duplicate answers with its first's result
    # The duplicate (index 3) was never asked of the store again and never reached persist.
    assert [len(hashes) for hashes in bumped] == [2, 1, 1]
    assert [batch for _, batch in persisted] == [[0, 1], [2], [4]]
    assert {rep.stage: rep.outcomes for rep in reports}["exact_dedup"] == {"new": 4, "duplicate_in_batch": 1}


def test_cutting_needs_known_stages_and_a_positive_size() -> None:
    with pytest.raises(ValueError, match="no stage named"):
        Refinery([Settle([])], MemoryMetrics(), cut_at=("embed",))
    with pytest.raises(ValueError, match="at least 1"):
        Refinery([Record("embed", []), Settle([])], MemoryMetrics(), cut_at=("embed",), slice_size=0)
