"""Where issued API key tokens go: a Kubernetes Secret (the operator's ``kube_secrets.KubernetesSecretSink``, since
only that module talks to the Kubernetes API) or a local file (``ibex dev``, :class:`FileSecretSink`).

The plaintext token exists only there. Reconcile reads it back to check it still matches the stored hash and
re-issues the key's secret when it does not (for example after the Secret was deleted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol


class SecretSink(Protocol):
    async def read(self, namespace: str, secret_name: str) -> str | None: ...

    async def write(self, namespace: str, secret_name: str, token: str, owner: dict[str, str] | None) -> None: ...


class FileSecretSink:
    """Local stand-in for Kubernetes Secrets: one JSON file, mode 0600, ``{"<ns>/<secret>": "<token>"}``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _load(self) -> dict[str, str]:
        try:
            data: dict[str, str] = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        return data

    async def read(self, namespace: str, secret_name: str) -> str | None:
        return self._load().get(f"{namespace}/{secret_name}")

    async def write(self, namespace: str, secret_name: str, token: str, owner: dict[str, str] | None) -> None:
        data = self._load()
        data[f"{namespace}/{secret_name}"] = token
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        tmp.replace(self.path)
