"""What reusing a streamed answer's upstream connection saves: the first event of each stream, and the client's CPU.

The providers read a stream up to its last event (``[DONE]``); the body's end (the last, empty chunk) follows.
Before commit 59d7769 they released the response there, unread to its end, so its connection was dropped and every
streamed answer opened a new one: a TCP handshake, and for an ``https`` upstream a TLS handshake, ahead of its
first byte. Now :meth:`UpstreamResponse.finish` reads the body's end and the connection serves the next call.

This benchmark measures both with the providers' own client (``providers/transport.py``) against a local upstream
in a process of its own, plain ``http`` and ``https`` (TLS 1.3, a self-signed ECDSA P-256 certificate the client
trusts), that answers every request with a chunked event stream of five events and ``[DONE]``. Side by side, in
alternated rounds: ``reused`` (read to the last event, then ``finish``) and ``new each`` (read to the last event,
then ``release``: the old behaviour). Every answer's status and events are checked. Per variant: the time from
sending the request to the first event (p50, p95) and the client process's CPU per stream. The upstream is on the
same machine, so a remote provider's round trips (one more for TCP, one or two for TLS) come on top of what is
shown. Run: ``.venv/bin/python bench/stream_reuse_bench.py [--streams 500] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from multiprocessing.queues import Queue
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import uvloop  # noqa: E402

from ibex_dataplane.providers.transport import UpstreamClient  # noqa: E402
from tests.support.tls import self_signed_certificate  # noqa: E402

EVENTS = [b'data: {"choices": [{"delta": {"content": "%d"}}]}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
BODY = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def upstream(folder: str, tls: bool, ports: Queue[int]) -> None:
    """The upstream process: every request of a connection answered with the stream, until the client closes."""

    async def main() -> None:
        context = None
        if tls:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(Path(folder) / "cert.pem", Path(folder) / "key.pem")

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                    await reader.readexactly(length)
                    writer.write(HEAD + BODY)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
        ports.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    uvloop.run(main())


async def streams(url: str, trust: ssl.SSLContext | None, end: str, n: int) -> tuple[list[float], float]:
    """``n`` streams one after another (after 20 unmeasured): ms to the first event each, and CPU us per stream."""
    client = UpstreamClient(ssl_context=trust)
    firsts: list[float] = []
    cpu = 0.0
    try:
        for i in range(n + 20):
            c0, t0 = time.process_time(), time.perf_counter()
            response = await client.post(url, b'{"stream": true}', {"Content-Type": "application/json"})
            if response.status != 200:
                raise SystemExit(f"the upstream answered {response.status}")
            received = await response.read_some()
            t1 = time.perf_counter()
            while b"data: [DONE]\n\n" not in received:
                piece = await response.read_some()
                if not piece:
                    raise SystemExit("the stream ended before its last event")
                received += piece
            if end == "finish":
                await response.finish()
            else:
                response.release()
            if received != b"".join(EVENTS):
                raise SystemExit("the stream's events are not what the upstream sent")
            if i >= 20:
                firsts.append((t1 - t0) * 1000)
                cpu += time.process_time() - c0
    finally:
        await client.close()
    return firsts, cpu / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=500, help="streams per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    print(f"commit {commit.stdout.strip()}; python {sys.version.split()[0]}; {ssl.OPENSSL_VERSION}; "
          f"uvloop {version('uvloop')}; cores {os.cpu_count()}; load average before {os.getloadavg()}")  # fmt: skip
    print(
        f"{args.streams} streams per variant and round, one after another, {args.rounds} rounds alternated; "
        "ms from the request to the first event; the client process's CPU per stream"
    )
    folder = tempfile.mkdtemp(prefix="ibex-stream-reuse-")
    cert, _ = self_signed_certificate(Path(folder))
    for scheme in ("http", "https"):
        ports: Queue[int] = multiprocessing.get_context("spawn").Queue()
        proc = multiprocessing.get_context("spawn").Process(target=upstream, args=(folder, scheme == "https", ports))
        proc.start()
        try:
            url = f"{scheme}://127.0.0.1:{ports.get(timeout=30)}/v1/chat/completions"
            trust = ssl.create_default_context(cafile=str(cert)) if scheme == "https" else None
            results: dict[str, list[tuple[float, float, float]]] = {"reused": [], "new each": []}
            for _ in range(args.rounds):
                for label, end in (("new each", "release"), ("reused", "finish")):
                    firsts, cpu = uvloop.run(streams(url, trust, end, args.streams))
                    firsts.sort()
                    results[label].append((statistics.median(firsts), firsts[int(0.95 * len(firsts))], cpu))
            for label, rows in results.items():
                spread = "  ".join(f"{p50:.3f} / {p95:.3f} ms, {cpu:5.0f} us" for p50, p95, cpu in rows)
                print(f"{scheme:<5} {label:<8}  first event p50 / p95, CPU per stream, by round:  {spread}")
            ratio = statistics.median(r[0] for r in results["reused"]) / statistics.median(
                r[0] for r in results["new each"]
            )
            print(f"{scheme:<5} first event p50, reused / new each (medians of the rounds): {ratio:.2f}")
        finally:
            proc.terminate()
            proc.join()
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
