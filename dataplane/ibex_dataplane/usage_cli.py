"""``ibex usage``: ``GET /v1/usage`` of a running proxy, printed as a table (or as the JSON it answered).

Called by :mod:`ibex_dataplane.cli`; talks to the proxy over HTTP with an API key that has the ``usage:read``
scope, like any client. Nothing here reads the stores.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import aiohttp
import orjson

HEADERS = ("requests", "prompt tokens", "completion tokens", "cost (USD)")


class UsageError(Exception):
    """The proxy could not be reached or refused the call; the message is what to print."""


async def fetch_usage(url: str, token: str, params: dict[str, str], timeout: float = 30.0) -> dict[str, Any]:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http,
            http.get(url.rstrip("/") + "/v1/usage", params=params, headers={"Authorization": f"Bearer {token}"}) as r,
        ):
            body = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError) as e:
        raise UsageError(f"cannot reach {url}: {type(e).__name__}") from e
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise UsageError(f"{url} answered {status} without a JSON body") from e
    if status != 200:
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(error, dict):
            raise UsageError(f"{status} {error.get('code')}: {error.get('message')}")
        raise UsageError(f"{url} answered {status}")
    if not isinstance(parsed, dict) or not isinstance(parsed.get("data"), list):
        raise UsageError(f"{url} answered something that is not a usage report")
    return parsed


def usage_table(report: dict[str, Any]) -> str:
    """The report as aligned text: one row per group, then the total."""
    group = str(report.get("group_by", "key"))
    rows: list[list[str]] = []
    counts, cost = [0, 0, 0], Decimal(0)
    for row in report["data"]:
        label = str(row.get("key", ""))
        if row.get("agent_name"):
            label = f"{row['agent_name']} ({label})"
        values = [int(row["requests"]), int(row["prompt_tokens"]), int(row["completion_tokens"])]
        spent = Decimal(str(row["cost_usd"]))
        counts = [a + b for a, b in zip(counts, values, strict=True)]
        cost += spent
        rows.append([label, *(f"{v:,}" for v in values), f"{spent:.6f}"])
    rows.append(["total", *(f"{v:,}" for v in counts), f"{cost:.6f}"])
    head = [group, *HEADERS]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cells)).rstrip()

    title = f"usage of {report.get('org_id')} from {report.get('from')} to {report.get('to')} (exclusive)"
    out = [title, line(head), line(["-" * w for w in widths]), *(line(r) for r in rows[:-1])]
    out += [line(["-" * w for w in widths]), line(rows[-1])]
    return "\n".join(out)


def run_usage(url: str, token: str, params: dict[str, str], as_json: bool) -> tuple[int, str]:
    """(exit code, text to print): 0 and the table (or JSON), or 1 and the reason."""
    try:
        report = asyncio.run(fetch_usage(url, token, params))
    except UsageError as e:
        return 1, f"ibex usage: {e}"
    return 0, orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() if as_json else usage_table(report)
