"""Run an `ibex` command as a real process: wait for its `ready` line, stop it with SIGTERM, close its pipes."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IBEX = [sys.executable, "-m", "ibex_dataplane.cli"]


@dataclass
class IbexProcess:
    proc: subprocess.Popen[str]
    url: str
    output: list[str] = field(default_factory=list)


@contextmanager
def ibex_process(
    args: list[str],
    env: dict[str, str],
    ready: str = r"^ibex [a-z]+ ready\b.*?(http://[^\s`'\"]+)",
    timeout: float = 90,
) -> Iterator[IbexProcess]:
    """`ibex <args>`; yields once a line matches ``ready`` (group 1 is the URL). Output is kept in ``output``."""
    proc = subprocess.Popen(
        [*IBEX, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    running = IbexProcess(proc, "")
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not running.url:
            line = proc.stdout.readline()
            if not line:
                break
            running.output.append(line)
            m = re.search(ready, line)
            running.url = m.group(1) if m else ""
        assert running.url, f"ibex {args[0]} never printed its ready line:\n" + "".join(running.output)
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        running.output.extend(proc.stdout.readlines())
        proc.stdout.close()


def child_processes(parent: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose parent is ``parent``, read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append((int(entry.name), cmdline))
    return found
