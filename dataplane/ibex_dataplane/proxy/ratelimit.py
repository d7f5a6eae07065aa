"""The proxy's rate-limit gate: requests and tokens per minute, per agent and per org, decided atomically in Redis.

Owns the rate-limit algorithm, its two Lua scripts and the meaning of the ``X-RateLimit-*`` headers (architecture
sections 6.3 and 7). The proxy's gate pipeline calls :meth:`RateLimiter.admit` after the policy snapshot and before
request validation, and :meth:`RateLimiter.adjust_tokens` once the provider has reported actual usage. Keys come
from :class:`ibex_dataplane.store.keys.TenantKeys`; nothing here logs, so no tenant id reaches a log line.

Algorithm: fixed windows of 60 s aligned to the clock (window id ``floor(now_ms / 60000)``). Each scope (the agent,
the org) has one hash holding its current window id and two counters, requests ``r`` and tokens ``t``. One Lua
script per decision reads both hashes, checks all four tiers against the counts of the current window and only
when every tier passes increments the hash of each limited scope; a denial writes nothing, so a denial by one tier
never consumes another. A new window is started by overwriting the hash, which is also when its expiry is set
(window end plus 10 s); later writes never extend it, so a key outlives its window only by that grace.

Guarantee: because Redis runs each script alone, the decisions of any number of proxy replicas sharing one Redis
are serialised. For every window and every tier, the requests admitted (and the token estimates charged at
admission) in that window never exceed the limit, and a request is denied only if admitting it would exceed some
limit: the count is exact, not approximate. A later upward token correction (actual usage above the estimate) is
charged even past the limit and then denies further requests until the window ends. As with any fixed window, a
burst straddling a boundary can see up to twice the limit within one sliding 60 s span. Counts may only err
upwards: a script that ran but whose reply was lost (timeout, cancellation, a client retry after a timeout) is
counted although the caller saw an error.

Grants (``grants=``, off unless configured; docs/budget-leases.md): when an agent is busy in this process (two
requests within the grant's seconds), the admit script may count a grant of N requests, and N times this request's
token estimate, instead of the one request (N: what the agent drew in the last half second at the pace of its
previous grant, within the settings' bounds, :class:`~ibex_dataplane.proxy.rate_grants.GrantBook`). It does so
only when every limited tier keeps ``1 + reserve`` grants free beside it, so near a limit every request is counted
alone, as above. The process then admits the agent's next requests from the grant with no Redis call, for at most
the grant's seconds and never past its window's end (less a 50 ms margin for the clock), and gives back what is
left to that window. When a draw leaves a quarter of the grant or less, the next grant is counted in the background
(a top-up: the script counts it only if it fits, and no request with it), so a steady stream of requests does not
wait on Redis; a top-up counted in the same window takes over what the grant it replaces has left. So the guarantee
above stands for admissions (what is counted is never above a limit); what changes is that a request may be denied
while another process holds an unused grant, for at most the grant's seconds, and the ``X-RateLimit-Remaining`` of
a drawn request is the count as of its grant. Requests drawn from a grant are admitted while Redis is unreachable,
since Redis counted them already.

Clock: by default the script reads the Redis server's ``TIME`` (allowed in scripts since Redis 5, which replicate
script effects), so every replica uses one clock and agrees on window boundaries and ``Retry-After`` whatever its
own clock says. A ``clock`` callable can be injected instead (tests move time that way); its value is sent with
each call. Windows in a hash never move backwards: a caller whose clock lags counts into the newer window already
stored rather than resetting it, so small skew between injected clocks cannot reopen a window.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, cast
from uuid import UUID

from redis.exceptions import RedisError

from ibex_dataplane.proxy.rate_grants import Grant, GrantBook, GrantSettings
from ibex_dataplane.store.errors import StoreUnavailable
from ibex_dataplane.store.keys import TenantKeys
from ibex_dataplane.store.redis import REDIS_DOWN, RedisClient, unavailable

WINDOW_SECONDS: Final = 60
"""Length of a rate-limit window; limits are per minute."""

_WINDOW_MS: Final = WINDOW_SECONDS * 1000
_EXPIRY_GRACE_MS: Final = 10_000
"""How long a window's hash outlives the window: covers small clock differences and in-flight adjustments."""

# Any Redis error means no decision could be made: the gate fails closed (503), whatever the cause.
_REDIS_FAILURES: Final[tuple[type[BaseException], ...]] = (RedisError, *REDIS_DOWN)

_UNLIMITED: Final = -1
_SERVER_CLOCK: Final = ""

# Tier names, in the order the admit script numbers them (1-based).
_TIERS: Final = ("agent_rpm", "agent_tpm", "org_rpm", "org_tpm")

# Shared prologue: the current time in ms, from the server clock or from the caller.
_NOW_LUA = """
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[1])
end
local span = tonumber(ARGV[2])
local window = math.floor(now / span)
"""

# KEYS: agent window hash, org window hash.
# ARGV: now ms or '', window ms, agent_rpm, agent_tpm, org_rpm, org_tpm (-1 = unlimited), tokens, expiry grace ms.
# Returns {denied tier (0 = admitted, else 1-based index into _TIERS), oversized 0/1, ms until the window ends,
#          window id, agent requests in window, org requests in window} (counts after this decision).
_ADMIT_LUA = (
    _NOW_LUA
    + """
local lim = {tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])}
local tokens = tonumber(ARGV[7])
local grace = tonumber(ARGV[8])
local used = {lim[1] >= 0 or lim[2] >= 0, lim[3] >= 0 or lim[4] >= 0}

-- Read both scopes; a window never moves backwards, so a lagging clock joins the newest window stored.
local stored = {{}, {}}
for i = 1, 2 do
  if used[i] then
    local v = redis.call('HMGET', KEYS[i], 'w', 'r', 't')
    stored[i] = {tonumber(v[1]), tonumber(v[2]) or 0, tonumber(v[3]) or 0}
    if stored[i][1] and stored[i][1] > window then window = stored[i][1] end
  end
end
local req = {0, 0}
local tok = {0, 0}
for i = 1, 2 do
  if used[i] and stored[i][1] == window then
    req[i] = stored[i][2]
    tok[i] = stored[i][3]
  end
end

-- Check every tier before touching anything. A request larger than a token limit can never pass: report it first.
local denied = 0
local oversized = 0
if lim[2] >= 0 and tokens > lim[2] then
  denied = 2; oversized = 1
elseif lim[4] >= 0 and tokens > lim[4] then
  denied = 4; oversized = 1
elseif lim[1] >= 0 and req[1] + 1 > lim[1] then
  denied = 1
elseif lim[2] >= 0 and tok[1] + tokens > lim[2] then
  denied = 2
elseif lim[3] >= 0 and req[2] + 1 > lim[3] then
  denied = 3
elseif lim[4] >= 0 and tok[2] + tokens > lim[4] then
  denied = 4
end

-- A grant (ARGV 9-11: requests, tokens, reserve multiple): when the request passes and every limited tier keeps
-- (1 + reserve) times the grant free, count the grant instead of the one request; the caller draws the rest of it
-- itself. Near a limit no grant fits and the request is counted alone. A top-up (ARGV 12 = '1') has no request of
-- its own: it counts the grant when it fits, and nothing otherwise.
local n, ntok = 1, tokens
if ARGV[12] == '1' then n, ntok = 0, 0 end
local gk = tonumber(ARGV[9]) or 0
if denied == 0 and gk > 1 then
  local gt = tonumber(ARGV[10])
  local scale = 1 + tonumber(ARGV[11])
  if (lim[1] < 0 or req[1] + gk * scale <= lim[1]) and (lim[2] < 0 or tok[1] + gt * scale <= lim[2])
     and (lim[3] < 0 or req[2] + gk * scale <= lim[3]) and (lim[4] < 0 or tok[2] + gt * scale <= lim[4]) then
    n, ntok = gk, gt
  end
end

local reset = (window + 1) * span - now
if denied == 0 and n > 0 then
  for i = 1, 2 do
    if used[i] then
      if stored[i][1] == window then
        redis.call('HINCRBY', KEYS[i], 'r', n)
        if ntok > 0 then redis.call('HINCRBY', KEYS[i], 't', ntok) end
      else
        redis.call('HSET', KEYS[i], 'w', window, 'r', n, 't', ntok)
        redis.call('PEXPIRE', KEYS[i], reset + grace)
      end
      req[i] = req[i] + n
    end
  end
else
  n = 0
end
return {denied, oversized, reset, window, req[1], req[2], n}
"""
)

# KEYS: agent window hash, org window hash. ARGV: window id, requests, tokens, touch agent '1'/'0', org '1'/'0'.
# The unused part of a grant goes back to the window it was counted in, only while that window is stored (a later
# window starts from zero anyway), never below zero.
_GIVE_BACK_LUA = """
for i = 1, 2 do
  if ARGV[3 + i] == '1' then
    local v = redis.call('HMGET', KEYS[i], 'w', 'r', 't')
    if tonumber(v[1]) == tonumber(ARGV[1]) then
      local r = (tonumber(v[2]) or 0) - tonumber(ARGV[2])
      local t = (tonumber(v[3]) or 0) - tonumber(ARGV[3])
      redis.call('HSET', KEYS[i], 'r', math.max(r, 0), 't', math.max(t, 0))
    end
  end
end
return 0
"""

# KEYS: agent window hash, org window hash.
# ARGV: now ms or '', window ms, token delta, window id of the admit or '', touch agent '1'/'0', touch org '1'/'0',
#       expiry grace ms.
# A positive delta is charged to the current window (starting it if needed): those tokens were spent now. A
# negative delta is refunded only to the window that was charged (the current one if unknown), never below zero.
_ADJUST_LUA = (
    _NOW_LUA
    + """
local delta = tonumber(ARGV[3])
local charged = tonumber(ARGV[4])
local grace = tonumber(ARGV[7])
for i = 1, 2 do
  if ARGV[4 + i] == '1' then
    local v = redis.call('HMGET', KEYS[i], 'w', 't')
    local w = tonumber(v[1])
    if delta > 0 then
      local target = window
      if w and w > target then target = w end
      if w == target then
        redis.call('HINCRBY', KEYS[i], 't', delta)
      else
        redis.call('HSET', KEYS[i], 'w', target, 'r', 0, 't', delta)
        redis.call('PEXPIRE', KEYS[i], (target + 1) * span - now + grace)
      end
    elseif w and ((charged and w == charged) or (not charged and w >= window)) then
      local t = (tonumber(v[2]) or 0) + delta
      if t < 0 then t = 0 end
      redis.call('HSET', KEYS[i], 't', t)
    end
  end
end
return 0
"""
)


@dataclass(frozen=True)
class RateLimits:
    """Per-minute limits of one agent and its org; ``None`` means unlimited for that tier, ``0`` admits nothing."""

    agent_rpm: int | None
    agent_tpm: int | None
    org_rpm: int | None
    org_tpm: int | None

    def __post_init__(self) -> None:
        for name in _TIERS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"rate limit {name} must be a non-negative integer or None, got {value!r}")

    @property
    def unlimited(self) -> bool:
        return self.agent_rpm is None and self.agent_tpm is None and self.org_rpm is None and self.org_tpm is None

    @property
    def limits_agent(self) -> bool:
        return self.agent_rpm is not None or self.agent_tpm is not None

    @property
    def limits_org(self) -> bool:
        return self.org_rpm is not None or self.org_tpm is not None


@dataclass(frozen=True)
class RateDecision:
    """The outcome of one admission, and what the proxy tells the client about it."""

    allowed: bool
    limit: int | None
    """The requests-per-minute limit of the tightest request tier (fewest requests left), for X-RateLimit-Limit."""
    remaining: int | None
    """Requests left in that tier's window after this decision, for X-RateLimit-Remaining."""
    reset_seconds: float
    """Seconds until the current window ends and every counter starts again."""
    retry_after: int | None
    """Whole seconds to wait before retrying (at least 1), set when denied."""
    denied_by: str | None
    """``"agent_rpm"``, ``"agent_tpm"``, ``"org_rpm"`` or ``"org_tpm"`` when denied."""
    oversized: bool = False
    """Denied because the request alone exceeds a token limit: waiting will not help."""
    window: int | None = None
    """Id of the window the request was counted in (pass it to :meth:`RateLimiter.adjust_tokens`); ``None`` when
    no tier is limited, in which case nothing was counted and no rate-limit headers apply."""

    def headers(self) -> dict[str, str]:
        """``X-RateLimit-Limit``/``-Remaining`` when a request tier applies, ``-Reset`` when any tier applies (whole
        seconds, rounded up), and ``Retry-After`` when denied."""
        out: dict[str, str] = {}
        if self.limit is not None and self.remaining is not None:
            out["X-RateLimit-Limit"] = str(self.limit)
            out["X-RateLimit-Remaining"] = str(self.remaining)
        if self.window is not None:
            out["X-RateLimit-Reset"] = str(_whole_seconds(self.reset_seconds))
        if not self.allowed and self.retry_after is not None:
            out["Retry-After"] = str(self.retry_after)
        return out


def _whole_seconds(seconds: float) -> int:
    return max(1, math.ceil(seconds))


def _arg(limit: int | None) -> int:
    return _UNLIMITED if limit is None else limit


class RateLimiter:
    """Admits or denies requests against :class:`RateLimits`, exactly, across every replica sharing one Redis.

    ``clock`` returns seconds since the epoch; leave it ``None`` in production so all replicas use the Redis
    server's clock (see the module docstring). Redis failures raise
    :class:`~ibex_dataplane.store.errors.StoreUnavailable`: the gate fails closed.
    """

    def __init__(
        self, redis: RedisClient, *, clock: Callable[[], float] | None = None, grants: GrantSettings | None = None
    ) -> None:
        self._clock = clock
        # register_script runs EVALSHA and loads the script on NOSCRIPT (e.g. after a Redis restart or failover).
        self._admit = redis.register_script(_ADMIT_LUA)
        self._adjust = redis.register_script(_ADJUST_LUA)
        self._give_back = redis.register_script(_GIVE_BACK_LUA)
        self._grants = GrantBook(grants) if grants is not None else None
        self._returns: set[asyncio.Task[None]] = set()
        self._top_ups: set[asyncio.Task[None]] = set()
        self._granting: dict[tuple[UUID, UUID, RateLimits], asyncio.Future[None]] = {}  # grants being counted

    def _local_now(self) -> float:
        return self._clock() if self._clock is not None else time.monotonic()

    def _now_arg(self) -> int | str:
        return _SERVER_CLOCK if self._clock is None else round(self._clock() * 1000)

    async def admit(self, org_id: UUID, agent_id: UUID, limits: RateLimits, tokens: int) -> RateDecision:
        """Count one request and ``tokens`` (the conservative estimate: prompt plus maximum output) against every
        limited tier, or count nothing and deny. One Redis round trip; none at all when nothing is limited, or
        when the request is drawn from a grant this process holds for the agent (with grants on)."""
        if tokens < 0:
            raise ValueError(f"tokens must be non-negative, got {tokens}")
        if limits.unlimited:
            now = self._clock() if self._clock is not None else time.time()
            return RateDecision(True, None, None, WINDOW_SECONDS - now % WINDOW_SECONDS, None, None)
        book, key, grant_size = self._grants, (org_id, agent_id, limits), 0
        if book is not None:
            now = self._local_now()
            busy = book.seen(key, now)
            drawn = self._draw(key, tokens)
            if drawn is None and (pending := self._granting.get(key)) is not None:
                await asyncio.shield(pending)  # a grant is being counted for this agent: draw from it if it came
                drawn = self._draw(key, tokens)
            if drawn is not None:
                if key not in self._granting and book.low(key, now):
                    self._top_up(key, tokens)
                return drawn
            if busy and key not in self._granting:
                grant_size = book.requests_for(key, now)
        if grant_size:
            granting = self._granting[key] = asyncio.get_running_loop().create_future()
            try:
                return await self._count(org_id, agent_id, limits, tokens, grant_size)
            finally:
                del self._granting[key]
                granting.set_result(None)
        return await self._count(org_id, agent_id, limits, tokens, 0)

    def _draw(self, key: tuple[UUID, UUID, RateLimits], tokens: int) -> RateDecision | None:
        assert self._grants is not None
        now = self._local_now()
        grant = self._grants.draw(key, tokens, now)
        if grant is None:
            return None
        remaining = None if grant.remaining is None else grant.remaining + grant.requests
        return RateDecision(True, grant.limit, remaining, max(0.0, grant.window_ends - now), None, None,
                            window=grant.window)  # fmt: skip

    def _top_up(self, key: tuple[UUID, UUID, RateLimits], tokens: int) -> None:
        """Count the agent's next grant in the background, sized on this request's tokens. Requests that find the
        current grant spent meanwhile wait for it (``_granting``). A failure is nobody's: the next request that
        cannot draw asks Redis itself, and fails closed if Redis is down."""
        assert self._grants is not None
        org_id, agent_id, limits = key
        granting = self._granting[key] = asyncio.get_running_loop().create_future()
        size = self._grants.requests_for(key, self._local_now())

        async def top_up() -> None:
            try:
                with contextlib.suppress(StoreUnavailable):
                    await self._count(org_id, agent_id, limits, tokens, size, top_up=True)
            finally:
                del self._granting[key]
                granting.set_result(None)

        task = asyncio.get_running_loop().create_task(top_up(), name="ibex-rate-grant-top-up")
        self._top_ups.add(task)
        task.add_done_callback(self._top_ups.discard)

    async def _count(
        self, org_id: UUID, agent_id: UUID, limits: RateLimits, tokens: int, grant_size: int, *, top_up: bool = False
    ) -> RateDecision:
        """The admit script: this request counted alone, or with a grant of ``grant_size`` when one fits; with
        ``top_up``, the grant alone when it fits, or nothing (the decision is then nobody's)."""
        book, key = self._grants, (org_id, agent_id, limits)
        keys = TenantKeys(org_id)
        try:
            raw = await self._admit(
                keys=[keys.agent_rate_window(agent_id), keys.org_rate_window()],
                args=[
                    self._now_arg(),
                    _WINDOW_MS,
                    _arg(limits.agent_rpm),
                    _arg(limits.agent_tpm),
                    _arg(limits.org_rpm),
                    _arg(limits.org_tpm),
                    tokens,
                    _EXPIRY_GRACE_MS,
                    grant_size,
                    grant_size * tokens,
                    book.settings.reserve if book is not None else 0,
                    "1" if top_up else "0",
                ],
            )
        except _REDIS_FAILURES as e:
            raise unavailable(e) from e
        denied, oversized, reset_ms, window, agent_requests, org_requests, counted = (int(x) for x in raw)
        limit, remaining = _tightest(
            (limits.agent_rpm, agent_requests),
            (limits.org_rpm, org_requests),
        )
        reset_seconds = reset_ms / 1000
        if book is not None and grant_size > 1 and counted < grant_size:  # the grant did not fit beside a limit
            book.refused(key, grant_size, self._local_now())
        if counted > 1 and book is not None:
            # A grant: this request is one of them (a top-up has no request), the rest is drawn here.
            now = self._local_now()
            drawable = counted if top_up else counted - 1
            grant = Grant(key, window, drawable, drawable * tokens, limit, remaining, now + reset_seconds,
                          now + book.settings.seconds, size=counted, placed_at=now)  # fmt: skip
            if (old := book.add(grant)) is not None:
                if top_up and old.window == window:  # counted in this window too: drawn from the new grant
                    grant.requests, grant.tokens = grant.requests + old.requests, grant.tokens + old.tokens
                    old.requests = old.tokens = 0
                self._return(old)
            asyncio.get_running_loop().call_later(book.settings.seconds, self._expire, grant)
            if remaining is not None:
                remaining += grant.requests
        return RateDecision(
            allowed=denied == 0,
            limit=limit,
            remaining=remaining,
            reset_seconds=reset_seconds,
            retry_after=None if denied == 0 else _whole_seconds(reset_seconds),
            denied_by=None if denied == 0 else _TIERS[denied - 1],
            oversized=bool(oversized),
            window=window,
        )

    def _expire(self, grant: Grant) -> None:
        if self._grants is not None and self._grants.take(grant, self._local_now()):
            self._return(grant)

    def _return(self, grant: Grant) -> None:
        """Give back what ``grant`` has left, in the background. A give-back that fails leaves the window counted
        high until it ends, as any lost reply does: counts only ever err upwards."""
        if grant.requests == 0 and grant.tokens == 0:
            return
        requests, tokens, grant.requests, grant.tokens = grant.requests, grant.tokens, 0, 0
        org_id, agent_id, limits = cast(tuple[UUID, UUID, RateLimits], grant.key)
        keys = TenantKeys(org_id)

        async def give_back() -> None:
            with contextlib.suppress(*_REDIS_FAILURES):
                await self._give_back(
                    keys=[keys.agent_rate_window(agent_id), keys.org_rate_window()],
                    args=[grant.window, requests, tokens, "1" if limits.limits_agent else "0",
                          "1" if limits.limits_org else "0"],
                )  # fmt: skip

        task = asyncio.get_running_loop().create_task(give_back(), name="ibex-rate-grant-return")
        self._returns.add(task)
        task.add_done_callback(self._returns.discard)

    @property
    def open_grants(self) -> int:
        return self._grants.open if self._grants is not None else 0

    async def drain(self) -> None:
        """Wait until no grant is being topped up in the background."""
        while self._top_ups:
            await asyncio.gather(*self._top_ups, return_exceptions=True)

    async def close(self) -> None:
        """At shutdown: let top-ups finish, then give back what every grant has left, and wait for it."""
        await self.drain()
        if self._grants is not None:
            for grant in self._grants.take_all():
                self._return(grant)
        while self._returns:
            await asyncio.gather(*self._returns, return_exceptions=True)

    async def adjust_tokens(
        self, org_id: UUID, agent_id: UUID, limits: RateLimits, delta: int, *, window: int | None = None
    ) -> None:
        """Correct an admitted request's token charge by ``delta`` = actual usage minus the admitted estimate.

        A positive delta is charged to the current window. A negative delta is refunded to ``window`` (the
        admitting decision's :attr:`RateDecision.window`) only while that window is current, or to the current
        window when ``window`` is not given; a refund never takes a counter below zero. Only call it for admitted
        requests. Raises StoreUnavailable like :meth:`admit`; a caller may ignore that, since a lost correction
        only leaves the conservative estimate charged.
        """
        if delta == 0 or limits.unlimited:
            return
        keys = TenantKeys(org_id)
        try:
            await self._adjust(
                keys=[keys.agent_rate_window(agent_id), keys.org_rate_window()],
                args=[
                    self._now_arg(),
                    _WINDOW_MS,
                    delta,
                    "" if window is None else window,
                    "1" if limits.limits_agent else "0",
                    "1" if limits.limits_org else "0",
                    _EXPIRY_GRACE_MS,
                ],
            )
        except _REDIS_FAILURES as e:
            raise unavailable(e) from e


def _tightest(*tiers: tuple[int | None, int]) -> tuple[int | None, int | None]:
    """The (limit, remaining) of the request tier with the fewest requests left; ties go to the smaller limit."""
    best: tuple[int, int] | None = None
    for limit, used in tiers:
        if limit is None:
            continue
        candidate = (max(0, limit - used), limit)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None, None
    return best[1], best[0]


@dataclass(frozen=True)
class _CorrectionKey:
    org_id: UUID
    agent_id: UUID
    limits: RateLimits
    window: int | None
    refund: bool  # refunds and charges are summed apart: each keeps its own window rule in the adjust script


class DeferredCorrections:
    """Token corrections gathered for ``delay`` seconds, then sent one per agent, window and direction.

    After every answer the proxy corrects the admitted token estimate by the actual usage; sent one by one that is a
    Redis call per request, as costly as the admission itself. Gathered, the corrections of every request an agent
    finished within ``delay`` are summed and sent as one :meth:`RateLimiter.adjust_tokens` call. The sum is exact:
    charges and refunds are kept apart, a refund still goes only to the window it was admitted in, and refunds
    clamped at zero one by one or together end the same. The only difference is timing: a correction takes effect
    up to ``delay`` later, so for that long the window holds the (conservative) estimate. Failures are reported to
    ``on_failure`` with the number of requests whose correction was lost (a lost correction leaves the estimate
    charged, as with a single call). :meth:`close` sends what is pending and stops deferring.
    """

    def __init__(
        self, limiter: RateLimiter, *, delay: float = 0.025, on_failure: Callable[[int], None] | None = None
    ) -> None:
        if delay <= 0:
            raise ValueError("delay must be positive")
        self._limiter = limiter
        self._delay = delay
        self._on_failure = on_failure
        self._pending: dict[_CorrectionKey, list[int]] = {}  # key -> [summed delta, requests]
        self._timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        self._closed = False

    def add(self, org_id: UUID, agent_id: UUID, limits: RateLimits, delta: int, *, window: int | None) -> None:
        """Queue one request's correction (``delta`` as for :meth:`RateLimiter.adjust_tokens`); never blocks."""
        if delta == 0 or limits.unlimited:
            return
        key = _CorrectionKey(org_id, agent_id, limits, window, delta < 0)
        entry = self._pending.setdefault(key, [0, 0])
        entry[0] += delta
        entry[1] += 1
        if self._closed:
            self._spawn_flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay, self._spawn_flush)

    @property
    def pending(self) -> int:
        """Requests whose correction has not been sent yet."""
        return sum(requests for _, requests in self._pending.values())

    def _spawn_flush(self) -> None:
        self._timer = None
        task = asyncio.get_running_loop().create_task(self.flush(), name="ibex-tpm-corrections")
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def flush(self) -> None:
        """Send every pending correction now."""
        batch, self._pending = self._pending, {}
        if not batch:
            return
        results = await asyncio.gather(
            *(
                self._limiter.adjust_tokens(k.org_id, k.agent_id, k.limits, delta, window=k.window)
                for k, (delta, _) in batch.items()
            ),
            return_exceptions=True,
        )
        lost = sum(requests for (_, requests), r in zip(batch.values(), results, strict=True) if r is not None)
        if lost and self._on_failure is not None:
            self._on_failure(lost)

    async def close(self) -> None:
        """At shutdown: send what is pending (and, from now on, each correction as it comes), then wait for it."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        await self.flush()
        while self._flushes:
            await asyncio.gather(*self._flushes, return_exceptions=True)
