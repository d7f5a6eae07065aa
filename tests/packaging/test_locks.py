"""The hash-pinned locks (requirements/) cover every declared dependency, agree with each other and with what is
installed: CI and the image install from them with ``--require-hashes``, so a gap here is an install failure."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCKS = REPO / "requirements"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def pins(name: str) -> dict[str, tuple[str, int]]:
    """Package -> (version, number of hashes) of one lock file."""
    out: dict[str, tuple[str, int]] = {}
    current: str | None = None
    for line in (LOCKS / name).read_text().splitlines():
        m = PIN.match(line)
        if m:
            current = canonicalize_name(m.group(1))
            assert current not in out, f"{name} pins {current} twice"
            out[current] = (m.group(2), 0)
        elif current is not None and line.strip().startswith("--hash=sha256:"):
            version, hashes = out[current]
            out[current] = (version, hashes + 1)
        elif line.strip() and not line.lstrip().startswith("#") and not line.startswith("    "):
            raise AssertionError(f"{name}: unexpected line {line!r}")
    return out


def declared(extra: str | None = None) -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_every_declared_dependency_is_pinned_with_hashes() -> None:
    runtime, dev = pins("runtime.lock"), pins("dev.lock")
    assert declared() <= set(runtime), sorted(declared() - set(runtime))
    assert declared("dev") <= set(dev), sorted(declared("dev") - set(dev))
    for name in ("bootstrap.lock", "runtime.lock", "dev.lock", "models.lock"):
        unhashed = [p for p, (_, hashes) in pins(name).items() if hashes == 0]
        assert not unhashed, f"{name}: no hash for {unhashed}"


def test_the_image_gets_the_same_versions_as_ci() -> None:
    runtime, dev = pins("runtime.lock"), pins("dev.lock")
    assert set(runtime) <= set(dev), sorted(set(runtime) - set(dev))
    differing = {p: (runtime[p][0], dev[p][0]) for p in runtime if runtime[p][0] != dev[p][0]}
    assert not differing, differing
    assert not set(pins("models.lock")) & set(dev)  # installed apart, without dependencies


def test_the_environment_is_the_locked_one() -> None:
    locked = {**pins("dev.lock"), **pins("models.lock"), **pins("bootstrap.lock")}
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    wrong = {p: (v, installed.get(p)) for p, (v, _) in locked.items() if installed.get(p) != v}
    assert not wrong, wrong
    extra = set(installed) - set(locked) - {"ibex-harness"}
    assert not extra, f"installed but not locked: {sorted(extra)}"
