"""Errors raised while managing local runtimes (embedded stores)."""


class RuntimeError_(Exception):
    """Base class for runtime management errors."""


class EmbeddedStoreError(RuntimeError_):
    """An embedded store could not be initialised, started, checked or stopped."""


class DataDirInUse(EmbeddedStoreError):
    """Another process runs the embedded stores of this data directory (``ibex dev``, usually)."""

    def __init__(self, data_dir: str, pid: int | None, url: str | None) -> None:
        self.data_dir = data_dir
        self.pid = pid
        self.url = url
        who = f"process {pid}" if pid else "another process"
        super().__init__(f"{who} already runs the embedded stores of {data_dir}" + (f" (serving {url})" if url else ""))
