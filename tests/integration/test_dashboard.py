"""The Grafana dashboard shipped in the chart queries only metrics the processes really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from aiohttp import ClientSession

from ibex_operator.health import OperatorState
from tests.support.proxy import RunningProxy

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "ibex" / "dashboards" / "ibex-overview.json"
METRIC = re.compile(r"\b(ibex_[a-z0-9_]+)\b")
WORKER_ONLY = frozenset({"ibex_proxy_worker_requests"})
"""Exported only by `ibex proxy --workers N` with N above 1: test_proxy_workers checks them against that scrape."""


def exported(text: str) -> set[str]:
    """Every series name a scrape of ``text`` can hold, from its ``# TYPE`` lines."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "counter" and not name.endswith("_total"):
                names.add(name + "_total")
            if kind == "histogram":
                names.update(name + suffix for suffix in ("_bucket", "_count", "_sum"))
    return names


def queried() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    return {m for e in exprs for m in METRIC.findall(e)}


async def test_every_metric_the_dashboard_queries_is_exported(proxy: RunningProxy) -> None:
    assert proxy.memory is not None and proxy.context is not None
    async with ClientSession() as http:
        scrapes = [await (await http.get(url + "/metrics")).text() for url in (proxy.base_url, proxy.memory.base_url)]
    scrapes.append(proxy.context.metrics.render().decode())
    scrapes.append(OperatorState().metrics_text())
    names = set().union(*(exported(text) for text in scrapes))
    wanted = queried()
    assert len(wanted) >= 15  # the dashboard covers proxy, memory, context and operator
    assert {m.split("_")[1] for m in wanted} == {"proxy", "memory", "context", "operator"}
    assert wanted >= WORKER_ONLY and not WORKER_ONLY & names
    assert wanted - WORKER_ONLY <= names, sorted(wanted - WORKER_ONLY - names)


def test_the_dashboard_is_valid_grafana_json_with_unique_panel_ids() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["title"]
    assert all(panel["targets"] and panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
