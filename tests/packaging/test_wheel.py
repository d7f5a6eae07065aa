"""The built wheel carries the migrations and an installed `ibex migrate` applies them, with no source tree around.

The wheel is built from a copy of the sources, installed without dependencies into a fresh virtual environment
whose only link to the test environment is a ``.pth`` line naming its site-packages (so the third-party
dependencies are not downloaded again), and run from a folder outside the repository with no
``IBEX_MIGRATIONS_DIR`` and no ``PYTHONPATH``: the migrations it applies can only come from the wheel.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from ibex_dataplane.runtime.embedded import ADMIN_ROLE, APP_ROLE, EmbeddedPostgres
from ibex_dataplane.store.migrations import discover

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "dataplane", "operator", "migrations")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("ibex_harness-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # The test environment's packages, appended after the venv's own site-packages (a plain path line: the .pth
    # files there, such as an editable install of this repository, are not processed).
    Path(purelib, "test-environment-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return env_dir


@pytest.fixture
def fresh_postgres() -> Iterator[EmbeddedPostgres]:
    # Under /tmp itself: as root, Postgres runs as an unprivileged user that must reach its data directory.
    root = Path(tempfile.mkdtemp(prefix="ibex-wheel-pg-"))
    server = EmbeddedPostgres(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_") and k != "PYTHONPATH"}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def test_wheel_ships_every_migration(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for kind in ("postgres", "clickhouse"):
        expected = {f"ibex_dataplane/migrations/{kind}/{p.name}" for p in (REPO / "migrations" / kind).glob("*.sql")}
        assert expected, f"no {kind} migrations in the repository"
        assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"


def test_installed_package_resolves_its_own_migrations(venv: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import ibex_dataplane; from ibex_dataplane.store.migrations import default_migrations_dir as d;"
            " print(ibex_dataplane.__file__); print(d())",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(),
    )
    package_file, folder = done.stdout.split()
    assert Path(package_file).is_relative_to(venv), f"ibex_dataplane imported from {package_file}, not the wheel"
    assert Path(folder).is_relative_to(venv)
    assert Path(folder, "postgres", "0001_core.sql").is_file()


async def applied_versions(dsn: str) -> tuple[list[int], bool]:
    conn = await asyncpg.connect(dsn)
    try:
        applied = [r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations ORDER BY 1")]
        memories = await conn.fetchval("SELECT to_regclass('public.memories') IS NOT NULL")
    finally:
        await conn.close()
    return applied, bool(memories)


def test_installed_ibex_migrate_applies_the_packaged_migrations(
    venv: Path, fresh_postgres: EmbeddedPostgres, tmp_path: Path
) -> None:
    env = clean_env(
        IBEX_POSTGRES_DSN=fresh_postgres.dsn(APP_ROLE),
        IBEX_POSTGRES_ADMIN_DSN=fresh_postgres.dsn(ADMIN_ROLE),
        IBEX_REDIS_URL="redis://127.0.0.1:1/0",  # not contacted by migrate
        IBEX_CLICKHOUSE_URL=f"chdb://{tmp_path / 'clickhouse'}",
    )
    done = subprocess.run(
        [str(venv / "bin" / "ibex"), "migrate"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "migrations applied" in done.stdout
    applied, memories = asyncio.run(applied_versions(fresh_postgres.dsn(ADMIN_ROLE)))
    assert applied == [m.version for m in discover(REPO / "migrations" / "postgres")]
    assert memories
    # A second run applies nothing and still succeeds (the recorded checksums match the packaged files).
    again = subprocess.run(
        [str(venv / "bin" / "ibex"), "migrate"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert again.returncode == 0, again.stderr
