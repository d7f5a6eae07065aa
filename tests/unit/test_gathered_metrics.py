"""Gathered proxy metrics: what a flush moves into Prometheus is exactly what direct observations would have
written, nothing is counted twice, and a scrape or the end of the application flushes."""

from __future__ import annotations

import asyncio
import math

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from ibex_dataplane.proxy import metrics as metrics_module
from ibex_dataplane.proxy.metrics import ProxyMetrics

BUCKETS = (0.001, 0.01, 0.1, 1.0)
AMOUNTS = [0.0, 0.0005, 0.001, 0.0010001, 0.05, 0.1, 0.99, 1.0, 7.5, -0.25, 0.001]


def test_a_flushed_histogram_renders_what_direct_observations_render() -> None:
    gathered, direct = ProxyMetrics(), CollectorRegistry()
    reference = Histogram("ibex_proxy_gate_duration_seconds", "h", ["gate"], buckets=BUCKETS, registry=direct)
    ours = Histogram("x_seconds", "h", ["gate"], buckets=BUCKETS, registry=gathered.registry)
    child = gathered.gathered_histogram(ours, "auth")
    for amount in AMOUNTS:  # every bucket edge, between edges, above the last, below zero
        child.observe(amount)
        reference.labels("auth").observe(amount)
    assert _samples(generate_latest(gathered.registry).decode())[("x_seconds_count", "")] == 0  # not yet flushed
    gathered.flush()
    gathered.flush()  # a second flush adds nothing
    expected = generate_latest(direct).decode().replace("ibex_proxy_gate_duration_seconds", "x_seconds")
    got = generate_latest(gathered.registry).decode()
    assert len(_samples(got)) == len(BUCKETS) + 3  # the buckets, +Inf, count and sum
    assert _samples(got) == _samples(expected)
    assert _samples(got)[("x_seconds_bucket", "0.001")] == 5  # 0, 0.0005, -0.25 and 0.001 twice: bounds inclusive
    assert math.isclose(_samples(got)[("x_seconds_sum", "")], sum(AMOUNTS))


def test_counters_add_up_across_flushes_and_one_label_set_is_one_child() -> None:
    metrics = ProxyMetrics()
    counter = Counter("y_total", "c", ["gate", "outcome"], registry=metrics.registry)
    passed = metrics.gathered_counter(counter, "auth", "pass")
    assert metrics.gathered_counter(counter, "auth", "pass") is passed
    for _ in range(3):
        passed.inc()
    metrics.flush()
    passed.inc(4)
    assert counter.labels("auth", "pass")._value.get() == 3
    metrics.flush()
    assert counter.labels("auth", "pass")._value.get() == 7


def test_a_render_flushes_first() -> None:
    metrics = ProxyMetrics()
    metrics.gathered_counter(metrics.budget_holds, "drawn").inc(2)
    metrics.gathered_histogram(metrics.gate_seconds, "authenticate").observe(0.0003)
    text = metrics.render().decode()
    assert 'ibex_proxy_budget_holds_total{outcome="drawn"} 2.0' in text
    assert 'ibex_proxy_gate_duration_seconds_bucket{gate="authenticate",le="0.0005"} 1.0' in text
    assert 'ibex_proxy_gate_duration_seconds_bucket{gate="authenticate",le="0.00025"} 0.0' in text


def test_the_application_flushes_while_it_runs_and_at_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "FLUSH_SECONDS", 0.01)

    async def scenario() -> tuple[float, float]:
        metrics = ProxyMetrics()
        drawn = metrics.gathered_counter(metrics.budget_holds, "drawn")
        child = metrics.budget_holds.labels("drawn")
        flushed = asyncio.Event()
        flush = metrics.flush

        def observed_flush() -> None:
            flush()
            flushed.set()

        metrics.flush = observed_flush  # type: ignore[method-assign]
        app = web.Application()
        app.cleanup_ctx.append(metrics.flushing)
        runner = web.AppRunner(app)
        await runner.setup()
        drawn.inc(5)
        await asyncio.wait_for(flushed.wait(), timeout=30)  # the periodic flush, with no scrape
        while_running = child._value.get()
        drawn.inc(2)
        await runner.cleanup()
        return while_running, child._value.get()

    while_running, at_the_end = asyncio.run(scenario())
    assert while_running == 5 and at_the_end == 7


def _samples(text: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("x_seconds_") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            le = name.split('le="')[1].split('"')[0] if 'le="' in name else ""
            out[(name.split("{")[0], le)] = float(value)
    return out
