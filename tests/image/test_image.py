"""The container image, built here by `.ci/image` (podman, a base made from Debian's packages, no registry), runs
`ibex dev` as its non-root user on a read-only root file system, becomes ready, and serves a chat through the
official OpenAI SDK with a key it issued from the example tenants it carries."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from ibex_dataplane.runtime.embedded import free_port

REPO = Path(__file__).resolve().parents[2]
IMAGE = "localhost/ibex-harness:test"
BUILD_TIMEOUT_S = 3600  # cold: base file system, every wheel, the build
START_TIMEOUT_S = 600
UID = 10001


def podman_env() -> dict[str, str]:
    """The settings `.ci/podman-env` exports (runc, no default ulimits), for podman calls made from here."""
    done = subprocess.run(
        ["bash", "-c", f'source {REPO / ".ci" / "podman-env"} && printf %s "$CONTAINERS_CONF"'],
        capture_output=True,
        text=True,
        check=True,
    )
    return {**os.environ, "CONTAINERS_CONF": done.stdout}


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=podman_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    log = tmp_path_factory.mktemp("image") / "build.log"
    with log.open("w") as out:
        done = subprocess.run(
            ["bash", str(REPO / ".ci" / "image"), IMAGE],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    if done.returncode != 0:
        pytest.fail(f".ci/image failed (exit {done.returncode}):\n{log.read_text()[-6000:]}", pytrace=False)
    return IMAGE


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Under /tmp itself, owned by the image's user: its embedded Postgres keeps its data there.
    path = Path(tempfile.mkdtemp(prefix="ibex-image-data-"))
    os.chown(path, UID, UID)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_the_image_has_a_non_root_user_the_migrations_and_the_model(image: str) -> None:
    config = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["ibex"]
    probe = (
        "import json, onnxruntime, presidio_analyzer;"
        "from ibex_dataplane.store.migrations import default_migrations_dir as d;"
        "from ibex_dataplane.embedding.onnx import OnnxMiniLMEmbedder;"
        "print(json.dumps({'sql': sorted(p.name for p in (d() / 'postgres').glob('*.sql')),"
        " 'model': OnnxMiniLMEmbedder.from_installed_packages().embed_sync(['ok']).shape[1] == 384}))"
    )
    done = podman(
        "run", "--rm", "--network=none", "--read-only", "--entrypoint", "/opt/ibex/bin/python", image, "-c", probe
    )
    found = json.loads(done.stdout)
    assert found["sql"] == sorted(p.name for p in (REPO / "migrations" / "postgres").glob("*.sql"))
    assert found["model"] is True


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_image_carries_its_sbom_and_installed_exactly_the_locked_packages(image: str) -> None:
    probe = (
        "import json; from importlib import metadata;"
        "print(json.dumps({'installed': [[d.metadata['Name'], d.version] for d in metadata.distributions()],"
        " 'sbom': json.load(open('/opt/ibex/share/sbom.cdx.json'))}))"
    )
    done = podman(
        "run", "--rm", "--network=none", "--read-only", "--entrypoint", "/opt/ibex/bin/python", image, "-c", probe
    )  # fmt: skip
    found = json.loads(done.stdout)
    sbom = found["sbom"]
    root = sbom["metadata"]["component"]
    assert sbom["bomFormat"] == "CycloneDX" and root["name"] == "ibex-harness"
    listed = {(canonical(c["name"]), c["version"]) for c in sbom["components"]}
    installed = {(canonical(name), version) for name, version in found["installed"]}
    installed.discard(("ibex-harness", root["version"]))
    assert installed == listed, (sorted(installed - listed), sorted(listed - installed))
    # each with the hashes pip checked it against
    assert all(any(r.get("hashes") for r in c["externalReferences"]) for c in sbom["components"])


def test_ibex_dev_in_the_image_becomes_ready_and_serves_a_chat(image: str, data_dir: Path) -> None:
    name = f"ibex-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    podman(
        "run", "--detach", "--name", name, "--network=host", "--read-only",
        "--volume", f"{data_dir}:/var/lib/ibex", image, "dev", "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    logs = subprocess.Popen(
        ["podman", "logs", "--follow", name],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=podman_env(),
    )
    seen: list[str] = []
    try:
        assert logs.stdout is not None
        for line in logs.stdout:  # ends when the container stops
            seen.append(line)
            if line.startswith("ibex dev ready in"):
                break
        assert seen and seen[-1].startswith("ibex dev ready in"), "".join(seen)[-4000:]
        assert f"http://127.0.0.1:{port}" in seen[-1]
        assert podman("exec", name, "id", "-u").stdout.strip() == str(UID)

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as resp:
            assert resp.status == 200
            body = json.loads(resp.read())
        assert body["checks"] == {"postgres": "ok", "redis": "ok", "clickhouse": "ok"}

        keys = json.loads((data_dir / "keys.json").read_text())
        with OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key=keys["tenants/support-bot-key"],
            max_retries=0,
            default_headers={"X-IBEX-Agent-ID": "support-bot"},
        ) as ai:
            reply = ai.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hello"}])
        echoed = json.loads(reply.choices[0].message.content or "")
        assert echoed[0]["role"] == "system" and "support assistant for Acme" in echoed[0]["content"]
        assert echoed[-1] == {"role": "user", "content": "hello"}
    finally:
        podman("rm", "--force", "--time", "10", name, check=False, timeout=60)
        logs.wait(timeout=60)
        if logs.stdout is not None:
            logs.stdout.close()
