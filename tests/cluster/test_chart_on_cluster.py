"""End to end on a cluster that runs pods (tests/cluster/cluster.sh: kubelet + containerd + CNI + scheduler, all
built or installed from Debian's packages): `helm install` of the chart with the image built by `.ci/image`, the
operator and data-plane pods Ready through their real probes (on an empty Postgres, without a single data-plane
restart: the pod waits for the operator's migrations in its init container), the example tenants applied with
kubectl, their key Secret written by the operator in the cluster, and a client outside the cluster (the official
OpenAI SDK through `kubectl port-forward` to the proxy Service) that writes a memory and sees it in its next chat;
then the Agent's deletion, an upgrade that rolls the pods without losing keys, and an uninstall that leaves only
the CRDs and the user's Secret.

The stores run on this host, listening on the pod network's gateway: Postgres (with pgvector) and Valkey, as the
embedded ones of the test suite. ClickHouse has no server here (Debian's is from 2018 and the client cannot speak
to it), so each IBEX container uses an in-process chdb engine on its own emptyDir path.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml

from ibex_dataplane.runtime.embedded import (
    ADMIN_ROLE,
    APP_ROLE,
    EmbeddedPostgres,
    _wait_for_port,
    free_port,
    valkey_binary,
)
from tests.cluster import smoke
from tests.operator.conftest import _read_env_file

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "tests" / "cluster" / "cluster.sh"
CHART = REPO / "charts" / "ibex"
IMAGE_REPO, IMAGE_TAG = "localhost/ibex-harness", "e2e"
SUBNET = "10.244.0.0/24"
NS, RELEASE = "ibex-system", "ibex"
START_TIMEOUT_S = 3600  # cold: the node binaries are compiled from source
ROLLOUT_TIMEOUT_S = 900
# As in tests/e2e: functional tests must not depend on how loaded the machine is, so the context deadlines are raised
# (their behaviour has integration tests of its own); with the defaults a busy node degrades to no memories.
UNHURRIED = [
    {"name": name, "value": value}
    for name, value in {
        "IBEX_CONTEXT_DEADLINE_MS": "5000", "IBEX_CONTEXT_HOT_MS": "5000", "IBEX_CONTEXT_COLD_MS": "5000",
        "IBEX_CONTEXT_TIMEOUT_MS": "8000",
    }.items()
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Cluster:
    rundir: Path
    kubeconfig: Path
    bin_dir: Path
    gateway: str

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": f"{self.bin_dir}:{os.environ['PATH']}"}

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.bin_dir / "kubectl"), *args], capture_output=True, text=True, timeout=timeout, env=self.env()
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.bin_dir / "helm"), *args], capture_output=True, text=True, timeout=timeout, env=self.env()
        )
        if proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def diagnostics(self) -> str:
        out = [self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout]
        out.append(self.kubectl("-n", NS, "describe", "pods", check=False).stdout[-6000:])
        for pod in self.kubectl("-n", NS, "get", "pods", "-o", "name", check=False).stdout.split():
            out.append(self.kubectl("-n", NS, "logs", pod, "--all-containers", "--tail=40", check=False).stdout)
        kubelet_log = self.rundir / "kubelet.log"
        if kubelet_log.exists():
            out.append(kubelet_log.read_text()[-4000:])
        return "\n".join(out)


def _script(*args: str, timeout: float, log: Path) -> int:
    with log.open("w") as out:
        done = subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
    return done.returncode


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Under /tmp itself with a short name: containerd's socket path must stay under 108 bytes.
    rundir = Path(tempfile.mkdtemp(prefix="ibex-cl-"))
    log = rundir.with_suffix(".start.log")
    try:
        if _script("start", str(rundir), timeout=START_TIMEOUT_S, log=log) != 0:
            pytest.fail(f"cluster.sh start failed:\n{log.read_text()[-8000:]}", pytrace=False)
        env = _read_env_file(rundir / "cluster.env")
        yield Cluster(rundir, Path(env["KUBECONFIG"]), Path(env["IBEX_K8S_BIN_DIR"]), env["IBEX_CLUSTER_GATEWAY"])
    finally:
        stop_log = rundir.with_suffix(".stop.log")
        code = _script("stop", str(rundir), timeout=300, log=stop_log)
        shutil.rmtree(rundir, ignore_errors=True)
        log.unlink(missing_ok=True)
        if code != 0:
            raise RuntimeError(f"cluster.sh stop failed:\n{stop_log.read_text()[-4000:]}")
        stop_log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def image(cluster: Cluster) -> str:
    name = f"{IMAGE_REPO}:{IMAGE_TAG}"
    log = cluster.rundir / "image.log"
    with log.open("w") as out:
        built = subprocess.run(
            ["bash", str(REPO / ".ci" / "image"), name], stdout=out, stderr=subprocess.STDOUT, timeout=3600, check=False
        )
    if built.returncode != 0:
        pytest.fail(f".ci/image failed:\n{log.read_text()[-6000:]}", pytrace=False)
    if _script("load", str(cluster.rundir), name, timeout=600, log=log) != 0:
        pytest.fail(f"loading the image into containerd failed:\n{log.read_text()[-4000:]}", pytrace=False)
    return name


@dataclasses.dataclass(frozen=True)
class GatewayStores:
    postgres: EmbeddedPostgres
    app_dsn: str
    admin_dsn: str
    redis_url: str
    local_admin_dsn: str


@pytest.fixture(scope="module")
def stores(cluster: Cluster) -> Iterator[GatewayStores]:
    """Postgres and Valkey on this host, reachable from pods at the gateway address."""
    root = Path(tempfile.mkdtemp(prefix="ibex-cl-stores-"))
    postgres = EmbeddedPostgres(root / "postgres")
    postgres.start()
    valkey: subprocess.Popen[bytes] | None = None
    try:
        with (postgres.pgdata / "postgresql.conf").open("a") as conf:
            conf.write(f"listen_addresses = '127.0.0.1,{cluster.gateway}'\n")
        with (postgres.pgdata / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {SUBNET} scram-sha-256\n")
        port = postgres.port
        postgres.stop()
        postgres.start(port=port)
        redis_port = free_port()
        valkey = subprocess.Popen(
            [str(valkey_binary()), "--bind", f"127.0.0.1 {cluster.gateway}", "--port", str(redis_port),
             "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_for_port(redis_port, 30, "valkey-server", valkey)

        def at_gateway(dsn: str) -> str:
            return dsn.replace("@127.0.0.1:", f"@{cluster.gateway}:")

        yield GatewayStores(
            postgres,
            at_gateway(postgres.dsn(APP_ROLE)),
            at_gateway(postgres.dsn(ADMIN_ROLE)),
            f"redis://{cluster.gateway}:{redis_port}/0",
            postgres.dsn(ADMIN_ROLE),
        )
    finally:
        if valkey is not None:
            valkey.terminate()
            valkey.wait(timeout=30)
        postgres.stop()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def port_forward(cluster: Cluster, target: str, remote_port: int) -> Iterator[str]:
    local = free_port()
    proc = subprocess.Popen(
        [str(cluster.bin_dir / "kubectl"), "-n", NS, "port-forward", target, f"{local}:{remote_port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cluster.env(),
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> ..." once it listens
        assert first.startswith("Forwarding from"), first + proc.stdout.read()
        yield f"http://127.0.0.1:{local}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def rollout(cluster: Cluster, deployment: str) -> None:
    done = cluster.kubectl(
        "-n", NS, "rollout", "status", f"deployment/{deployment}", f"--timeout={ROLLOUT_TIMEOUT_S}s",
        check=False, timeout=ROLLOUT_TIMEOUT_S + 30,
    )  # fmt: skip
    assert done.returncode == 0, f"{deployment} did not roll out:\n{done.stderr}\n{cluster.diagnostics()}"


def pods(cluster: Cluster) -> dict[str, dict[str, Any]]:
    items = json.loads(cluster.kubectl("-n", NS, "get", "pods", "-o", "json").stdout)["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


async def agent_rows(admin_dsn: str, agent_name: str) -> int:
    conn = await asyncpg.connect(admin_dsn)
    try:
        agent_id = await conn.fetchval("SELECT id FROM agents WHERE name = $1", agent_name)
        if agent_id is None:
            return 0
        return int(await conn.fetchval("SELECT count(*) FROM memories WHERE agent_id = $1", agent_id))
    finally:
        await conn.close()


def test_helm_install_on_a_cluster_that_runs_pods(cluster: Cluster, image: str, stores: GatewayStores) -> None:
    pepper = secrets.token_urlsafe(36)
    cluster.kubectl("create", "namespace", NS)
    # The watched namespace exists before the install: the operator's Role is created in it.
    cluster.kubectl("apply", "-f", str(REPO / "examples" / "tenants" / "00-namespace.yaml"))
    cluster.kubectl(
        "-n", NS, "create", "secret", "generic", "ibex-keys", f"--from-literal=key-pepper={pepper}",
        f"--from-literal=internal-secret={secrets.token_urlsafe(36)}",
    )  # fmt: skip

    def chdb(name: str) -> list[dict[str, str]]:
        return [{"name": "IBEX_CLICKHOUSE_URL", "value": f"chdb:///tmp/clickhouse-{name}"}]

    values = {
        "image": {"repository": IMAGE_REPO, "tag": IMAGE_TAG, "pullPolicy": "Never"},
        "secrets": {"keyPepper": {"existingSecret": "ibex-keys"}, "internalSecret": {"existingSecret": "ibex-keys"}},
        "stores": {
            "postgres": {"dsn": stores.app_dsn, "adminDsn": stores.admin_dsn},
            "redis": {"url": stores.redis_url},
            "clickhouse": {"url": "chdb:///tmp/clickhouse-proxy"},
        },
        "operator": {"replicas": 1, "watchNamespaces": ["tenants"]},
        "dataPlane": {
            "replicas": 1,
            "proxy": {"env": UNHURRIED},
            "memory": {"env": chdb("memory")},
            "context": {"env": chdb("context") + UNHURRIED},
            "pdb": {"enabled": False},
        },
    }
    values_file = cluster.rundir / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    cluster.helm("install", RELEASE, str(CHART), "--namespace", NS, "-f", str(values_file))
    try:
        rollout(cluster, "ibex-operator")
        rollout(cluster, "ibex-dataplane")
        running = pods(cluster)
        assert len(running) == 2, list(running)
        for pod in running.values():
            statuses = pod["status"]["containerStatuses"]
            assert all(s["ready"] and s["image"].endswith(f"{IMAGE_REPO}:{IMAGE_TAG}") for s in statuses), statuses
        # A first install: the Postgres is empty until the operator's leader migrates it. The data-plane pod waited
        # for the schema in its init container; none of its containers restarted.
        (data_plane,) = [p for p in running.values() if p["metadata"]["labels"].get("app.kubernetes.io/component")
                         == "dataplane"]  # fmt: skip
        (waited,) = data_plane["status"]["initContainerStatuses"]
        assert waited["state"]["terminated"]["exitCode"] == 0 and waited["restartCount"] == 0, waited
        restarts = {s["name"]: s["restartCount"] for s in data_plane["status"]["containerStatuses"]}
        assert restarts == {"proxy": 0, "memory": 0, "context": 0}, cluster.diagnostics()

        cluster.kubectl("apply", "-f", str(REPO / "examples" / "tenants"))
        cluster.kubectl(
            "-n", "tenants", "wait", "--for=condition=Ready", "apikey/support-bot-key",
            "directive/support-bot-directive", "--timeout=300s", timeout=330,
        )  # fmt: skip
        token = base64.b64decode(
            cluster.kubectl("-n", "tenants", "get", "secret", "support-bot-key", "-o", "jsonpath={.data.token}").stdout
        ).decode()
        assert token

        with port_forward(cluster, "service/ibex-dataplane", 80) as proxy:
            smoke.first_chat_and_memory(proxy, token)  # what examples/kind/kind.sh runs too

        # An upgrade with a changed value rolls the data-plane pods; the key keeps working.
        before = set(pods(cluster))
        cluster.helm(
            "upgrade", RELEASE, str(CHART), "--namespace", NS, "-f", str(values_file), "--set", "logLevel=DEBUG"
        )
        rollout(cluster, "ibex-dataplane")
        rollout(cluster, "ibex-operator")
        assert not before & set(pods(cluster)), "the pods did not roll"
        with port_forward(cluster, "service/ibex-dataplane", 80) as proxy:
            assert smoke.recalled(proxy, token)

        # Deleting the Agent removes its data (its memories here, in the host's Postgres).
        assert asyncio.run(agent_rows(stores.local_admin_dsn, "support-bot")) >= 1
        cluster.kubectl("-n", "tenants", "delete", "agent", "support-bot", "--timeout=300s", timeout=330)
        assert asyncio.run(agent_rows(stores.local_admin_dsn, "support-bot")) == 0
    finally:
        # The tenant resources first, while the operator (and its Role in the namespace) can still run their
        # finalizers; the namespace stays until then.
        cluster.kubectl("-n", "tenants", "delete", "apikeys,directives,agents,organizations", "--all",
                        "--timeout=300s", check=False, timeout=330)  # fmt: skip
        cluster.helm("uninstall", RELEASE, "--namespace", NS, "--wait=watcher", "--timeout=5m", timeout=360)
    # Nothing of the release is left but the CRDs (kept on purpose) and the Secret the user made. Its pods end
    # after their grace period, which `helm uninstall --wait` does not cover.
    cluster.kubectl("-n", NS, "wait", "--for=delete", "pod", "--all", "--timeout=180s", timeout=200)
    left = cluster.kubectl("-n", NS, "get", "all,configmaps,secrets,roles,rolebindings,networkpolicies,serviceaccounts",
                           "-o", "name").stdout.split()  # fmt: skip
    # (kube-root-ca.crt and the default ServiceAccount are made by the controller-manager in every namespace)
    ours = [r for r in left if "default" not in r and r not in ("secret/ibex-keys", "configmap/kube-root-ca.crt")]
    assert ours == []
    cluster_wide = cluster.kubectl("get", "clusterroles,clusterrolebindings", "-o", "name").stdout.split()
    assert [r for r in cluster_wide if "ibex" in r] == []
    assert len(cluster.kubectl("get", "crd", "-o", "name").stdout.split()) == 4
