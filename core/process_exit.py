"""How a child process ended, in words for error messages (engine processes and tensor-parallel ranks)."""
from __future__ import annotations

import contextlib
import signal


def describe_exit(process) -> str:
    """"still running", "killed by SIGKILL" or "exit code N" for a `multiprocessing` process."""
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
