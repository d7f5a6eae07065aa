"""The benchmark report's own logic: targets met or missed by how much, the profile summary, the plots and the
markdown, on small fixed figures (the benchmarks themselves are not run here)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from bench.figures import latency
from bench.report import bench_commands, markdown, plots, profile_top, target_rows

ENV = {"date": "2026-12-02T00:00:00+00:00", "commit": "abc123def4567890", "dirty": False, "python": "3.11.7",
       "machine": "x86_64", "cores": 2, "cpu": "AMD EPYC, no VNNI", "load_before": [0.1, 0.2, 0.3],
       "libraries": {"aiohttp": "3"}, "quick": False}  # fmt: skip


def results() -> dict[str, Any]:
    def lat(values: list[float]) -> dict[str, Any]:
        return {"latency": latency(values, samples=True), "rps": 100.0, "errors": 0}

    proxy = {
        "targets": {
            "direct": lat([0.5, 0.6, 0.7]),
            "ibex": lat([2.5, 3.0, 9.0]),
            "workers=1": {**lat([2.4, 2.9, 8.0]), "cpu_us_per_request": {"proxy": 400.0, "postgres": 150.0}},
        },
        "added": {"ibex": {"p50": 2.4, "p95": 5.0, "p99": 8.3}},
        "workers": {"1": {"rps": 200.0, "errors": 0}, "2": {"rps": 320.0, "errors": 0}},
        "durability": {"synchronous_commit": "on", "fsync": "on"},
        "stream": {
            "method": "100 streamed answers per target",
            "events": 32,
            "added": {
                "ibex": {"first_p50": 2.5, "first_p99": 6.0, "end_p50": 3.4, "end_p99": 8.0, "per_event_us": 27.3},
                "litellm": {
                    "first_p50": 15.6,
                    "first_p99": 21.0,
                    "end_p50": 43.3,
                    "end_p99": 60.1,
                    "per_event_us": 840.3,
                },
            },
        },
        "stages": {
            "ibex": {
                "rate_limit": {"p50": 0.06, "p99": 0.17, "max": 0.7},
                "request": {"p50": 1.2, "p99": 3.6, "max": 8.6},
                "upstream": {"p50": 0.64, "p99": 2.72, "max": 7.8},
            }
        },
    }
    memory = {
        "search": {
            "10000": {"latency": latency([10.0, 12.0, 14.0], samples=True), "phases_ms": {"embed": 4.0},
                      "ann_recall_at_10": 1.0},
            "100000": {"latency": latency([15.0, 18.0, 19.5], samples=True), "phases_ms": {"embed": 5.0},
                       "ann_recall_at_10": 0.998},
        },
        "bulk": {"streams_1": {"memories": 9000, "seconds": 60.0, "per_second": 150.0},
                 "streams_2": {"memories": 4000, "seconds": 40.0, "per_second": 100.0}},
    }  # fmt: skip
    context = {"memories": 10_000, "repeats": {
        str(i): {"assembly": latency([20.0 + i, 30.0 + i, 50.0 + i], samples=True), "phases_median_ms": {"cold": 9.0},
                 "over_deadline": 1} for i in range(3)}}  # fmt: skip
    return {
        "proxy": {"command": "python -m bench.proxy_overhead", "seconds": 1, "exit": 0, "figures": proxy,
                  "profile_top": [("gate (proxy/generation.py)", 12.5)]},
        "memory": {"command": "python bench/memory_bench.py", "seconds": 1, "exit": 0, "figures": memory,
                   "host_speed": {"before": {"python_ms": 33.0, "numpy_ms": 6.25},
                                  "after": {"python_ms": 58.5, "numpy_ms": 8.0}}},
        "context": {"command": "python bench/context_bench.py", "seconds": 1, "exit": 0, "figures": context},
    }  # fmt: skip


def by_target(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["target"].split(" (")[0]: r for r in rows}


def test_targets_say_met_or_by_how_much_they_are_missed() -> None:
    rows = by_target(target_rows(results()))
    p50 = rows["proxy added latency p50"]
    assert (p50["measured"], p50["met"]) == (2.4, False)
    assert p50["note"] == "missed by 1.4 ms (2.4x)"
    assert rows["proxy added latency p99"]["met"] is False
    throughput = rows["requests/s of one proxy process"]
    assert (throughput["measured"], throughput["met"]) == (200.0, False)
    assert throughput["note"] == "missed by 2.8e+03 req/s (15.0x)"
    assert rows["memory search p95 at 100k memories"]["met"] is True  # 19.5 <= 20, the biggest size measured
    assert rows["bulk ingest through the proxy"]["met"] is True  # exactly 150 meets "at least 150"
    concurrent = rows["bulk ingest through the proxy, 2 batch requests in flight"]  # its own row, not a maximum
    assert (concurrent["measured"], concurrent["met"]) == (100.0, False)
    context = rows["context assembly p95 at 10k memories"]
    assert context["measured"] == 51.0 and context["met"] is False  # the median of the repeats' p95 (50, 51, 52)
    capacity = rows["requests/s one proxy process serves per core-second of its own CPU"]
    assert (capacity["measured"], capacity["met"]) == (2500.0, False)  # 1 / 400 us
    litellm = rows["added latency ours / LiteLLM, p50"]
    assert litellm["met"] is None and "not measured" in litellm["note"]
    # The first streamed event against a whole non-streamed answer, both added over the direct upstream.
    streamed = rows["streamed answer: added p50 to the first event, at most the non-streamed added p50"]
    assert (streamed["goal"], streamed["measured"], streamed["met"]) == (2.4, 2.5, False)
    assert streamed["target"].endswith("(32 events)")


def test_the_latency_rows_show_the_bare_pass_through_of_the_same_run_as_the_floor() -> None:
    data = results()
    proxy = data["proxy"]["figures"]
    proxy["added"]["bare"] = {"p50": 0.25, "p95": 0.4, "p99": 1.9}
    proxy["ratio_litellm"] = {"p50": 0.08, "p99": 0.2}
    proxy["ratio_litellm_bare"] = {"p50": 0.021, "p99": 0.118}
    rows = by_target(target_rows(data))
    assert rows["proxy added latency p99"]["note"] == "missed by 5.3 ms (2.8x); a bare pass-through, same run: 1.9 ms"
    met = rows["added latency ours / LiteLLM, p50"]
    assert (met["met"], met["note"]) == (True, "a bare pass-through, same run: 0.021 ratio")
    missed = rows["added latency ours / LiteLLM, p99"]
    assert missed["note"] == "missed by 0.1 ratio (2.0x); a bare pass-through, same run: 0.118 ratio"
    # Without a bare pass-through in the run, the notes say only what they said before.
    del proxy["added"]["bare"], proxy["ratio_litellm_bare"]
    assert by_target(target_rows(data))["proxy added latency p99"]["note"] == "missed by 5.3 ms (2.8x)"


def test_the_report_runs_the_bare_pass_through_beside_the_proxy(tmp_path: Path) -> None:
    for quick in (False, True):
        args = argparse.Namespace(quick=quick, litellm="litellm")
        proxy = bench_commands(args, tmp_path)["proxy"]
        assert "--bare" in proxy and proxy[proxy.index("--litellm") + 1] == "litellm"


def test_a_missing_benchmark_is_reported_as_not_measured() -> None:
    rows = target_rows({})
    assert all(r["met"] is None and r["measured"] is None for r in rows)
    assert by_target(rows)["proxy added latency p50"]["note"] == "proxy benchmark missing"
    streamed = by_target(rows)["streamed answer: added p50 to the first event, at most the non-streamed added p50"]
    assert streamed["note"] == "no streamed answers in the proxy benchmark"


def test_the_profile_summary_ranks_the_projects_functions_by_inclusive_samples(tmp_path: Path) -> None:
    profile = tmp_path / "profile.txt"
    profile.write_text(
        "run (uvloop/__init__.py:1);gate (ibex_dataplane/proxy/generation.py:10);call_as (ibex_dataplane/store/"
        "postgres.py:5) 6\n"
        "run (uvloop/__init__.py:1);gate (ibex_dataplane/proxy/generation.py:10) 2\n"
        "run (uvloop/__init__.py:1);admit (ibex_dataplane/proxy/ratelimit.py:3) 2\n"
    )
    assert profile_top(profile) == [
        ("gate (proxy/generation.py)", 80.0), ("call_as (store/postgres.py)", 60.0),
        ("admit (proxy/ratelimit.py)", 20.0),
    ]  # fmt: skip


def test_plots_and_markdown_are_written(tmp_path: Path) -> None:
    data = results()
    images = plots(data, tmp_path / "2026-12-02")
    assert [name for _, name in images] == [
        "2026-12-02-proxy-latency.png", "2026-12-02-proxy-workers.png", "2026-12-02-search.png",
        "2026-12-02-context.png",
    ]  # fmt: skip
    for _, name in images:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = markdown(ENV, data, target_rows(data), images)
    assert "| proxy added latency p50 | 1 ms | 2.4 ms | no | missed by 1.4 ms (2.4x) |" in text
    assert "Postgres synchronous_commit = on, fsync = on" in text
    assert "- 12.5 % gate (proxy/generation.py)" in text
    assert "- workers=1: proxy 400, postgres 150" in text
    # The request first, then its parts by p99.
    table = text.split("## Where the proxy's latency goes")[1].split("##")[0]
    assert [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:] == [
        "| request",
        "| upstream",
        "| rate_limit",
    ]
    assert "| upstream | 0.640 | 2.720 | 7.80 |" in table
    assert "![Throughput vs workers](2026-12-02-proxy-workers.png)" in text
    streams = text.split("## Streamed answers")[1].split("##")[0]
    assert "100 streamed answers per target." in streams
    assert "| ibex | 2.500 | 6.000 | 3.400 | 8.000 | 27.3 us |" in streams
    assert "| litellm | 15.600 | 21.000 | 43.300 | 60.100 | 840.3 us |" in streams
    assert "host yardstick before python 33.0 / numpy 6.2 ms, after python 58.5 / numpy 8.0 ms" in text
    assert "host yardstick before not taken, after not taken" in text  # the runs that did not record it
    assert "on 2 cores (x86_64, AMD EPYC, no VNNI)" in text


def test_the_machine_s_paths_do_not_reach_the_committed_report() -> None:
    import sys

    from bench.report import REPO, machine_paths_hidden

    text = f"{REPO}/bench/x.py {sys.base_prefix}/lib/a.py /tmp/ibex-report-ab_12/proxy.json /tmp/now/y.json"
    assert machine_paths_hidden(text, "/tmp/now") == "<repo>/bench/x.py <python>/lib/a.py <tmp>/proxy.json <tmp>/y.json"
    assert machine_paths_hidden("--litellm /opt/x/bin/litellm", "/tmp/now", "/opt/x/bin/litellm") == (
        "--litellm PATH/TO/litellm"
    )


def test_the_host_yardstick_times_fixed_work() -> None:
    from bench import hostspeed

    assert hostspeed.python_work() == hostspeed.python_work()  # the same work every time, not a timing
    assert hostspeed.numpy_work() == hostspeed.numpy_work()
    speed = hostspeed.measure(repeats=1)
    assert set(speed) == {"python_ms", "numpy_ms"} and all(v > 0 for v in speed.values())
    with pytest.raises(ValueError, match="at least 1"):
        hostspeed.measure(repeats=0)


def test_the_cpu_line_says_whether_int8_dot_products_are_there() -> None:
    from bench import hostspeed

    with_vnni = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_vnni\n"
    without = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu avx2\n"
    assert hostspeed.cpu(with_vnni) == "AMD EPYC, VNNI"
    assert hostspeed.cpu(without) == "Intel Xeon, no VNNI"
    assert hostspeed.cpu("") == "unknown CPU, no VNNI"
    assert hostspeed.cpu().endswith("VNNI")  # this machine's own /proc/cpuinfo
