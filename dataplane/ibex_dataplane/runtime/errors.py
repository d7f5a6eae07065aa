"""Errors raised while managing local runtimes (embedded stores)."""


class RuntimeError_(Exception):
    """Base class for runtime management errors."""


class EmbeddedStoreError(RuntimeError_):
    """An embedded store could not be initialised, started, checked or stopped."""
