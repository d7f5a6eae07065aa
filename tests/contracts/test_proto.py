"""The committed gRPC stubs are exactly what proto/generate.sh produces from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "dataplane" / "ibex_dataplane" / "proto_gen"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "proto" / "generate.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = _files(tmp_path / "ibex_dataplane" / "proto_gen")
    committed = {k: v for k, v in _files(STUBS).items() if "__pycache__" not in k}
    assert fresh, "generation produced nothing"
    assert sorted(fresh) == sorted(committed), "stub files differ: run proto/generate.sh and commit"
    drifted = [name for name in fresh if fresh[name] != committed[name]]
    assert not drifted, f"stale stubs: {drifted}; run proto/generate.sh and commit"


def test_the_context_service_is_served_under_its_contract_name() -> None:
    from ibex_dataplane.proto_gen.ibex.context.v1 import context_pb2

    service = context_pb2.DESCRIPTOR.services_by_name["ContextAssembly"]
    assert service.full_name == "ibex.context.v1.ContextAssembly"
    assert [m.name for m in service.methods] == ["Assemble"]
