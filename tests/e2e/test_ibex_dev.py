"""`ibex dev` as a user runs it: ready line, health, keys file, clean shutdown, data kept across restarts."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import asyncpg
import pytest
from aiohttp import ClientSession
from openai import OpenAI

from ibex_dataplane.runtime.embedded import RuntimeInfo
from ibex_dataplane.security.apikeys import parse_token, secret_matches
from tests.support.processes import IBEX, REPO, IbexProcess, ibex_process

# Functional tests must not depend on how loaded the CI machine is: context deadlines are raised (the deadline
# behaviour has its own integration tests, and bench/context_bench.py measures the latency).
UNHURRIED = {"IBEX_CONTEXT_DEADLINE_MS": "5000", "IBEX_CONTEXT_HOT_MS": "5000", "IBEX_CONTEXT_COLD_MS": "5000",
             "IBEX_CONTEXT_TIMEOUT_MS": "8000"}  # fmt: skip


@contextmanager
def ibex_dev(
    data_dir: Path, keys_out: Path, manifests: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[IbexProcess]:
    args = ["dev", "--data-dir", str(data_dir), "--port", "0", "--keys-out", str(keys_out)]
    if manifests is not None:
        args += ["--manifests", str(manifests)]
    with ibex_process(args, {**os.environ, **UNHURRIED, **(env or {})}) as dev:
        yield dev


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def org_ids(info: RuntimeInfo) -> dict[str, str]:
    conn = await asyncpg.connect(info.postgres_admin_dsn)
    try:
        return {r["name"]: str(r["id"]) for r in await conn.fetch("SELECT name, id FROM organizations")}
    finally:
        await conn.close()


async def token_is_valid(info: RuntimeInfo, pepper: bytes, token: str) -> bool:
    key_id, secret = parse_token(token)
    conn = await asyncpg.connect(info.postgres_app_dsn)
    try:
        row = await conn.fetchrow("SELECT secret_hash, revoked_at FROM ibex_lookup_api_key($1)", key_id)
    finally:
        await conn.close()
    return row is not None and row["revoked_at"] is None and secret_matches(pepper, secret, bytes(row["secret_hash"]))


@pytest.fixture
def scratch() -> Iterator[Path]:
    """Under /tmp itself, not pytest's private (0700) temp root: as root, Postgres runs as an unprivileged user."""
    root = Path(tempfile.mkdtemp(prefix="ibex-e2e-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


async def test_ibex_dev_serves_keeps_data_across_restarts_and_stops_cleanly(scratch: Path) -> None:
    data_dir, keys_out = scratch / "data", scratch / "keys.json"

    with ibex_dev(data_dir, keys_out) as dev:
        async with ClientSession() as http:
            async with http.get(dev.url + "/readyz") as r:
                assert r.status == 200
                body = await r.json()
            async with http.get(dev.url + "/healthz") as r:
                assert r.status == 200
        assert body["checks"] == {"postgres": "ok", "redis": "ok", "clickhouse": "ok"}
        first_keys = json.loads(keys_out.read_text())
        info = RuntimeInfo.read(data_dir / "runtime.json")
        first_orgs = await org_ids(info)
        pepper = bytes.fromhex((data_dir / "pepper").read_text())
        assert [await token_is_valid(info, pepper, t) for t in first_keys.values()] == [True] * len(first_keys)
        for ref, token in first_keys.items():
            assert f"  {ref}: {token}\n" in dev.output, f"{ref} was not printed"
        assert "not supported by registry" not in "".join(dev.output)  # dependency noise is filtered at start
        await check_the_welcome(dev, first_keys)

        # The main job serves chats as a user drives it: the official SDK, a printed key, the echo model.
        def chat_as(token: str) -> list[dict[str, str]]:
            with OpenAI(base_url=dev.url + "/v1", api_key=token, max_retries=0,
                        default_headers={"X-IBEX-Agent-ID": "support-bot"}) as ai:  # fmt: skip
                reply = ai.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hello"}])
            seen: list[dict[str, str]] = json.loads(reply.choices[0].message.content or "")
            return seen

        seen = await asyncio.to_thread(chat_as, first_keys["tenants/support-bot-key"])
        assert seen[0]["role"] == "system" and "support assistant for Acme" in seen[0]["content"]
        assert seen[1] == {"role": "user", "content": "hello"}

        # The README's memory example: what the agent wrote comes back in its prompt, inside a nonce block.
        support = {"Authorization": f"Bearer {first_keys['tenants/support-bot-key']}", "X-IBEX-Agent-ID": "support-bot"}
        fact = "The customer prefers email over phone calls."
        async with ClientSession() as http, http.post(dev.url + "/v1/memories", json={"content": fact},
                                                       headers=support) as r:  # fmt: skip
            assert r.status == 201, await r.text()
        question = [{"role": "user", "content": "How should we contact the customer?"}]

        def chat_with_memory(token: str, agent: str) -> tuple[str, dict[str, str]]:
            with OpenAI(base_url=dev.url + "/v1", api_key=token, max_retries=0,
                        default_headers={"X-IBEX-Agent-ID": agent}) as ai:  # fmt: skip
                raw = ai.chat.completions.with_raw_response.create(model="echo", messages=question)  # type: ignore[arg-type]
                return raw.parse().choices[0].message.content or "", dict(raw.headers)

        echoed, headers = await asyncio.to_thread(
            chat_with_memory, first_keys["tenants/support-bot-key"], "support-bot"
        )
        assert headers["x-ibex-memories-injected"] == "1", headers
        memory_message = json.loads(echoed)[-1]["content"]
        assert re.search(
            r'<memory nonce="[a-p]{16}" id="[0-9a-f-]{36}">' + re.escape(fact) + "</memory>", memory_message
        )
        other, _ = await asyncio.to_thread(chat_with_memory, first_keys["tenants/sales-bot-key"], "sales-bot")
        assert "email over phone" not in other
        issued = await asyncio.to_thread(
            subprocess.run,
            [*IBEX, "keys", "issue", "--data-dir", str(data_dir), "--org", "acme", "--agent", "support-bot",
             "--scopes", "chat"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert issued.returncode == 0, issued.stderr
        fresh_token = json.loads(issued.stdout)["token"]
        assert {"role": "user", "content": "hello"} in await asyncio.to_thread(chat_as, fresh_token)
        pg_port, redis_port = (
            info.postgres_app_dsn.rsplit(":", 1)[1].split("/")[0],
            info.redis_url.split(":")[2].split("/")[0],
        )
    assert dev.proc.returncode == 0, "".join(dev.output)
    assert not port_open(int(pg_port)) and not port_open(int(redis_port)), "stores left running after SIGTERM"
    assert not (data_dir / "postgres" / "data" / "postmaster.pid").exists()

    assert set(first_keys) >= {"tenants/support-bot-key", "tenants/sales-bot-key"}
    assert all(t.startswith("ibex_sk_") for t in first_keys.values())

    with ibex_dev(data_dir, keys_out) as dev:
        info = RuntimeInfo.read(data_dir / "runtime.json")
        assert await org_ids(info) == first_orgs
        second_keys = json.loads(keys_out.read_text())
        assert second_keys == first_keys
        assert [await token_is_valid(info, pepper, t) for t in second_keys.values()] == [True] * len(second_keys)
    assert dev.proc.returncode == 0


def snippet(output: list[str], first: str, last: str) -> str:
    """The lines of ``output`` from the one starting with ``first`` to the next one matching ``last``."""
    start = next(i for i, line in enumerate(output) if line.startswith(first))
    end = next(i for i in range(start, len(output)) if re.fullmatch(last, output[i].rstrip("\n")))
    return "".join(output[start : end + 1])


async def check_the_welcome(dev: IbexProcess, keys: dict[str, str]) -> None:
    """Once ready, `ibex dev` shows each key with what it may do, and a curl command and an SDK snippet that work
    as pasted; the ready line comes last, so everything above it is usable when it appears."""
    assert re.match(r"ibex dev ready in [\d.]+s: http://", dev.output[-1])
    printed = "".join(dev.output)
    assert "  tenants/support-bot-key: " in printed
    assert (
        "    organization acme; acts as support-bot; scopes chat, memory:read, memory:write, memory:delete\n" in printed
    )
    assert "acts as support-bot, research-agent; scopes chat, memory:read, memory:write, memory:delete, usage:read" in (
        printed
    )
    curl = snippet(dev.output, "curl -s ", r".*'")
    done = await asyncio.to_thread(
        subprocess.run, ["bash", "-c", curl], capture_output=True, text=True, timeout=60
    )  # fmt: skip
    assert done.returncode == 0, (curl, done.stderr)
    seen = json.loads(json.loads(done.stdout)["choices"][0]["message"]["content"])
    assert seen[-1] == {"role": "user", "content": "Hello"} and any(t in curl for t in keys.values())
    sdk = snippet(dev.output, sys.executable + " - <<'PY'", "PY")
    done = await asyncio.to_thread(
        subprocess.run, ["bash", "-c", sdk], capture_output=True, text=True, timeout=120
    )  # fmt: skip
    assert done.returncode == 0, (sdk, done.stderr)
    assert {"role": "user", "content": "Hello"} in json.loads(done.stdout)


def test_ibex_dev_refuses_an_invalid_manifest_naming_file_resource_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "manifests"
    bad.mkdir()
    (bad / "broken.yaml").write_text(
        "apiVersion: ibex.dev/v1alpha1\nkind: Agent\nmetadata: {name: bot, namespace: t}\n"
        "spec: {organizationRef: {name: acme}, limits: {requestsPerMinute: 0}}\n"
    )
    done = subprocess.run(
        [*IBEX, "dev", "--data-dir", str(tmp_path / "data"), "--port", "0", "--manifests", str(bad)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "broken.yaml" in done.stderr and "Agent t/bot" in done.stderr
    assert "spec.limits.requestsPerMinute" in done.stderr
    assert not (tmp_path / "data" / "runtime.json").exists()


@pytest.mark.parametrize("flag", ["--help"])
def test_ibex_cli_documents_the_dev_flags(flag: str) -> None:
    done = subprocess.run([*IBEX, "dev", flag], capture_output=True, text=True, timeout=60)
    for option in ("--manifests", "--data-dir", "--host", "--port", "--keys-out"):
        assert option in done.stdout


@contextmanager
def stage(command: str, data_dir: Path, env: dict[str, str]) -> Iterator[str]:
    """Run `ibex <command>` attached to `ibex dev`'s stores; yields its URL and checks it stops cleanly."""
    with ibex_process([command, "--data-dir", str(data_dir), "--port", "0"], env) as running:
        yield running.url
    assert running.proc.returncode == 0, f"ibex {command} exited with {running.proc.returncode}"


@contextmanager
def context_stage(env: dict[str, str]) -> Iterator[tuple[str, str]]:
    """Run `ibex context` (gRPC, no stores of its own); yields its host:port and the URL of its health listener,
    and checks it stops cleanly."""
    with ibex_process(["context", "--port", "0", "--health-port", "0"], env, ready=r"ready: grpc://(\S+)") as running:
        health = re.search(r"\(health (http://[^\s)]+)\)", running.output[-1])
        assert health is not None, running.output[-1]
        yield running.url, health.group(1)
    assert running.proc.returncode == 0, f"ibex context exited with {running.proc.returncode}"


async def frozen_objects(http: ClientSession, url: str, prefix: str) -> float:
    """``ibex_<prefix>_gc_frozen_objects`` on the /metrics of the stage at ``url``."""
    async with http.get(url + "/metrics") as r:
        assert r.status == 200, await r.text()
        text = await r.text()
    found = re.search(rf"^ibex_{prefix}_gc_frozen_objects (\S+)$", text, re.MULTILINE)
    assert found is not None, f"no ibex_{prefix}_gc_frozen_objects at {url}"
    return float(found.group(1))


def refused(args: list[str], env: dict[str, str]) -> str:
    """`ibex <args>` must stop at once with exit code 2; returns what it said."""
    done = subprocess.run([*IBEX, *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, (args, done.returncode, done.stdout, done.stderr)
    return done.stderr


async def test_stages_run_as_separate_processes_over_ibex_devs_stores(scratch: Path) -> None:
    """`ibex memory`, `ibex context` and `ibex proxy` alone (as the chart's containers run them), wired by URL and
    shared secret: a memory written through the proxy reaches the next chat's prompt. Beside `ibex dev` the extra
    proxy needs a ClickHouse of its own (chdb opens in one process): without one it refuses to start, like
    `ibex migrate` and a second `ibex dev` on the same data dir, each saying what to do instead."""
    data_dir = scratch / "data"
    env = {**os.environ, **UNHURRIED, "IBEX_INTERNAL_SECRET": "s" * 32, "IBEX_LOG_LEVEL": "WARNING"}
    with ibex_dev(data_dir, scratch / "keys.json") as dev:
        lock = json.loads((data_dir / "runtime.lock").read_text())
        assert lock == {"pid": dev.proc.pid, "url": dev.url}
        said = refused(["migrate"], {**env, "IBEX_DATA_DIR": str(data_dir)})
        assert "applied every pending migration when it started" in said and f"serving {dev.url}" in said
        said = refused(["proxy", "--data-dir", str(data_dir), "--port", "0"], env)
        assert "could never become ready" in said and "IBEX_CLICKHOUSE_URL" in said
        said = refused(["dev", "--data-dir", str(data_dir), "--port", "0"], env)
        assert f"is already running on {data_dir}" in said
        assert (data_dir / "runtime.json").exists() and json.loads((data_dir / "runtime.lock").read_text()) == lock

        token = json.loads((scratch / "keys.json").read_text())["tenants/support-bot-key"]
        headers = {"Authorization": f"Bearer {token}", "X-IBEX-Agent-ID": "support-bot"}
        own_clickhouse = {"IBEX_CLICKHOUSE_URL": f"chdb://{scratch / 'proxy-clickhouse'}"}
        with (
            stage("memory", data_dir, env) as memory_url,
            context_stage({**env, "IBEX_MEMORY_URL": memory_url}) as (context_url, context_health),
            stage(
                "proxy",
                data_dir,
                {**env, **own_clickhouse, "IBEX_MEMORY_URL": memory_url, "IBEX_CONTEXT_URL": context_url},
            ) as proxy_url,
        ):
            async with ClientSession() as http:
                async with http.get(proxy_url + "/readyz") as r:
                    assert r.status == 200, await r.text()
                body = {"content": "The customer prefers e-mail over phone calls."}
                async with http.post(proxy_url + "/v1/memories", json=body, headers=headers) as r:
                    assert r.status == 201, await r.text()
                    created = (await r.json())["memory"]["id"]
                async with http.get(proxy_url + f"/v1/memories/{created}", headers=headers) as r:
                    assert r.status == 200, await r.text()
                question = {"model": "echo", "messages": [{"role": "user", "content": "How do we reach the customer?"}]}
                async with http.post(proxy_url + "/v1/chat/completions", json=question, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-IBEX-Memories-Injected"] == "1"
                    echoed = json.loads((await r.json())["choices"][0]["message"]["content"])
                assert f'id="{created}">The customer prefers e-mail over phone calls.</memory>' in echoed[-1]["content"]
                # Every serving process froze the heap it built while starting (runtime/heap.py), `ibex dev` too.
                for prefix, url in (("proxy", proxy_url), ("memory", memory_url), ("context", context_health),
                                    ("proxy", dev.url)):  # fmt: skip
                    assert await frozen_objects(http, url, prefix) > 10_000, (prefix, url)


@contextmanager
def cpu_load(processes: int = 2) -> Iterator[None]:
    """Busy processes on every core, as on a loaded CI machine."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


async def test_ready_means_ready_even_on_a_loaded_machine(scratch: Path) -> None:
    with cpu_load(), ibex_dev(scratch / "data", scratch / "keys.json") as dev:
        async with ClientSession() as http, http.get(dev.url + "/readyz") as r:
            body = await r.json()
        assert (r.status, body["checks"]) == (200, {"postgres": "ok", "redis": "ok", "clickhouse": "ok"}), body


CAPTURE_MANIFESTS = """\
apiVersion: ibex.dev/v1alpha1
kind: Organization
metadata: {name: diary, namespace: tenants}
spec: {models: {default: echo}}
---
apiVersion: ibex.dev/v1alpha1
kind: Organization
metadata: {name: elsewhere, namespace: tenants}
spec: {models: {default: echo}}
"""
for org, agent in (("diary", "diarist"), ("diary", "neighbour"), ("elsewhere", "stranger")):
    CAPTURE_MANIFESTS += f"""---
apiVersion: ibex.dev/v1alpha1
kind: Agent
metadata: {{name: {agent}, namespace: tenants}}
spec: {{organizationRef: {{name: {org}}}, defaultModel: echo, memory: {{capture: turns}}}}
---
apiVersion: ibex.dev/v1alpha1
kind: ApiKey
metadata: {{name: {agent}-key, namespace: tenants}}
spec:
  organizationRef: {{name: {org}}}
  agentRefs: [{{name: {agent}}}]
  scopes: [chat, memory:read, memory:write]
  secretName: {agent}-key
"""


async def test_capture_turns_in_ibex_dev_and_a_killed_memory_stage_loses_no_captured_turn(scratch: Path) -> None:
    """`capture: turns` from a manifest: what the agent was told in one session is in the context of a later one,
    and in no other agent's or org's. The capture queue is drained by a separate `ibex memory` (the dev process's
    own worker is off), killed with SIGKILL while turns are queued: every turn is stored exactly once after a new
    one starts."""
    data_dir, keys_out, manifests = scratch / "data", scratch / "keys.json", scratch / "manifests"
    manifests.mkdir()
    (manifests / "diary.yaml").write_text(CAPTURE_MANIFESTS)
    env = {**os.environ, **UNHURRIED, "IBEX_INTERNAL_SECRET": "s" * 32, "IBEX_LOG_LEVEL": "WARNING"}
    plants = ["tomato", "basil", "fennel", "leek", "chard", "dill", "kale", "okra", "pepper", "squash", "radish"]
    places = ["shed", "pond", "fence", "gate", "well", "oak", "barn", "hedge", "path", "wall", "porch"]
    facts = [
        f"Diary line {i}: today I planted {i + 3} {plant} seedlings by the {place}."
        for i, (plant, place) in enumerate(zip(plants, places, strict=True))
    ]
    with ibex_dev(data_dir, keys_out, manifests, env={"IBEX_MEMORY_CAPTURE_WORKER": "false"}) as dev:
        keys = json.loads(keys_out.read_text())
        info = RuntimeInfo.read(data_dir / "runtime.json")

        def say(agent: str, session: str, text: str) -> tuple[str, dict[str, str]]:
            with OpenAI(base_url=dev.url + "/v1", api_key=keys[f"tenants/{agent}-key"], max_retries=0,
                        default_headers={"X-IBEX-Agent-ID": agent, "X-IBEX-Session-ID": session}) as ai:  # fmt: skip
                raw = ai.chat.completions.with_raw_response.create(
                    model="echo", messages=[{"role": "user", "content": text}]
                )
                return raw.parse().choices[0].message.content or "", dict(raw.headers)

        async def captured_turns() -> list[int]:
            conn = await asyncpg.connect(info.postgres_admin_dsn)
            try:
                rows = await conn.fetch(
                    "SELECT (m.metadata->'capture'->>'turn')::int AS turn FROM memories m JOIN agents a"
                    " ON a.id = m.agent_id WHERE a.name = 'diarist' AND m.source = 'extracted'"
                    " AND m.session_id = 'garden' ORDER BY 1"
                )
                return [r["turn"] for r in rows]
            finally:
                await conn.close()

        async def wait_for(n: int) -> list[int]:
            """The captured turns once there are ``n`` (the worker polls the queue), or what there is at 120 s."""
            deadline = time.monotonic() + 120
            turns = await captured_turns()
            while len(turns) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                turns = await captured_turns()
            return turns

        with ibex_process(["memory", "--data-dir", str(data_dir), "--port", "0"], env) as worker:
            for text in facts[:6]:
                assert (await asyncio.to_thread(say, "diarist", "garden", text))[0]
            assert await wait_for(1), "the memory stage captured nothing"
            worker.proc.kill()  # SIGKILL, whatever it was doing
            worker.proc.wait()
        for text in facts[6:]:  # chats go on while nothing drains the queue
            assert (await asyncio.to_thread(say, "diarist", "garden", text))[0]
        with stage("memory", data_dir, env):
            turns = await wait_for(len(facts))
        assert turns == list(range(1, len(facts) + 1)), turns  # every turn, each exactly once

        echoed, headers = await asyncio.to_thread(say, "diarist", "autumn", "What did I plant by the pond?")
        assert int(headers["x-ibex-memories-injected"]) >= 1 and "basil seedlings by the pond" in echoed
        for agent in ("neighbour", "stranger"):
            echoed, _ = await asyncio.to_thread(say, agent, "autumn", "What did I plant by the pond?")
            assert "seedlings" not in echoed
    assert dev.proc.returncode == 0
