"""The agents' memory counts for BM25's N: kept per organization and agent for ``ttl`` seconds, bounded in size."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from ibex_dataplane.memory.populations import Populations


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_count_is_kept_for_its_ttl_and_then_forgotten() -> None:
    clock = Clock()
    counts = Populations(ttl=60.0, clock=clock)
    org, agent = uuid.uuid4(), uuid.uuid4()
    assert counts.get(org, agent) is None
    counts.put(org, agent, 1234)
    clock.now += 59.9
    assert counts.get(org, agent) == 1234
    clock.now += 0.1
    assert counts.get(org, agent) is None
    assert len(counts) == 0


def test_a_count_belongs_to_one_organization_and_agent() -> None:
    counts = Populations(clock=Clock())
    org, agent = uuid.uuid4(), uuid.uuid4()
    counts.put(org, agent, 7)
    assert counts.get(uuid.uuid4(), agent) is None
    assert counts.get(org, uuid.uuid4()) is None


def test_the_least_recently_used_agent_goes_first() -> None:
    counts = Populations(size=2, clock=Clock())
    org = uuid.uuid4()
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    counts.put(org, a, 1)
    counts.put(org, b, 2)
    assert counts.get(org, a) == 1  # a is now the most recently used
    counts.put(org, c, 3)
    assert (counts.get(org, a), counts.get(org, b), counts.get(org, c)) == (1, None, 3)


@pytest.mark.parametrize("settings", [{"ttl": 0.0}, {"size": 0}])
def test_a_zero_ttl_or_size_keeps_nothing(settings: dict[str, Any]) -> None:
    counts = Populations(clock=Clock(), **settings)
    org, agent = uuid.uuid4(), uuid.uuid4()
    counts.put(org, agent, 5)
    assert counts.get(org, agent) is None


def test_negative_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        Populations(ttl=-1.0)
