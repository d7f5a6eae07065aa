"""Errors of the operator package. ``handlers`` maps them to ``Ready=False`` reasons and kopf retries at the edge."""

from __future__ import annotations


class OperatorError(Exception):
    """Base class for operator errors."""


class KubeApiError(OperatorError):
    """A Kubernetes API call failed (network, timeout, or an unexpected status); usually worth a retry."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class SecretConflict(OperatorError):
    """The Secret an ApiKey names exists but is not ours (another ApiKey's, or not managed by the operator)."""


class LeaseConflict(OperatorError):
    """Someone else changed the lease between our read and our write."""


class LeaseLost(OperatorError):
    """This replica no longer holds the leader lease and must stop applying changes."""
