"""Options of one operator process, built once by the CLI (``ibex operator``) and passed down.

Store URLs, the key pepper and log settings come from :class:`ibex_dataplane.settings.Settings` (``IBEX_*``);
these are the operator's own knobs: where the Kubernetes API is, what to watch, leader election and retry timing.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ibex_operator.lease import LeaseTiming


def default_identity() -> str:
    """Unique per process unless the chart passes the pod name (then a restarted container keeps its lease)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class OperatorOptions:
    namespaces: tuple[str, ...] = ()  # empty: every namespace; names or globs ("tenants-*") otherwise
    kubeconfig: Path | None = None  # None: in-cluster service account, else ~/.kube/config
    lease_name: str = "ibex-operator"
    lease_namespace: str | None = None  # None: the pod's namespace in-cluster, else "default"
    identity: str = ""  # empty: default_identity()
    lease: LeaseTiming = field(default_factory=LeaseTiming)
    resync_interval: float = 300.0  # the periodic timer that re-runs every reconcile (level-based)
    retry_base: float = 1.0  # backoff of Ready=False resources: base * 2**retry, capped
    retry_max: float = 60.0
    health_host: str = "127.0.0.1"
    health_port: int | None = None  # None: no health server; 0: a free port
    migrate: bool = False  # apply pending migrations once this replica leads

    def __post_init__(self) -> None:
        if not self.identity:
            object.__setattr__(self, "identity", default_identity())

    def backoff(self, retry: int) -> float:
        return float(min(self.retry_max, self.retry_base * (2 ** min(retry, 30))))
