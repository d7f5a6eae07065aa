"""How many workers `ibex proxy` starts by default, and who may use the engine its supervisor serves."""

from __future__ import annotations

import os
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from ibex_dataplane.proxy.metrics import ProxyMetrics
from ibex_dataplane.runtime.workers import cgroup_cpu_limit, usable_cpus
from ibex_dataplane.store.clickhouse import EngineAddress, EngineServer


def test_a_cgroup_v2_quota_caps_the_default_worker_count(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    assert usable_cpus(tmp_path) == min(len(os.sched_getaffinity(0)), 2)


def test_a_cgroup_v1_quota_is_read_too_and_no_quota_means_the_affinity(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.0 and usable_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    assert usable_cpus(tmp_path) == len(os.sched_getaffinity(0))


def test_the_engine_server_refuses_a_peer_without_its_key(tmp_path: Path) -> None:
    address = EngineAddress(str(tmp_path / "engine.sock"), b"k" * 32)
    server = EngineServer(f"chdb://{tmp_path / 'never-opened'}", address)
    server.start()
    try:
        with pytest.raises(AuthenticationError):
            Client(address.path, family="AF_UNIX", authkey=b"x" * 32)
    finally:
        server.close()


def test_a_single_process_proxy_exports_no_per_worker_series_and_refuses_a_multiprocess_dir(tmp_path: Path) -> None:
    metrics = ProxyMetrics()
    assert metrics.worker_requests is None and b"ibex_proxy_worker_requests" not in metrics.render()
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        ProxyMetrics(tmp_path)  # this process did not start in multiprocess mode
