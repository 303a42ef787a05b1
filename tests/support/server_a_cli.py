"""Several `corectl` command lines run one after another in ONE fresh interpreter, each as the console
script runs it (`main(argv)`, exit status from its return or SystemExit), each with its own stdout and
stderr captured at the file-descriptor level (so what processes it starts write is caught too).
Every `corectl` process pays ~3-5 s importing torch and corectl before it parses a flag: tests that
run several short commands pay that once."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_RUNNER = r"""
import json, logging, os, sys, traceback
from corectl.server.cli.main import main

argvs, folder = json.loads(sys.argv[1]), sys.argv[2]
codes = []
for index, argv in enumerate(argvs):
    saved = [os.dup(1), os.dup(2)]
    for fd, name in ((1, "out"), (2, "err")):
        with open(os.path.join(folder, f"{index}.{name}"), "wb") as sink:
            os.dup2(sink.fileno(), fd)
    logging.getLogger().handlers = []  # a run that logs without configuring must not reach the last one's
    try:
        code = main(argv)
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except Exception:  # what the interpreter would do: the traceback on stderr, exit status 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)
    codes.append(code)
with open(os.path.join(folder, "codes.json"), "w") as out:
    json.dump(codes, out)
"""


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str


def cli_runs(*argvs: list[str], timeout: float = 600) -> list[CliRun]:
    """Each of `argvs` (corectl's arguments, without the program name) through corectl's `main`, in
    order, in one subprocess; their exit statuses and outputs."""
    with tempfile.TemporaryDirectory(prefix="corectl-cli-") as folder:
        done = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps([list(a) for a in argvs]), folder],
                              capture_output=True, text=True, timeout=timeout)
        codes_file = Path(folder) / "codes.json"
        assert codes_file.exists(), f"the runner died ({done.returncode}):\n{done.stdout}{done.stderr}"
        codes = json.loads(codes_file.read_text())
        return [CliRun(code, (Path(folder) / f"{i}.out").read_text(), (Path(folder) / f"{i}.err").read_text())
                for i, code in enumerate(codes)]
