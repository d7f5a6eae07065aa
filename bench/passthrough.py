"""A bare pass-through proxy, the floor a proxy on this machine cannot go under: the same HTTP server (aiohttp on
uvloop) and the same upstream client (``providers/transport.py``) as ``ibex``, and nothing else (no key, no gate,
no store, no accounting, no analytics). It forwards the body of ``POST /v1/chat/completions`` to
``<upstream>/chat/completions`` with the upstream key, and answers with the upstream's status and body.

``bench/proxy_overhead.py --bare`` starts it beside the upstream and measures it as the target ``bare``: the
difference between ``bare`` and ``direct`` is what one more hop through a Python process costs, and the difference
between ``ibex`` and ``bare`` is what the protected path adds on top of it.

    python -m bench.passthrough UPSTREAM_URL API_KEY   # prints "passthrough ready: http://127.0.0.1:PORT"
"""

from __future__ import annotations

import asyncio
import sys

import uvloop
from aiohttp import web

from ibex_dataplane.providers.transport import UpstreamClient


def app(upstream: str, api_key: str) -> web.Application:
    client = UpstreamClient()
    target = upstream.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}

    async def forward(request: web.Request) -> web.Response:
        response = await client.post(target, await request.read(), headers)
        try:
            body = await response.read()
        finally:
            response.release()
        return web.Response(status=response.status, body=body, content_type="application/json")

    async def closing(_: web.Application) -> None:
        await client.close()

    application = web.Application()
    application.router.add_post("/v1/chat/completions", forward)
    application.on_cleanup.append(closing)
    return application


async def serve(upstream: str, api_key: str) -> None:
    runner = web.AppRunner(app(upstream, api_key), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(f"passthrough ready: http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    try:
        await asyncio.Event().wait()  # serves until the benchmark stops the process (SIGTERM)
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1], sys.argv[2]))
