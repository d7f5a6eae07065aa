"""A bounded, open-loop load generator over the three proxy replicas, recording every outcome.

Requests go out at a fixed rate (capped in flight, in count and in time), round-robin over the replicas per kind,
alternating between the fault's organizations. Each result records when it started and ended, the replica, the
HTTP status and error code (or the connection-level outcome: refused, cut, timeout), whether a 503 carried
``Retry-After``, whether context assembly degraded, and whether the body held another organization's marker.

Memory writes are the client a careful agent would be: unique content, an ``Idempotency-Key`` per write, and a
retry with the same key (on the next replica, with exponential backoff, never before ``Retry-After``) until a 2xx,
so the audit can check that each write landed exactly once whatever the fault did to the attempts before.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import string
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import aiohttp
import orjson

from tests.chaos.stack import UPSTREAM_MODEL

CLIENT_TIMEOUT = 10.0  # an answer later than this is a hang
MAX_IN_FLIGHT = 300
WORDS = (
    "harbour", "lantern", "copper", "meadow", "violet", "falcon", "orchard", "glacier", "pepper", "saddle", "timber",
    "cobalt", "willow", "marble", "thistle", "amber", "canyon", "juniper", "quartz", "raven",
)  # fmt: skip


def token(n: int = 12) -> str:
    """Letters only: nothing the PII redactor could mistake for a number, a date or an address."""
    return "".join(random.choices(string.ascii_lowercase, k=n))


@dataclass(frozen=True)
class Org:
    """One organization of a fault: its marker is in every memory and prompt it sends."""

    name: str
    org_id: UUID
    marker: str
    agents: dict[str, UUID]
    keys: dict[str, str]

    def headers(self, agent: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[agent]}", "X-IBEX-Agent-ID": str(self.agents[agent])}


@dataclass
class Result:
    kind: str
    replica: int
    org: str
    t0: float
    t1: float = 0.0
    status: int | None = None  # None: no HTTP status (refused, cut before the headers, timeout)
    outcome: str = ""  # ok | http | refused | cut | timeout
    code: str = ""
    retry_after: bool = False
    degraded: bool | None = None
    leak: str = ""  # the foreign marker found in the body, if any
    retry: bool = False  # a retried memory write


@dataclass
class Write:
    """One memory write as the client sees it, across its attempts."""

    org: Org
    content: str
    key: str
    ids: list[str] = field(default_factory=list)  # memory ids answered by 2xx attempts
    attempts: int = 0
    done: bool = False
    next_at: float = 0.0


# kind -> the agent it speaks as
AGENT = {"chat": "mem", "write": "mem", "search": "mem", "echo": "fast", "capped": "cap", "stream": "fast",
         "upstream": "fast"}  # fmt: skip
# Requests of each kind in one cycle of 50. Memory work (context assembly, writes, searches) embeds a text each in
# the one memory stage process, which on a shared 2-core machine manages about 15 embeddings/s besides the rest: it
# is a small share of the mix, the proxies' own work (keys, limits, holds, providers, settlement) is the bulk.
WEIGHTS = {"chat": 1, "write": 1, "search": 1, "echo": 14, "capped": 13, "stream": 10, "upstream": 10}


def _spread(weights: dict[str, int]) -> tuple[str, ...]:
    """One cycle with each kind's slots evenly spaced (so every stretch of the load has every kind)."""
    slots = [(i / n + 0.5 / n, kind) for kind, n in weights.items() for i in range(n)]
    return tuple(kind for _, kind in sorted(slots))


MIX = _spread(WEIGHTS)
SUCCESS = {"chat": {200}, "echo": {200}, "capped": {200, 402}, "stream": {200}, "upstream": {200},
           "write": {200, 201}, "search": {200}}  # fmt: skip
RECOVERY_KINDS = ("chat", "echo", "stream", "upstream", "write", "search")


class Load:
    def __init__(
        self, urls: list[str], orgs: list[Org], foreign: Iterable[str], *, rate: float, max_seconds: float
    ) -> None:
        self.urls = urls
        self.orgs = orgs
        self.markers = {o.name: o.marker for o in orgs}
        self.all_markers = set(foreign) | set(self.markers.values())
        self.rate = rate
        self.max_seconds = max_seconds
        self.results: list[Result] = []
        self.writes: list[Write] = []
        self.in_flight: Counter[tuple[int, str]] = Counter()
        self.streaming: Counter[int] = Counter()  # streams per replica whose first bytes arrived, not ended
        self.started = 0.0
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._gate = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._http: aiohttp.ClientSession | None = None
        self._runner: asyncio.Task[None] | None = None
        self._retrier: asyncio.Task[None] | None = None
        self._rr: Counter[str] = Counter()

    # -- running ---------------------------------------------------------------------------------------------
    async def __aenter__(self) -> Load:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT),
        )
        self.started = time.monotonic()
        self._runner = asyncio.create_task(self._generate(), name="chaos-load")
        self._retrier = asyncio.create_task(self._retry_writes(), name="chaos-retries")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        assert self._http is not None
        await self._http.close()

    async def stop(self) -> None:
        """Stop sending; wait for every request in flight (each is bounded by the client timeout)."""
        self._stop.set()
        for task in (self._runner, self._retrier):
            if task is not None:
                await task
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=CLIENT_TIMEOUT + 5)

    async def _generate(self) -> None:
        period = 1.0 / self.rate
        start = time.monotonic()
        for i in itertools.count():
            if self._stop.is_set() or time.monotonic() - start > self.max_seconds:
                return
            delay = start + i * period - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                if self._stop.is_set():
                    return
            kind = MIX[i % len(MIX)]
            org = self.orgs[(i // len(MIX)) % len(self.orgs)]
            replica = self._rr[kind] % len(self.urls)
            self._rr[kind] += 1
            await self._gate.acquire()
            self._spawn(self._one(kind, replica, org))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retry_writes(self) -> None:
        """Re-send failed writes with their key until they land (also after the load stops: see ``settle``)."""
        turn = 0
        while not self._stop.is_set():
            await self._retry_due(turn)
            turn += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.1)

    async def _retry_due(self, turn: int) -> int:
        now = time.monotonic()
        due = [w for w in self.writes if not w.done and w.attempts and w.next_at <= now and w.next_at > 0]
        for n, write in enumerate(due):
            write.next_at = 0.0  # in flight
            await self._gate.acquire()
            self._spawn(self._write(write, (turn + n) % len(self.urls), retry=True))
        return len(due)

    async def settle_writes(self, deadline: float) -> list[Write]:
        """After the load: keep retrying unfinished writes until every one landed or ``deadline``; returns the
        ones that never got a 2xx."""
        turn = 0
        while True:
            pending = [w for w in self.writes if not w.done]
            if not pending or time.monotonic() > deadline:
                if self._tasks:
                    await asyncio.wait(set(self._tasks), timeout=CLIENT_TIMEOUT + 5)
                return [w for w in self.writes if not w.done]
            await self._retry_due(turn)
            turn += 1
            await asyncio.sleep(0.1)  # the retry cadence of the client, not a synchronization

    # -- one request -----------------------------------------------------------------------------------------
    async def _one(self, kind: str, replica: int, org: Org) -> None:
        if kind == "write":
            write = Write(org, f"{org.marker} remembers {token()}: the {random.choice(WORDS)} is "
                               f"{random.choice(WORDS)} near the {random.choice(WORDS)}.", token(24))  # fmt: skip
            self.writes.append(write)
            await self._write(write, replica)
            return
        question = f"What does {org.marker} remember about the {random.choice(WORDS)}?"
        if kind == "search":
            body: dict[str, Any] = {"query": f"{org.marker} remembers the {random.choice(WORDS)}", "limit": 5}
            await self._request(kind, replica, org, "/v1/memories/search", body)
            return
        model = UPSTREAM_MODEL if kind in ("stream", "upstream") else "echo"
        body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 16}
        if kind == "stream":
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        await self._request(kind, replica, org, "/v1/chat/completions", body)

    async def _write(self, write: Write, replica: int, *, retry: bool = False) -> None:
        write.attempts += 1
        headers = {"Idempotency-Key": write.key}
        result, raw = await self._request(
            "write", replica, write.org, "/v1/memories", {"content": write.content}, headers, retry=retry
        )
        if result.status in (200, 201):
            write.ids.append(orjson.loads(raw)["memory"]["id"])
            write.done = True
            return
        # exponential backoff with jitter, never sooner than the server's Retry-After (all it sends is 1 or 5 s)
        backoff = min(8.0, 0.5 * 2 ** (write.attempts - 1)) * random.uniform(0.5, 1.0)
        write.next_at = time.monotonic() + max(backoff, 1.0 if result.retry_after else 0.0)

    async def _request(
        self, kind: str, replica: int, org: Org, path: str, body: dict[str, Any],
        extra: dict[str, str] | None = None, *, retry: bool = False,
    ) -> tuple[Result, bytes]:  # fmt: skip
        assert self._http is not None
        result = Result(kind, replica, org.name, time.monotonic(), retry=retry)
        raw = b""
        headers = {**org.headers(AGENT[kind]), **(extra or {})}
        self.in_flight[(replica, kind)] += 1
        try:
            async with self._http.post(self.urls[replica] + path, json=body, headers=headers) as r:
                result.status = r.status
                result.retry_after = "Retry-After" in r.headers
                degraded = r.headers.get("X-IBEX-Context-Degraded")
                result.degraded = None if degraded is None else degraded == "true"
                raw = await (self._sse(r, result, replica) if body.get("stream") and r.status == 200 else r.read())
            self._classify(result, kind, raw.decode(errors="replace"))
        except aiohttp.ClientConnectorError:
            result.outcome = "refused"
        except TimeoutError:
            result.outcome = "timeout"
        except (aiohttp.ClientError, ConnectionError):
            result.outcome = "cut"
        finally:
            result.t1 = time.monotonic()
            self.in_flight[(replica, kind)] -= 1
            self._gate.release()
            self.results.append(result)
        return result, raw

    async def _sse(self, r: aiohttp.ClientResponse, result: Result, replica: int) -> bytes:
        """Read a stream to its end; a stream without ``[DONE]`` was cut, an error event is an error."""
        raw = b""
        started = False
        try:
            async for line in r.content:
                if not started:
                    started = True
                    self.streaming[replica] += 1
                raw += line
        finally:
            if started:
                self.streaming[replica] -= 1
        if b"data: [DONE]" not in raw:
            raise aiohttp.ClientPayloadError("stream ended without [DONE]")
        for line in raw.split(b"\n"):
            if line.startswith(b"data: {") and b'"error"' in line[:20]:
                result.code = str(orjson.loads(line[6:])["error"].get("code", ""))
        return raw

    def _classify(self, result: Result, kind: str, text: str) -> None:
        own = self.markers[result.org]
        for marker in self.all_markers:
            if marker != own and marker in text:
                result.leak = marker
        assert result.status is not None
        if result.status in SUCCESS[kind] and result.status < 300 and not result.code:
            result.outcome = "ok"
            return
        result.outcome = "http"
        if not result.code:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                result.code = str(orjson.loads(text)["error"]["code"])

    # -- reading the record ----------------------------------------------------------------------------------
    def since(self, t: float, until: float = float("inf")) -> list[Result]:
        return [r for r in self.results if t <= r.t0 < until]

    def count(self, predicate: Callable[[Result], bool], since: float = 0.0) -> int:
        return sum(1 for r in self.results if r.t0 >= since and predicate(r))

    def first_success(self, since: float, replica: int, kind: str) -> float | None:
        times = [r.t1 for r in self.results if r.t0 >= since and r.replica == replica and r.kind == kind
                 and r.outcome == "ok" and not r.degraded]  # fmt: skip
        return min(times) if times else None

    def recovered_at(self, since: float, kinds: Iterable[str] = RECOVERY_KINDS) -> float | None:
        """When every kind had succeeded (undegraded) on every replica with a request started after ``since``."""
        firsts = [self.first_success(since, replica, kind) for replica in range(len(self.urls)) for kind in kinds]
        if any(f is None for f in firsts):
            return None
        return max(f for f in firsts if f is not None)


async def wait_for(
    condition: Callable[[], Any], deadline: float, what: str | Callable[[], str], every: float = 0.05
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` at ``deadline``."""
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what if isinstance(what, str) else what()}"
        await asyncio.sleep(every)


def outcome_label(r: Result) -> str:
    # A stream cut mid-body has its 200 already: the connection's fate is the outcome.
    if r.status is None or r.outcome in ("refused", "cut", "timeout"):
        return r.outcome
    return f"{r.status}" + (f" {r.code}" if r.code and r.status >= 300 else "")
