"""The rate limiter against a real Valkey: per-tier limits, no consumption on denial, TPM charging and correction,
headers, window resets, failing closed when Redis is gone, and exactness across clients and processes."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from ibex_dataplane.proxy.ratelimit import (
    WINDOW_SECONDS,
    DeferredCorrections,
    RateDecision,
    RateLimiter,
    RateLimits,
)
from ibex_dataplane.runtime import embedded as embedded_module
from ibex_dataplane.runtime.embedded import EmbeddedValkey, RuntimeInfo
from ibex_dataplane.store.errors import StoreUnavailable
from ibex_dataplane.store.keys import TenantKeys
from ibex_dataplane.store.redis import create_redis
from tests.support.waiting import until

REPO = Path(__file__).resolve().parents[2]
WINDOW_START = 1_800_000_000.0  # a multiple of 60: the start of a window
UNLIMITED = RateLimits(None, None, None, None)


class FakeClock:
    """Seconds since the epoch, moved by the test."""

    def __init__(self, now: float = WINDOW_START + 1.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def limiter(redis: aioredis.Redis, clock: FakeClock) -> RateLimiter:
    return RateLimiter(redis, clock=clock)


def ids() -> tuple[uuid.UUID, uuid.UUID]:
    return uuid.uuid4(), uuid.uuid4()


async def admit_many(
    limiter: RateLimiter, org: uuid.UUID, agent: uuid.UUID, limits: RateLimits, n: int, tokens: int = 0
) -> list[RateDecision]:
    return [await limiter.admit(org, agent, limits, tokens) for _ in range(n)]


async def window_counts(redis: aioredis.Redis, key: str) -> dict[str, int]:
    raw = await redis.hgetall(key)
    return {k.decode(): int(v) for k, v in raw.items()}


async def away_from_window_edge(redis: aioredis.Redis, margin: float = 3.0) -> None:
    """Tests on the server clock must not straddle a window boundary: wait for the next window if one is near."""
    seconds, micros = await redis.time()
    left = WINDOW_SECONDS - (seconds % WINDOW_SECONDS + micros / 1e6)
    if left < margin:
        await asyncio.sleep(left + 0.05)


# -- tiers ----------------------------------------------------------------------------------------------------------


async def test_the_agent_request_limit_admits_exactly_the_limit(limiter: RateLimiter) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=3, agent_tpm=None, org_rpm=None, org_tpm=None)
    decisions = await admit_many(limiter, org, agent, limits, 5)
    assert [d.allowed for d in decisions] == [True, True, True, False, False]
    assert [d.remaining for d in decisions] == [2, 1, 0, 0, 0]
    assert {d.limit for d in decisions} == {3}
    assert [d.denied_by for d in decisions[3:]] == ["agent_rpm", "agent_rpm"]
    assert all(d.retry_after is None and d.denied_by is None for d in decisions[:3])


async def test_the_org_request_limit_is_shared_by_all_its_agents(limiter: RateLimiter) -> None:
    org, a = ids()
    b = uuid.uuid4()
    limits = RateLimits(agent_rpm=None, agent_tpm=None, org_rpm=4, org_tpm=None)
    assert all(d.allowed for d in await admit_many(limiter, org, a, limits, 3))
    last, denied = await admit_many(limiter, org, b, limits, 2)
    assert last.allowed and last.remaining == 0
    assert not denied.allowed and denied.denied_by == "org_rpm"
    # Another org is untouched.
    assert (await limiter.admit(uuid.uuid4(), a, limits, 0)).allowed


async def test_a_denial_by_the_org_tier_does_not_consume_the_agent_tier(
    limiter: RateLimiter, redis: aioredis.Redis
) -> None:
    org, a = ids()
    b = uuid.uuid4()
    tight_org = RateLimits(agent_rpm=5, agent_tpm=1000, org_rpm=2, org_tpm=None)
    assert all(d.allowed for d in await admit_many(limiter, org, b, tight_org, 2))
    denials = await admit_many(limiter, org, a, tight_org, 4, tokens=100)
    assert {d.denied_by for d in denials} == {"org_rpm"}
    assert await redis.exists(TenantKeys(org).agent_rate_window(a)) == 0
    # Once the org allows it, agent a still has all five requests and all its tokens.
    roomy_org = RateLimits(agent_rpm=5, agent_tpm=1000, org_rpm=100, org_tpm=None)
    decisions = await admit_many(limiter, org, a, roomy_org, 6, tokens=200)
    assert [d.allowed for d in decisions] == [True] * 5 + [False]
    assert decisions[-1].denied_by == "agent_rpm"


async def test_a_denial_by_the_agent_tier_does_not_consume_the_org_tier(
    limiter: RateLimiter, redis: aioredis.Redis
) -> None:
    org, a = ids()
    b, c = uuid.uuid4(), uuid.uuid4()
    limits = RateLimits(agent_rpm=1, agent_tpm=None, org_rpm=3, org_tpm=50)
    assert (await limiter.admit(org, a, limits, 10)).allowed
    denials = await admit_many(limiter, org, a, limits, 5, tokens=10)
    assert {d.denied_by for d in denials} == {"agent_rpm"}
    assert await window_counts(redis, TenantKeys(org).org_rate_window()) == {"w": 30_000_000, "r": 1, "t": 10}
    assert (await limiter.admit(org, b, limits, 10)).allowed
    assert (await limiter.admit(org, c, limits, 10)).allowed
    assert (await limiter.admit(org, uuid.uuid4(), limits, 10)).denied_by == "org_rpm"


async def test_the_first_failing_tier_is_reported_and_nothing_is_counted(
    limiter: RateLimiter, redis: aioredis.Redis
) -> None:
    org, agent = ids()
    keys = TenantKeys(org)
    limits = RateLimits(agent_rpm=2, agent_tpm=100, org_rpm=2, org_tpm=100)
    assert all(d.allowed for d in await admit_many(limiter, org, agent, limits, 2, tokens=10))
    before = (
        await window_counts(redis, keys.agent_rate_window(agent)),
        await window_counts(redis, keys.org_rate_window()),
    )
    assert (await limiter.admit(org, agent, limits, 10)).denied_by == "agent_rpm"
    after = (
        await window_counts(redis, keys.agent_rate_window(agent)),
        await window_counts(redis, keys.org_rate_window()),
    )
    assert before == after


# -- tokens per minute ----------------------------------------------------------------------------------------------


async def test_token_estimates_are_charged_and_corrected_by_actual_usage(limiter: RateLimiter) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=100, agent_tpm=100, org_rpm=None, org_tpm=1000)
    first = await limiter.admit(org, agent, limits, 60)
    assert first.allowed
    denied = await limiter.admit(org, agent, limits, 50)
    assert denied.denied_by == "agent_tpm" and not denied.oversized
    assert denied.remaining == 99  # a token denial spends no request
    await limiter.adjust_tokens(org, agent, limits, 30 - 60, window=first.window)  # it used 30, not 60
    assert (await limiter.admit(org, agent, limits, 50)).allowed  # 30 + 50
    assert (await limiter.admit(org, agent, limits, 21)).denied_by == "agent_tpm"
    assert (await limiter.admit(org, agent, limits, 20)).allowed  # exactly 100


async def test_the_org_token_limit_counts_every_agent(limiter: RateLimiter) -> None:
    org, a = ids()
    limits = RateLimits(agent_rpm=None, agent_tpm=None, org_rpm=None, org_tpm=100)
    assert (await limiter.admit(org, a, limits, 70)).allowed
    assert (await limiter.admit(org, uuid.uuid4(), limits, 31)).denied_by == "org_tpm"
    assert (await limiter.admit(org, uuid.uuid4(), limits, 30)).allowed


async def test_a_refund_never_makes_a_counter_negative(limiter: RateLimiter, redis: aioredis.Redis) -> None:
    org, agent = ids()
    keys = TenantKeys(org)
    limits = RateLimits(agent_rpm=None, agent_tpm=100, org_rpm=None, org_tpm=100)
    decision = await limiter.admit(org, agent, limits, 10)
    await limiter.adjust_tokens(org, agent, limits, -1000, window=decision.window)
    await limiter.adjust_tokens(org, agent, limits, -5)
    assert (await window_counts(redis, keys.agent_rate_window(agent)))["t"] == 0
    assert (await window_counts(redis, keys.org_rate_window()))["t"] == 0
    assert (await limiter.admit(org, agent, limits, 100)).allowed
    assert (await limiter.admit(org, agent, limits, 1)).denied_by == "agent_tpm"


async def test_usage_above_the_estimate_is_charged(limiter: RateLimiter) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=None, agent_tpm=100, org_rpm=None, org_tpm=None)
    decision = await limiter.admit(org, agent, limits, 10)
    await limiter.adjust_tokens(org, agent, limits, 85, window=decision.window)
    assert (await limiter.admit(org, agent, limits, 6)).denied_by == "agent_tpm"
    assert (await limiter.admit(org, agent, limits, 5)).allowed


async def test_a_refund_for_a_past_window_does_not_free_the_current_one(
    limiter: RateLimiter, clock: FakeClock, redis: aioredis.Redis
) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=None, agent_tpm=100, org_rpm=None, org_tpm=None)
    old = await limiter.admit(org, agent, limits, 100)
    clock.now += WINDOW_SECONDS
    assert (await limiter.admit(org, agent, limits, 100)).allowed
    await limiter.adjust_tokens(org, agent, limits, -100, window=old.window)
    assert (await window_counts(redis, TenantKeys(org).agent_rate_window(agent)))["t"] == 100
    assert (await limiter.admit(org, agent, limits, 1)).denied_by == "agent_tpm"


async def test_a_late_overrun_is_charged_to_the_current_window(limiter: RateLimiter, clock: FakeClock) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=None, agent_tpm=100, org_rpm=None, org_tpm=None)
    old = await limiter.admit(org, agent, limits, 10)
    clock.now += WINDOW_SECONDS  # a long stream finishes in the next window, and used more than estimated
    await limiter.adjust_tokens(org, agent, limits, 50, window=old.window)
    assert (await limiter.admit(org, agent, limits, 51)).denied_by == "agent_tpm"
    assert (await limiter.admit(org, agent, limits, 50)).allowed


@pytest.mark.parametrize(
    ("limits", "tier"),
    [
        (RateLimits(agent_rpm=None, agent_tpm=100, org_rpm=None, org_tpm=None), "agent_tpm"),
        (RateLimits(agent_rpm=None, agent_tpm=None, org_rpm=None, org_tpm=100), "org_tpm"),
        (RateLimits(agent_rpm=10, agent_tpm=1000, org_rpm=10, org_tpm=100), "org_tpm"),
    ],
)
async def test_a_request_larger_than_a_token_limit_is_denied_outright(
    limiter: RateLimiter, redis: aioredis.Redis, limits: RateLimits, tier: str
) -> None:
    org, agent = ids()
    decision = await limiter.admit(org, agent, limits, 101)
    assert not decision.allowed and decision.denied_by == tier and decision.oversized
    keys = TenantKeys(org)
    assert await redis.exists(keys.agent_rate_window(agent), keys.org_rate_window()) == 0
    assert (await limiter.admit(org, agent, limits, 100)).allowed


async def test_a_zero_limit_admits_nothing(limiter: RateLimiter) -> None:
    org, agent = ids()
    decision = await limiter.admit(org, agent, RateLimits(0, None, None, None), 0)
    assert decision.denied_by == "agent_rpm" and decision.limit == 0 and decision.remaining == 0


async def test_invalid_limits_and_token_counts_are_refused(limiter: RateLimiter) -> None:
    with pytest.raises(ValueError, match="agent_rpm"):
        RateLimits(-1, None, None, None)
    with pytest.raises(ValueError, match="non-negative"):
        await limiter.admit(uuid.uuid4(), uuid.uuid4(), RateLimits(1, None, None, None), -5)


# -- unlimited tiers ------------------------------------------------------------------------------------------------


async def test_unlimited_tiers_are_not_counted_and_send_no_headers(limiter: RateLimiter, redis: aioredis.Redis) -> None:
    org, agent = ids()
    for decision in await admit_many(limiter, org, agent, UNLIMITED, 50, tokens=10**9):
        assert decision.allowed and decision.limit is None and decision.window is None
        assert decision.headers() == {}
    keys = TenantKeys(org)
    assert await redis.exists(keys.agent_rate_window(agent), keys.org_rate_window()) == 0
    await limiter.adjust_tokens(org, agent, UNLIMITED, 10)
    assert await redis.exists(keys.agent_rate_window(agent), keys.org_rate_window()) == 0


async def test_an_unlimited_agent_is_still_held_to_its_org(limiter: RateLimiter, redis: aioredis.Redis) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=None, agent_tpm=None, org_rpm=2, org_tpm=None)
    assert [d.allowed for d in await admit_many(limiter, org, agent, limits, 3)] == [True, True, False]
    assert await redis.exists(TenantKeys(org).agent_rate_window(agent)) == 0


# -- headers --------------------------------------------------------------------------------------------------------


async def test_headers_show_the_tightest_request_tier(limiter: RateLimiter, clock: FakeClock) -> None:
    org, agent = ids()
    clock.now = WINDOW_START + 12.3
    limits = RateLimits(agent_rpm=10, agent_tpm=None, org_rpm=3, org_tpm=None)
    decision = await limiter.admit(org, agent, limits, 0)
    assert decision.reset_seconds == pytest.approx(47.7, abs=0.002)
    assert decision.headers() == {"X-RateLimit-Limit": "3", "X-RateLimit-Remaining": "2", "X-RateLimit-Reset": "48"}
    # The tier with the fewest requests left wins, not the smaller limit: now the agent has 1 of 2 left.
    busy = RateLimits(agent_rpm=2, agent_tpm=None, org_rpm=100, org_tpm=None)
    assert (await limiter.admit(org, agent, busy, 0)).headers()["X-RateLimit-Limit"] == "2"


async def test_a_denial_carries_retry_after_until_the_window_ends(limiter: RateLimiter, clock: FakeClock) -> None:
    org, agent = ids()
    clock.now = WINDOW_START + 59.2
    limits = RateLimits(agent_rpm=1, agent_tpm=None, org_rpm=None, org_tpm=None)
    await limiter.admit(org, agent, limits, 0)
    denied = await limiter.admit(org, agent, limits, 0)
    assert denied.retry_after == 1 and denied.reset_seconds == pytest.approx(0.8, abs=0.002)
    assert denied.headers() == {
        "X-RateLimit-Limit": "1",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": "1",
        "Retry-After": "1",
    }


async def test_token_only_limits_send_reset_but_no_request_counts(limiter: RateLimiter) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=None, agent_tpm=10, org_rpm=None, org_tpm=None)
    assert set((await limiter.admit(org, agent, limits, 5)).headers()) == {"X-RateLimit-Reset"}
    assert set((await limiter.admit(org, agent, limits, 6)).headers()) == {"X-RateLimit-Reset", "Retry-After"}


async def test_on_the_server_clock_retry_after_falls_within_the_window(redis: aioredis.Redis) -> None:
    limiter = RateLimiter(redis)
    org, agent = ids()
    limits = RateLimits(agent_rpm=1, agent_tpm=None, org_rpm=None, org_tpm=None)
    await away_from_window_edge(redis)
    assert (await limiter.admit(org, agent, limits, 0)).allowed
    denied = await limiter.admit(org, agent, limits, 0)
    seconds, micros = await redis.time()
    left = WINDOW_SECONDS - (seconds % WINDOW_SECONDS + micros / 1e6)
    assert 0 < denied.reset_seconds <= WINDOW_SECONDS
    assert denied.reset_seconds == pytest.approx(left, abs=0.5)
    assert denied.retry_after is not None and 1 <= denied.retry_after <= WINDOW_SECONDS


# -- windows --------------------------------------------------------------------------------------------------------


async def test_counters_start_again_exactly_at_the_next_window(limiter: RateLimiter, clock: FakeClock) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=2, agent_tpm=None, org_rpm=None, org_tpm=50)
    assert all(d.allowed for d in await admit_many(limiter, org, agent, limits, 2, tokens=25))
    clock.now = WINDOW_START + WINDOW_SECONDS - 0.001
    assert (await limiter.admit(org, agent, limits, 0)).denied_by == "agent_rpm"
    clock.now = WINDOW_START + WINDOW_SECONDS
    fresh = await limiter.admit(org, agent, limits, 50)
    assert fresh.allowed and fresh.remaining == 1 and fresh.reset_seconds == WINDOW_SECONDS
    assert (await limiter.admit(org, agent, limits, 1)).denied_by == "org_tpm"


async def test_a_lagging_clock_joins_the_newer_window_instead_of_reopening_the_old_one(
    redis: aioredis.Redis,
) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=3, agent_tpm=None, org_rpm=None, org_tpm=None)
    behind = RateLimiter(redis, clock=lambda: WINDOW_START - 0.5)
    ahead = RateLimiter(redis, clock=lambda: WINDOW_START + 0.5)
    assert all(d.allowed for d in await admit_many(behind, org, agent, limits, 3))
    assert (await ahead.admit(org, agent, limits, 0)).allowed  # its new window
    # The lagging replica must count into that window, not reset the hash back to its own.
    assert [d.allowed for d in await admit_many(behind, org, agent, limits, 3)] == [True, True, False]


async def test_keys_carry_the_org_tag_and_expire_shortly_after_their_window(
    limiter: RateLimiter, clock: FakeClock, redis: aioredis.Redis
) -> None:
    org, agent = ids()
    keys = TenantKeys(org)
    for key in (keys.agent_rate_window(agent), keys.org_rate_window()):
        assert key.startswith(f"ibex:{{{org}}}:rl:")
    clock.now = WINDOW_START + 50
    await limiter.admit(org, agent, RateLimits(5, 50, 5, 50), 1)
    for key in (keys.agent_rate_window(agent), keys.org_rate_window()):
        assert 15_000 < await redis.pttl(key) <= 20_000  # 10 s left in the window, plus a grace of 10 s
    # Requests later in the same window neither extend nor shorten it; the next window sets its own expiry.
    clock.now = WINDOW_START + 58
    await limiter.admit(org, agent, RateLimits(5, 50, 5, 50), 1)
    assert await redis.pttl(keys.org_rate_window()) > 15_000
    clock.now = WINDOW_START + WINDOW_SECONDS + 1
    await limiter.admit(org, agent, RateLimits(5, 50, 5, 50), 1)
    assert 65_000 < await redis.pttl(keys.org_rate_window()) <= 69_000


# -- deferred corrections -------------------------------------------------------------------------------------------


class CountingLimiter(RateLimiter):
    """The real limiter, counting the correction calls that reach Redis."""

    calls = 0

    async def adjust_tokens(
        self, org_id: uuid.UUID, agent_id: uuid.UUID, limits: RateLimits, delta: int, *, window: int | None = None
    ) -> None:
        self.calls += 1
        await super().adjust_tokens(org_id, agent_id, limits, delta, window=window)


async def test_deferred_corrections_are_summed_into_one_call_per_agent_and_end_as_one_by_one(
    redis: aioredis.Redis, clock: FakeClock
) -> None:
    limiter = CountingLimiter(redis, clock=clock)
    limits = RateLimits(agent_rpm=None, agent_tpm=10_000, org_rpm=None, org_tpm=10_000)
    org, a = ids()
    b = uuid.uuid4()
    decisions = [await limiter.admit(org, agent, limits, 100) for agent in (a, a, a, b)]
    corrections = DeferredCorrections(limiter, delay=60.0)  # only the explicit flush sends here
    for decision, (agent, delta) in zip(decisions, [(a, -60), (a, -70), (a, 5), (b, -100)], strict=True):
        corrections.add(org, agent, limits, delta, window=decision.window)
    corrections.add(org, a, limits, 0, window=decisions[0].window)  # nothing to correct: nothing queued
    assert limiter.calls == 0 and corrections.pending == 4

    await corrections.flush()

    # a's refunds summed (one call), a's overrun apart (one call), b's refund (one call)
    assert limiter.calls == 3 and corrections.pending == 0
    keys = TenantKeys(org)
    assert (await window_counts(redis, keys.agent_rate_window(a)))["t"] == 300 - 60 - 70 + 5
    assert (await window_counts(redis, keys.agent_rate_window(b)))["t"] == 0
    assert (await window_counts(redis, keys.org_rate_window()))["t"] == 400 - 60 - 70 + 5 - 100


async def test_deferred_corrections_keep_the_window_rules(redis: aioredis.Redis, clock: FakeClock) -> None:
    limiter = RateLimiter(redis, clock=clock)
    limits = RateLimits(agent_rpm=None, agent_tpm=100, org_rpm=None, org_tpm=None)
    org, agent = ids()
    old = await limiter.admit(org, agent, limits, 100)
    clock.now += WINDOW_SECONDS
    assert (await limiter.admit(org, agent, limits, 40)).allowed
    corrections = DeferredCorrections(limiter, delay=60.0)
    corrections.add(org, agent, limits, -100, window=old.window)  # a refund for the past window frees nothing
    corrections.add(org, agent, limits, 30, window=old.window)  # a late overrun is charged to the current one
    await corrections.flush()
    assert (await window_counts(redis, TenantKeys(org).agent_rate_window(agent)))["t"] == 40 + 30


async def test_deferred_corrections_are_sent_after_their_delay_and_at_close(redis: aioredis.Redis) -> None:
    limiter = RateLimiter(redis)
    limits = RateLimits(agent_rpm=None, agent_tpm=1000, org_rpm=None, org_tpm=None)
    org, agent = ids()
    key = TenantKeys(org).agent_rate_window(agent)
    await away_from_window_edge(redis)
    decision = await limiter.admit(org, agent, limits, 100)
    corrections = DeferredCorrections(limiter, delay=0.01)
    corrections.add(org, agent, limits, -40, window=decision.window)

    async def corrected() -> bool:
        return corrections.pending == 0 and (await window_counts(redis, key))["t"] == 60

    await until(corrected, what="the timer sent the refund")
    slow = DeferredCorrections(limiter, delay=3600.0)
    slow.add(org, agent, limits, -10, window=decision.window)
    await slow.close()  # shutdown does not wait for the delay
    assert (await window_counts(redis, key))["t"] == 50
    slow.add(org, agent, limits, -10, window=decision.window)  # after close each correction goes at once
    await slow.close()
    assert (await window_counts(redis, key))["t"] == 40


async def test_lost_deferred_corrections_are_reported_with_their_request_count(tmp_path: Path) -> None:
    valkey = EmbeddedValkey(tmp_path)
    await asyncio.to_thread(valkey.start)
    client = create_redis(valkey.url, timeout=1.0)
    lost: list[int] = []
    try:
        limiter = RateLimiter(client)
        limits = RateLimits(agent_rpm=None, agent_tpm=1000, org_rpm=None, org_tpm=None)
        org, agent = ids()
        decision = await limiter.admit(org, agent, limits, 100)
        corrections = DeferredCorrections(limiter, delay=3600.0, on_failure=lost.append)
        corrections.add(org, agent, limits, -10, window=decision.window)
        corrections.add(org, agent, limits, -20, window=decision.window)
        await asyncio.to_thread(valkey.stop)
        await corrections.flush()
        assert lost == [2] and corrections.pending == 0
    finally:
        await client.aclose()
        await asyncio.to_thread(valkey.stop)


# -- failure --------------------------------------------------------------------------------------------------------


async def test_rate_limiting_fails_closed_when_redis_is_gone_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    valkey = EmbeddedValkey(tmp_path)
    await asyncio.to_thread(valkey.start)
    client = create_redis(valkey.url, timeout=1.0)
    try:
        limiter = RateLimiter(client)
        org, agent = ids()
        limits = RateLimits(agent_rpm=5, agent_tpm=None, org_rpm=None, org_tpm=None)
        assert (await limiter.admit(org, agent, limits, 0)).allowed
        await asyncio.to_thread(valkey.stop)
        with pytest.raises(StoreUnavailable) as caught:
            await limiter.admit(org, agent, limits, 0)
        assert caught.value.store == "redis"
        with pytest.raises(StoreUnavailable):
            await limiter.adjust_tokens(org, agent, limits, -1)
        # Unlimited callers never needed Redis, so they are not refused.
        assert (await limiter.admit(org, agent, UNLIMITED, 0)).allowed
        # A fresh server on the same address: same client and limiter recover, and the script is loaded again
        # (the new server answers NOSCRIPT to the cached hash).
        port = valkey.port
        monkeypatch.setattr(embedded_module, "free_port", lambda: port)
        await asyncio.to_thread(valkey.start)
        assert await client.dbsize() == 0  # a new, empty server: its script cache is empty too
        assert [d.allowed for d in await admit_many(limiter, org, agent, limits, 6)] == [True] * 5 + [False]
    finally:
        await client.aclose()
        await asyncio.to_thread(valkey.stop)


async def test_a_limiter_on_another_reachable_server_works_after_the_first_is_gone(tmp_path: Path) -> None:
    first, second = EmbeddedValkey(tmp_path / "a"), EmbeddedValkey(tmp_path / "b")
    await asyncio.to_thread(first.start)
    await asyncio.to_thread(first.stop)
    down = create_redis(first.url, timeout=1.0)
    try:
        with pytest.raises(StoreUnavailable):
            await RateLimiter(down).admit(uuid.uuid4(), uuid.uuid4(), RateLimits(1, None, None, None), 0)
    finally:
        await down.aclose()
    await asyncio.to_thread(second.start)
    up = create_redis(second.url, timeout=1.0)
    try:
        assert (await RateLimiter(up).admit(uuid.uuid4(), uuid.uuid4(), RateLimits(1, None, None, None), 0)).allowed
    finally:
        await up.aclose()
        await asyncio.to_thread(second.stop)


# -- exactness across replicas --------------------------------------------------------------------------------------


@pytest.mark.parametrize("server_clock", [True, False], ids=["server-clock", "injected-clock"])
async def test_concurrent_replicas_admit_exactly_the_limit(
    runtime_info: RuntimeInfo, redis: aioredis.Redis, server_clock: bool
) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=37, agent_tpm=None, org_rpm=None, org_tpm=None)
    clients = [create_redis(runtime_info.redis_url) for _ in range(4)]
    try:
        if server_clock:
            await away_from_window_edge(redis)
        replicas = [RateLimiter(c, clock=None if server_clock else FakeClock()) for c in clients]
        decisions = await asyncio.gather(*(replicas[i % 4].admit(org, agent, limits, 0) for i in range(200)))
    finally:
        for c in clients:
            await c.aclose()
    assert sum(d.allowed for d in decisions) == 37
    assert Counter(d.denied_by for d in decisions if not d.allowed) == {"agent_rpm": 163}
    assert sorted(d.remaining for d in decisions if d.allowed) == list(range(37))


async def test_concurrent_replicas_charge_tokens_exactly(runtime_info: RuntimeInfo) -> None:
    org, agent = ids()
    limits = RateLimits(agent_rpm=None, agent_tpm=None, org_rpm=1000, org_tpm=250)
    clients = [create_redis(runtime_info.redis_url) for _ in range(4)]
    try:
        replicas = [RateLimiter(c, clock=FakeClock()) for c in clients]
        decisions = await asyncio.gather(*(replicas[i % 4].admit(org, agent, limits, 7) for i in range(200)))
    finally:
        for c in clients:
            await c.aclose()
    assert sum(d.allowed for d in decisions) == 250 // 7


WORKER = textwrap.dedent(
    """
    import asyncio, sys, uuid
    from ibex_dataplane.proxy.ratelimit import RateLimiter, RateLimits
    from ibex_dataplane.store.redis import create_redis

    async def main(url, org, agent, limit, attempts):
        client = create_redis(url)
        try:
            await client.ping()
            print("ready", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            limiter = RateLimiter(client)
            limits = RateLimits(agent_rpm=limit, agent_tpm=None, org_rpm=limit * 10, org_tpm=None)
            queue = list(range(attempts))
            admitted = 0

            async def hammer():
                nonlocal admitted
                while queue:
                    queue.pop()
                    decision = await limiter.admit(org, agent, limits, 1)
                    admitted += decision.allowed  # after the await: `x += await f()` reads x too early

            await asyncio.gather(*(hammer() for _ in range(8)))
            print(admitted, flush=True)
        finally:
            await client.aclose()

    url, org, agent, limit, attempts = sys.argv[1:]
    asyncio.run(main(url, uuid.UUID(org), uuid.UUID(agent), int(limit), int(attempts)))
    """
)


async def test_separate_processes_admit_exactly_the_limit_together(
    runtime_info: RuntimeInfo, redis: aioredis.Redis
) -> None:
    org, agent = ids()
    limit, attempts = 101, 150
    argv = [runtime_info.redis_url, str(org), str(agent), str(limit), str(attempts)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WORKER,
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=REPO,
        )
        for _ in range(3)
    ]
    for proc in procs:
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"ready"
    await away_from_window_edge(redis)  # all three start together, well inside one window
    outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate(b"go\n") for p in procs)), 60)
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err.decode()
    per_process = [int(out.strip()) for out, _ in outputs]
    assert sum(per_process) == limit
    counts = await window_counts(redis, TenantKeys(org).agent_rate_window(agent))
    assert counts["r"] == limit and counts["t"] == limit
