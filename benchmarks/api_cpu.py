"""F1's CPU stand-in: the API process's CPU per streamed token and per request, this tree against
another revision, served side by side on this machine and measured in alternating passes.

    python benchmarks/api_cpu.py [--base REV] [--with NAME=DIR ...] [--flags NAME="--stream-interval 4" ...]
                                 [--passes 3] [--workload stream|request|both]

Each tree runs `corectl serve` (the embedded SmolLM2 on the CPU, one engine thread); the API process
is the serve process itself (its engine is a child). `--with NAME=DIR` adds a server of this tree
with DIR ahead on PYTHONPATH, `--flags NAME=FLAGS` one of this tree with more `serve` flags. After a warm-up and a quiet spell that gives
each API process's idle CPU rate (uvicorn's tick, the engine and health watches), every pass reads
the process's utime + stime from /proc around one `corectl bench serve` and prints the CPU per
streamed token (stream: 64 streams of 400 tokens, every engine step carries a token of each) or per
request (request: 1,024 requests of 1,024 prompt ids sharing a 1,000-id prefix, 2 tokens each),
raw and less the idle rate over the pass's wall time. The engine's speed on a CPU is far below an
H100's, so the per-token figure carries more per-second work than F1's; compare trees, not machines.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "stream": (64 * 400, ["--num-prompts", "64", "--max-concurrency", "64", "--input-len", "32",
                          "--output-len", "400"]),
    "request": (1024, ["--num-prompts", "1024", "--max-concurrency", "64", "--prompt-token-ids",
                      "--dataset", "prefix_repetition", "--prefix-len", "1000", "--num-prefixes", "1",
                      "--input-len", "24", "--output-len", "2"]),
}


def overlay(rev: str, scratch: Path) -> Path:
    """A folder to put ahead on PYTHONPATH so `corectl` imports `rev`'s tree (a git worktree of it),
    laid out as setuptools' package-dir installs it."""
    tree = scratch / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), rev], check=True,
                   capture_output=True)
    package = scratch / "site" / "corectl"
    package.parent.mkdir()
    shutil.copytree(tree / "core", package, symlinks=True)
    for sub in ("backends", "plugins", "server"):
        (package / sub).symlink_to(tree / sub)
    return package.parent


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    def __init__(self, name: str, port: int, pythonpath: Path | None, log: Path, flags: tuple[str, ...] = ()):
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = f"{pythonpath}:{env.get('PYTHONPATH', '')}"
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "corectl.server.cli.main", "serve", "--max-model-len", "2048",
             "--kv-cache-memory", "1.0", "--max-num-seqs", "64", "--num-threads", "1", "--port", str(port), *flags],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())

    def wait(self) -> None:
        for _ in range(600):
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name}: the server exited ({self.proc.returncode}); see its log")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"{self.name}: no /health in 600 s")

    def bench(self, args: list[str]) -> float:
        """Runs one bench pass against this server: its wall seconds."""
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "corectl.server.cli.main", "bench", "serve", "--base-url", self.url,
                        "--ignore-eos", "--seed", "0", *args], check=True, capture_output=True)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the revision to compare with (default: this tree alone)")
    parser.add_argument("--with", dest="variants", action="append", default=[], metavar="NAME=DIR",
                        help="also serve this tree with DIR ahead on PYTHONPATH")
    parser.add_argument("--flags", dest="flag_variants", action="append", default=[], metavar="NAME=FLAGS",
                        help="also serve this tree with these serve flags")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="api_cpu_"))
    servers = [Server("this tree", 8131, None, scratch / "this.log")]
    if args.base:
        servers.append(Server(args.base, 8132, overlay(args.base, scratch), scratch / "base.log"))
    for index, variant in enumerate(args.variants):
        name, path = variant.split("=", 1)
        servers.append(Server(name, 8133 + index, Path(path), scratch / f"{name}.log"))
    for index, variant in enumerate(args.flag_variants):
        name, flags = variant.split("=", 1)
        servers.append(Server(name, 8143 + index, None, scratch / f"{name}.log", tuple(flags.split())))
    try:
        run(servers, args)
    finally:
        for server in servers:
            server.proc.terminate()
            server.proc.wait(60)
        if args.base:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(scratch / "tree")])


def run(servers: list[Server], args) -> None:
    subprocess.run(["bash", "-c", "lscpu | grep 'Model name'; uptime"])
    for server in servers:
        server.wait()
        server.bench(["--num-prompts", "16", "--max-concurrency", "16", "--input-len", "32", "--output-len", "16"])
    before = {s.name: cpu_seconds(s.proc.pid) for s in servers}
    time.sleep(args.idle_seconds)
    idle = {s.name: (cpu_seconds(s.proc.pid) - before[s.name]) / args.idle_seconds for s in servers}
    print("idle CPU rate: " + ", ".join(f"{name} {rate * 1e3:.1f} ms/s" for name, rate in idle.items()))
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    for workload in workloads:
        units, bench_args = WORKLOADS[workload]
        unit = "token" if workload == "stream" else "request"
        for index in range(args.passes):
            # Alternate which tree goes first: ABBA... so drift in the machine's load hits both alike.
            for server in servers if index % 2 == 0 else servers[::-1]:
                start = cpu_seconds(server.proc.pid)
                wall = server.bench(bench_args)
                cpu = cpu_seconds(server.proc.pid) - start
                print(f"{workload} pass {index + 1} {server.name}: {cpu / units * 1e6:.1f} us a {unit}, "
                      f"{(cpu - idle[server.name] * wall) / units * 1e6:.1f} less idle ({wall:.0f} s)", flush=True)
    subprocess.run(["uptime"])


if __name__ == "__main__":
    main()
