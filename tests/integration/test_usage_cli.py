"""``ibex usage`` prints ``GET /v1/usage`` of a running proxy as a table, as a user runs it."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from aiohttp import ClientSession

from tests.support.processes import IBEX, REPO
from tests.support.proxy import RunningProxy
from tests.support.tenants import TenantFactory


async def ibex(*args: str) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "dataplane"), str(REPO / "operator")])}
    proc = await asyncio.create_subprocess_exec(
        *IBEX, *args, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_usage_prints_the_orgs_spend_as_a_table(
    proxy: RunningProxy, tenants: TenantFactory, tmp_path: Path
) -> None:
    t = await tenants.create(directive=None)
    headers = {"Authorization": f"Bearer {t.keys['alpha']}", "X-IBEX-Agent-ID": str(t.agents["alpha"])}
    async with ClientSession() as http:
        hello = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(2):
            async with http.post(proxy.v1 + "/chat/completions", headers=headers, json=hello) as r:
                assert r.status == 200
        deadline = asyncio.get_running_loop().time() + 15
        report: dict[str, object] = {"data": []}
        while not report["data"] and asyncio.get_running_loop().time() < deadline:  # analytics flush in batches
            async with http.get(proxy.v1 + "/usage", headers=headers) as r:
                report = await r.json()
            if not report["data"]:
                await asyncio.sleep(0.1)
    key_file = tmp_path / "key"
    key_file.write_text(t.keys["alpha"] + "\n")
    code, out, err = await ibex("usage", "--url", proxy.base_url, "--key-file", str(key_file))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1].split() == ["agent", "requests", "prompt", "tokens", "completion", "tokens", "cost", "(USD)"]
    name = f"alpha-{t.name.removeprefix('org-')}"
    row = next(line for line in lines if line.startswith(name))
    assert row.split()[2] == "2"  # two requests
    assert lines[-1].split()[:2] == ["total", "2"]
    code, out, _ = await ibex("usage", "--url", proxy.base_url, "--key-file", str(key_file), "--group-by", "model",
                              "--json")  # fmt: skip
    assert code == 0 and [r["key"] for r in json.loads(out)["data"]] == ["echo"]
    chat_only = await tenants.create(directive=None, scopes=("chat",))
    key_file.write_text(chat_only.keys["alpha"])
    code, _, err = await ibex("usage", "--url", proxy.base_url, "--key-file", str(key_file))
    assert code == 1 and "INSUFFICIENT_PERMISSIONS" in err
