"""`corectl serve` in a subprocess on a free loopback port, and the processes it starts."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

API_KEY = "token-abc123"
# Small context and cache so the engine starts in seconds on 2 CPU cores. The embedded model's servers
# run its default CPU path (GGUF 4-bit weights, the int4 kernel): a decode step costs a fifth of fp32's
# CPU, and the tests on them compare corectl with corectl (an in-process reference: `llm_int4`).
SMALL_ENGINE = ["--max-model-len", "512", "--kv-cache-memory", "0.05"]
# Checkpoints (random-weight HF folders) keep fp32, not their config's dtype: their servers are compared
# with `LLM(..., dtype="float32")` in this process (`assert_serves_like_one_device`).
SMALL_ENGINE_FP32 = [*SMALL_ENGINE, "--dtype", "float32"]
PARITY_PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3,"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def await_health(url: str, proc: subprocess.Popen, timeout: float) -> str | None:
    """Poll `url`/health until it answers 200 (None), `proc` exits or `timeout` s pass (what happened)."""
    deadline = time.monotonic() + timeout
    # One client for every poll: `httpx.get` builds an SSL context each call (tens of ms of CPU),
    # which at ten polls a second took a third of a core from the server being waited for.
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"exited with {proc.returncode}"
            try:
                if client.get(url + "/health").status_code == 200:
                    return None
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    return f"not ready after {timeout} s"


class ServerProcess:
    """`corectl serve` in a subprocess; its log goes to a file the tests can read."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="corectl-serve-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "corectl.server.cli", "serve", "--port", str(self.port), "--log-format", "json",
             *args], stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        problem = await_health(self.url, self.proc, timeout)
        if problem:
            raise RuntimeError(f"server {problem}:\n{self.log()}")
        return self

    def log(self) -> str:
        return Path(self._log.name).read_text()

    def engine_pid(self) -> int:
        """The engine process: the server's child started by multiprocessing's spawn."""
        # Each thread lists the children it forked; the engine is started from a worker thread.
        tasks = Path(f"/proc/{self.proc.pid}/task").iterdir()
        children = [pid for task in tasks for pid in (task / "children").read_text().split()]
        for pid in children:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
        raise LookupError(f"no engine process among the children {children} of {self.proc.pid}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self._log.name)
        return self.proc.returncode


@contextlib.contextmanager
def running_server(*args: str):
    """A `ServerProcess` with `args`, ready, and stopped afterwards (a fixture's body)."""
    process = ServerProcess(*args)
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children before their own children."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def rank_processes(server: ServerProcess) -> list[int]:
    """The engine's rank processes (tensor-parallel ranks, pipeline stages), in start order."""
    return sorted(pid for pid in descendants(server.engine_pid())
                  if Path(f"/proc/{pid}/comm").read_text().startswith("corectl-rank"))


def assert_serves_like_one_device(server: ServerProcess, checkpoint: Path) -> None:
    """Greedy completions of a server of `checkpoint` (served as "tiny", SMALL_ENGINE_FP32) equal those of one
    device in this process."""
    import openai
    from corectl import LLM, SamplingParams

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    served = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0.0,
                                        extra_body={"ignore_eos": True}).choices[0].text for p in PARITY_PROMPTS]
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=512, kv_cache_memory_gib=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert served == [out.outputs[0].text for out in llm.generate(PARITY_PROMPTS, params, use_tqdm=False)]


def assert_rank_death_ends_the_stream(server: ServerProcess, rank: int, error: str) -> None:
    """Kill rank process `rank` of a server of "tiny" while it streams a long completion: the stream
    fails within seconds with an error matching `error`, /health answers 503, and the server exits 1."""
    import openai
    import pytest

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="tiny", prompt=PARITY_PROMPTS[0], max_tokens=400, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    received = [next(iter(stream))]
    os.kill(rank_processes(server)[rank], signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(openai.APIError, match=error):
        received.extend(stream)
    assert time.monotonic() - killed_at < 10 and len(received) < 400
    assert httpx.get(server.url + "/health", timeout=5).status_code == 503
    assert server.proc.wait(30) == 1


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def encoder_client(folder: Path, *args: str):
    """A small fp32 server (64-token context) of the encoder checkpoint in `folder` (with `args`), and a
    client that sends the API key; the server must stop cleanly afterwards. Its engine runs in the
    server's process, which saves a second interpreter's start: pooled vectors cross the engine process
    boundary as the same message for every pooling task, and the shared `pooling_server` checks that."""
    proc = ServerProcess(str(folder), "--api-key", API_KEY, "--dtype", "float32", "--kv-cache-memory", "0.02",
                         "--max-model-len", "64", "--engine-in-process", *args).wait_ready()
    with httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client
    assert proc.stop() == 0
