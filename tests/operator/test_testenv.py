"""The operator test environment itself: a real kube-apiserver 1.20.2 with a working garbage collector."""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.operator.conftest import KubeApiserver

DEFAULT_NAMESPACES = {"default", "kube-system", "kube-public", "kube-node-lease"}
GC_TIMEOUT_S = 30.0


@pytest.fixture
def namespace(kube_apiserver: KubeApiserver) -> Iterator[str]:
    name = f"testenv-{uuid.uuid4().hex[:8]}"
    kube_apiserver.kubectl("create", "namespace", name)
    yield name
    kube_apiserver.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def test_apiserver_answers_kubectl(kube_apiserver: KubeApiserver) -> None:
    assert kube_apiserver.server.startswith("https://127.0.0.1:")

    version = json.loads(kube_apiserver.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.20.2"
    assert version["clientVersion"]["gitVersion"].startswith("v1.")

    namespaces = json.loads(kube_apiserver.kubectl("get", "namespaces", "-o", "json").stdout)
    names = {item["metadata"]["name"] for item in namespaces["items"]}
    assert names >= DEFAULT_NAMESPACES
    phases = {item["metadata"]["name"]: item["status"]["phase"] for item in namespaces["items"]}
    assert all(phases[name] == "Active" for name in DEFAULT_NAMESPACES)

    # token auth is on: the fixture's token is accepted (and is cluster admin), a wrong one is refused
    refused = kube_apiserver.kubectl("--token", "not-the-token", "get", "namespaces", check=False)
    assert refused.returncode != 0
    assert "Unauthorized" in refused.stderr or "must be logged in" in refused.stderr
    allowed = kube_apiserver.kubectl("--token", kube_apiserver.token, "auth", "can-i", "create", "namespaces")
    assert allowed.stdout.strip() == "yes"


def test_helm_runs_from_bin_dir(kube_apiserver: KubeApiserver, tmp_path: Path) -> None:
    helm_env = {
        **kube_apiserver.env(),
        "HELM_CACHE_HOME": str(tmp_path / "cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "config"),
        "HELM_DATA_HOME": str(tmp_path / "data"),
    }
    version = subprocess.run(
        [str(kube_apiserver.helm_path), "version", "--short"],
        capture_output=True,
        text=True,
        timeout=60,
        env=helm_env,
        check=True,
    )
    assert re.match(r"^v\d+\.\d+\.\d+", version.stdout.strip()), version.stdout

    # helm talks to the same apiserver through KUBECONFIG
    releases = subprocess.run(
        [str(kube_apiserver.helm_path), "list", "--all-namespaces", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=helm_env,
        check=True,
    )
    assert json.loads(releases.stdout) == []


def _configmap(namespace: str, name: str, owner_uid: str | None = None) -> str:
    metadata: dict[str, object] = {"name": name, "namespace": namespace}
    if owner_uid is not None:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}]
    return json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {"k": name}})


def _exists(kube_apiserver: KubeApiserver, namespace: str, name: str) -> bool:
    out = kube_apiserver.kubectl("-n", namespace, "get", "configmap", name, "--ignore-not-found", "-o", "name").stdout
    return out.strip() == f"configmap/{name}"


def test_garbage_collector_deletes_dependents(kube_apiserver: KubeApiserver, namespace: str) -> None:
    kube_apiserver.kubectl("create", "-f", "-", input=_configmap(namespace, "owner"))
    owner_uid = kube_apiserver.kubectl(
        "-n", namespace, "get", "configmap", "owner", "-o", "jsonpath={.metadata.uid}"
    ).stdout.strip()
    assert owner_uid

    kube_apiserver.kubectl("create", "-f", "-", input=_configmap(namespace, "dependent", owner_uid))
    kube_apiserver.kubectl("create", "-f", "-", input=_configmap(namespace, "bystander"))
    stored = json.loads(kube_apiserver.kubectl("-n", namespace, "get", "configmap", "dependent", "-o", "json").stdout)
    assert [ref["uid"] for ref in stored["metadata"]["ownerReferences"]] == [owner_uid]

    # while its owner exists, the dependent stays
    time.sleep(2)
    assert _exists(kube_apiserver, namespace, "dependent")

    kube_apiserver.kubectl("-n", namespace, "delete", "configmap", "owner", "--cascade=background")
    deadline = time.monotonic() + GC_TIMEOUT_S
    while _exists(kube_apiserver, namespace, "dependent"):
        assert time.monotonic() < deadline, f"dependent still exists {GC_TIMEOUT_S} s after its owner was deleted"
        time.sleep(0.5)

    # only the owned object went away
    assert _exists(kube_apiserver, namespace, "bystander")
