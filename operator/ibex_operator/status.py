"""Kubernetes-style status for the four kinds: ``observedGeneration`` and ``conditions[]`` with ``Ready`` always.

Reconcile functions return a :class:`ReconcileOutcome`; the kopf glue writes it into ``.status`` and the local
manifest loader prints it. No phase strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

ConditionStatus = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class Condition:
    type: str
    status: ConditionStatus
    reason: str
    message: str = ""

    def to_k8s(self, generation: int, previous: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Render for ``.status.conditions``, keeping ``lastTransitionTime`` when the status did not change."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        last = now
        for old in previous or []:
            if old.get("type") == self.type and old.get("status") == self.status and old.get("lastTransitionTime"):
                last = old["lastTransitionTime"]
        rendered: dict[str, Any] = {"type": self.type, "status": self.status, "reason": self.reason}
        if self.message:
            # Optional in the schema: an empty message is left out (the 1.20 test apiserver rejects "" as null).
            rendered["message"] = self.message
        rendered["lastTransitionTime"] = last
        rendered["observedGeneration"] = generation
        return rendered


@dataclass(frozen=True)
class ReconcileOutcome:
    """What a reconcile did: readiness, the conditions behind it and the stable fields to record in status."""

    kind: str
    namespace: str
    name: str
    ready: bool
    reason: str
    message: str = ""
    conditions: tuple[Condition, ...] = ()
    fields: dict[str, Any] = field(default_factory=dict)
    retryable: bool = False  # Ready=False because of something that may fix itself (missing ref, outage)

    @property
    def all_conditions(self) -> tuple[Condition, ...]:
        ready = Condition("Ready", "True" if self.ready else "False", self.reason, self.message)
        return (ready, *self.conditions)

    def status(self, generation: int, previous: dict[str, Any] | None = None) -> dict[str, Any]:
        prev_conditions = (previous or {}).get("conditions") or []
        return {
            **self.fields,
            "observedGeneration": generation,
            "conditions": [c.to_k8s(generation, prev_conditions) for c in self.all_conditions],
        }

    @classmethod
    def failed(
        cls, kind: str, namespace: str, name: str, cause: str, reason: str, message: str, *, retryable: bool = False
    ) -> ReconcileOutcome:
        """Ready=False because of one cause condition (e.g. OrganizationBound=False, reason OrganizationNotFound)."""
        return cls(
            kind, namespace, name, ready=False, reason=reason, message=message, retryable=retryable,
            conditions=(Condition(cause, "False", reason, message),),
        )  # fmt: skip

    @property
    def ref(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"
