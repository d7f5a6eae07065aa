"""Rate-limit grants against a real Valkey (docs/budget-leases.md): a busy agent's admission counts a grant, later
requests are drawn from it with no Redis call, the rest goes back, and near a limit every request is counted
alone, so limits stay exact across replicas.

Clocks are injected (as in test_ratelimit), so grants age by the clock moving; `close()` is the shutdown that gives
back what is left.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis

from ibex_dataplane.proxy.rate_grants import GrantSettings
from ibex_dataplane.proxy.ratelimit import RateDecision, RateLimiter, RateLimits
from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.store.keys import TenantKeys
from ibex_dataplane.store.redis import create_redis
from tests.support.clocks import HandClock

WINDOW_START = 1_800_000_000.0
ROOMY = RateLimits(agent_rpm=1000, agent_tpm=1_000_000, org_rpm=None, org_tpm=None)


@pytest.fixture
def clock() -> HandClock:
    return HandClock(WINDOW_START + 1.0)


def granting(redis: aioredis.Redis, clock: HandClock, requests: int = 8) -> RateLimiter:
    return RateLimiter(redis, clock=clock, grants=GrantSettings(requests, seconds=30))


async def counts(redis: aioredis.Redis, org: uuid.UUID, agent: uuid.UUID) -> tuple[int, int]:
    raw = await redis.hmget(TenantKeys(org).agent_rate_window(agent), ["r", "t"])
    return int(raw[0] or 0), int(raw[1] or 0)


async def admit(limiter: RateLimiter, org: uuid.UUID, agent: uuid.UUID, limits: RateLimits, n: int, tokens: int = 10
                ) -> list[RateDecision]:  # fmt: skip
    return [await limiter.admit(org, agent, limits, tokens) for _ in range(n)]


async def steadily(limiter: RateLimiter, org: uuid.UUID, agent: uuid.UUID, limits: RateLimits, n: int
                   ) -> list[RateDecision]:  # fmt: skip
    """``n`` requests of 10 tokens one after another, each followed by the time between two requests, in which a
    background top-up's reply comes back."""
    decisions = []
    for _ in range(n):
        decisions.append(await limiter.admit(org, agent, limits, 10))
        await limiter.drain()
    return decisions


async def test_a_busy_agent_is_admitted_from_a_grant_and_the_rest_goes_back_at_close(
    redis: aioredis.Redis, clock: HandClock
) -> None:
    org, agent = uuid.uuid4(), uuid.uuid4()
    limiter = granting(redis, clock)
    first, second = await admit(limiter, org, agent, ROOMY, 2)
    assert await counts(redis, org, agent) == (9, 90)  # the first alone, then a grant of 8 with the second in it
    drawn = await admit(limiter, org, agent, ROOMY, 3)
    assert await counts(redis, org, agent) == (9, 90)  # drawn here: Redis did not see them
    decisions = [first, second, *drawn]
    assert all(d.allowed for d in decisions)
    assert [d.remaining for d in decisions] == [999, 998, 997, 996, 995]  # one process: the exact count
    assert {d.window for d in decisions} == {first.window} and {d.limit for d in decisions} == {1000}
    assert limiter.open_grants == 1
    await limiter.close()
    assert await counts(redis, org, agent) == (5, 50) and limiter.open_grants == 0


async def test_near_a_limit_every_request_is_counted_alone_and_the_limit_is_exact(
    redis: aioredis.Redis, clock: HandClock
) -> None:
    org, agent = uuid.uuid4(), uuid.uuid4()
    limiter = granting(redis, clock)
    tight = RateLimits(agent_rpm=20, agent_tpm=None, org_rpm=None, org_tpm=None)  # a grant of 8 needs 32 free
    decisions = await admit(limiter, org, agent, tight, 22)
    assert [d.allowed for d in decisions] == [True] * 20 + [False] * 2
    assert [d.remaining for d in decisions[:20]] == list(range(19, -1, -1))
    assert limiter.open_grants == 0 and await counts(redis, org, agent) == (20, 200)


class ScriptCalls:
    """Which task ran each admit script of a limiter: the request's own (the test) or a background top-up."""

    def __init__(self, limiter: RateLimiter) -> None:
        self.by: list[str] = []
        script = limiter._admit

        async def counted(*args: Any, **kwargs: Any) -> Any:
            task = asyncio.current_task()
            self.by.append(task.get_name() if task is not None else "?")
            return await script(*args, **kwargs)

        limiter._admit = counted  # type: ignore[assignment]


async def test_a_steady_stream_tops_its_grant_up_in_the_background_and_stays_exact(
    redis: aioredis.Redis, clock: HandClock
) -> None:
    org, agent = uuid.uuid4(), uuid.uuid4()
    limiter = granting(redis, clock)  # grants of 8: a top-up starts when a draw leaves 2 or fewer
    calls = ScriptCalls(limiter)
    me = asyncio.current_task()
    assert me is not None
    decisions = await steadily(limiter, org, agent, ROOMY, 40)
    assert all(d.allowed for d in decisions)
    assert [d.remaining for d in decisions] == list(range(999, 959, -1))  # one process: the exact count
    # The first request alone, the second with the first grant; every later grant was counted in the background,
    # while requests drew from what the one before had left, and took that rest over (nothing to give back).
    assert calls.by[:2] == [me.get_name()] * 2
    assert set(calls.by[2:]) == {"ibex-rate-grant-top-up"} and len(calls.by) >= 6
    assert limiter.open_grants == 1
    await limiter.close()
    assert await counts(redis, org, agent) == (40, 400)


async def test_near_a_limit_a_top_up_counts_nothing_and_the_limit_stays_exact(
    redis: aioredis.Redis, clock: HandClock
) -> None:
    org, agent = uuid.uuid4(), uuid.uuid4()
    limiter = granting(redis, clock)
    # The first grant fits (1 counted + 4 x 8 free <= 40); its top-up would not (9 + 32 > 40), so it counts nothing.
    near = RateLimits(agent_rpm=40, agent_tpm=None, org_rpm=None, org_tpm=None)
    decisions = await steadily(limiter, org, agent, near, 45)
    assert [d.allowed for d in decisions] == [True] * 40 + [False] * 5
    assert [d.remaining for d in decisions[:40]] == list(range(39, -1, -1))
    await limiter.close()
    assert await counts(redis, org, agent) == (40, 400)


async def test_a_top_up_that_fails_leaves_the_next_request_to_ask_redis_itself(
    redis: aioredis.Redis, clock: HandClock
) -> None:
    org, agent = uuid.uuid4(), uuid.uuid4()
    limiter = granting(redis, clock)
    calls = ScriptCalls(limiter)
    counted = limiter._admit
    failed: list[str] = []

    async def down_for_top_ups(*args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        if task is not None and task.get_name() == "ibex-rate-grant-top-up":
            failed.append(task.get_name())
            raise ConnectionError("Valkey is unreachable")
        return await counted(*args, **kwargs)

    limiter._admit = down_for_top_ups  # type: ignore[assignment]
    me = asyncio.current_task()
    assert me is not None
    decisions = await steadily(limiter, org, agent, ROOMY, 12)
    assert all(d.allowed for d in decisions)
    # Requests 1 and 2 asked Redis (the second got a grant of 8), 3-9 drew from it while its top-ups (after 7, 8
    # and 9) failed, and the 10th, finding it spent, asked Redis itself for a new one, from which 11 and 12 drew.
    assert failed == ["ibex-rate-grant-top-up"] * 3
    assert calls.by == [me.get_name()] * 3
    await limiter.close()
    assert await counts(redis, org, agent) == (12, 120)


async def test_a_grant_is_not_drawn_from_after_its_time_or_near_its_windows_end(
    redis: aioredis.Redis, clock: HandClock
) -> None:
    org, agent = uuid.uuid4(), uuid.uuid4()
    limiter = granting(redis, clock)
    await admit(limiter, org, agent, ROOMY, 2)
    clock.now += 30  # the grant's 30 s are up: the next request goes to Redis (alone: the agent was idle 30 s)
    await admit(limiter, org, agent, ROOMY, 1)
    assert await counts(redis, org, agent) == (10, 100)
    await limiter.close()  # the old grant's 7 go back
    assert await counts(redis, org, agent) == (3, 30)

    clock.now = WINDOW_START + 60 - 0.01  # a new grant in the window's last 10 ms
    await admit(limiter, org, agent, ROOMY, 1)
    assert await counts(redis, org, agent) == (11, 110)
    clock.now = WINDOW_START + 60 - 0.001  # inside the clock margin: counted in Redis, not drawn
    late = await limiter.admit(org, agent, ROOMY, 10)
    assert late.allowed and (await counts(redis, org, agent))[0] > 11
    await limiter.close()
    assert await counts(redis, org, agent) == (5, 50)


async def test_a_request_larger_than_what_the_grant_has_left_goes_to_redis(
    redis: aioredis.Redis, clock: HandClock
) -> None:
    org, agent = uuid.uuid4(), uuid.uuid4()
    limiter = granting(redis, clock)
    await admit(limiter, org, agent, ROOMY, 2, tokens=10)  # a grant of 8 requests and 80 tokens
    big = await limiter.admit(org, agent, ROOMY, 500)
    assert big.allowed
    # Counted in Redis with a new grant of 8 x 500 tokens; the old grant's 7 requests and 70 tokens went back.
    await limiter.close()
    assert await counts(redis, org, agent) == (3, 520)


async def test_another_agent_or_org_draws_nothing_from_a_grant(redis: aioredis.Redis, clock: HandClock) -> None:
    org, agent = uuid.uuid4(), uuid.uuid4()
    limiter = granting(redis, clock)
    await admit(limiter, org, agent, ROOMY, 2)
    other_agent, other_org = uuid.uuid4(), uuid.uuid4()
    await admit(limiter, org, other_agent, ROOMY, 1)
    await admit(limiter, other_org, agent, ROOMY, 1)
    assert await counts(redis, org, other_agent) == (1, 10)
    assert await counts(redis, other_org, agent) == (1, 10)
    assert await counts(redis, org, agent) == (9, 90)
    await limiter.close()


async def test_two_granting_replicas_never_admit_more_than_the_limit(
    runtime_info: RuntimeInfo, redis: aioredis.Redis, clock: HandClock
) -> None:
    org, agent = uuid.uuid4(), uuid.uuid4()
    clients = [create_redis(runtime_info.redis_url) for _ in range(2)]
    try:
        replicas = [granting(c, clock) for c in clients]
        limits = RateLimits(agent_rpm=100, agent_tpm=None, org_rpm=None, org_tpm=None)

        async def one(i: int) -> bool:
            return (await replicas[i % 2].admit(org, agent, limits, 10)).allowed

        admitted = 0
        for _ in range(10):  # waves of concurrent requests over both replicas
            admitted += sum(await asyncio.gather(*(one(i) for i in range(30))))
        # Exact on the high side always; each replica may hold back at most one grant's rest meanwhile (a grant's
        # 8 with the quarter of the one a top-up took over: 10).
        assert 100 - 2 * 10 <= admitted <= 100
        for replica in replicas:
            await replica.close()
        assert (await counts(redis, org, agent))[0] == admitted
    finally:
        for c in clients:
            await c.aclose()


async def test_a_busy_agents_grants_grow_to_its_pace_and_a_burst_then_waits_on_no_top_up(
    redis: aioredis.Redis, clock: HandClock
) -> None:
    """Grants of 8 at least and 64 at most, sized on what the agent drew in half a second: an agent sending a request
    a millisecond soon counts grants of 64, and a burst of 24 concurrent requests is then drawn at once (with grants
    of 8 each burst would drain the grant and wait for its top-up)."""
    org, agent = uuid.uuid4(), uuid.uuid4()
    limiter = RateLimiter(redis, clock=clock, grants=GrantSettings(8, seconds=30, most=64))
    calls = ScriptCalls(limiter)
    for _ in range(40):  # one request a millisecond
        assert (await limiter.admit(org, agent, ROOMY, 10)).allowed
        await limiter.drain()
        clock.now += 0.001
    grown = len(calls.by)
    for _ in range(5):  # bursts: every request of one arrives before any top-up's reply can
        assert all(d.allowed for d in await asyncio.gather(*(limiter.admit(org, agent, ROOMY, 10) for _ in range(24))))
        await limiter.drain()
        clock.now += 0.024
    # 120 requests in bursts, at most two grants of 64 for them, each counted in the background.
    assert len(calls.by) - grown <= 2 and set(calls.by[grown:]) <= {"ibex-rate-grant-top-up"}
    await limiter.close()
    assert await counts(redis, org, agent) == (160, 1600)  # exact once the rest went back
