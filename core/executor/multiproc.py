"""The `mp` executor: one process per rank (tensor-parallel rank of a pipeline stage) on this host,
spawned, or forked from a server that imported torch and corectl once where the platform allows it
(`PlatformCaps.rank_start_method`: the CPU platform's ranks start without their imports).

All ranks live in worker processes, rank 0 included, and the engine process only schedules: it
never blocks inside a collective, so while it waits for the output rank's reply it also watches
every rank's process and turns a death into `EngineDeadError` at once (a hung rank is caught by the
engine's hang timeout, which kills the engine process; its ranks follow, see `_exit_with_parent`).

Each rank has a duplex pipe. A step travels as one message: a kind byte and the `SchedulerOutput`
encoded once with msgspec, the same bytes written to every rank; the output rank (rank 0, or the
first of the last pipeline stage) answers with the previous step's `ModelRunnerOutput` (see
`rank.py` for when); a step's pending grammar masks follow it as one more message, without a
reply. Startup calls and errors are pickled, once.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
import signal
import threading
from multiprocessing.connection import Connection, wait

from ..errors import CorectlError, EngineDeadError
from ..process_exit import describe_exit
from .base import WorkerSpec
from .rank import RankWorker, free_port, output_rank, rank_name
from .remote_ranks import RemoteRanksExecutor

logger = logging.getLogger("corectl.executor")
# Start-up calls long enough to be worth a line per rank (loading weights, profiling, graph capture).
_STARTUP_CALLS = frozenset({"load_model", "profile_num_kv_blocks", "init_kv_cache", "warmup"})

_STEP, _MASK, _FLUSH, _CALL, _STOP = b"S", b"M", b"F", b"C", b"Q"  # engine -> rank
_OUTPUT, _RESULT, _ERROR = b"O", b"R", b"E"  # rank -> engine
_STOP_GRACE_S = 5.0
# What a forkserver imports once for every rank it forks (`PlatformCaps.rank_start_method`), beside the
# modules of the model's config class and the platform's worker (`_preload`).
_FORKSERVER_PRELOAD = ["torch", "corectl.executor.rank"]
# How long a rank's error waits for a peer's process to be seen ending (the error's likely cause).
_PEER_EXIT_WAIT_S = 0.5


def _preload(spec: WorkerSpec) -> list[str]:
    """The forkserver's imports: unpickling a rank's spec imports its config class's module, which in
    transformers pulls in most of the library (1.3 s of CPU a rank on a 2-core machine), and the rank
    builds the platform's worker; imported once in the server, every fork has them."""
    return [*_FORKSERVER_PRELOAD, type(spec.source.hf_config).__module__, spec.platform.worker_cls().__module__]


class MultiprocExecutor(RemoteRanksExecutor):
    def __init__(self, spec: WorkerSpec):
        super().__init__()
        method = spec.platform.capabilities().rank_start_method
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(_preload(spec))
        world_size = spec.config.world_size
        self._names = [rank_name(spec.config, rank) for rank in range(world_size)]
        self._output_rank = output_rank(spec.config)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        # Never written: a rank sees EOF on it once this process is gone, however it ended.
        death_reader, death_writer = ctx.Pipe(duplex=False)
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._error: EngineDeadError | None = None
        for rank in range(world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, name=f"corectl-rank{rank}", daemon=True,
                               args=(spec, rank, world_size, init_method, theirs, death_reader, dict(os.environ)))
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        death_reader.close()
        # Runs at exit before multiprocessing terminates daemon children, and on garbage collection.
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop_ranks, args=(self._procs, self._conns, death_writer), exitpriority=10)
        try:
            for rank in range(world_size):
                self._receive(rank, expect=_RESULT)
                logger.info("%s ready (%d of %d)", self._names[rank], rank + 1, world_size)
        except BaseException:
            self.shutdown()
            raise

    def _call_all(self, method: str, *args) -> list:
        message = _CALL + pickle.dumps((method, args))
        for conn in self._conns:
            conn.send_bytes(message)
        results = []
        for rank in range(len(self._conns)):
            results.append(pickle.loads(self._receive(rank, expect=_RESULT)))
            if method in _STARTUP_CALLS:
                logger.info("%s: %s done (%d of %d)", method, self._names[rank], rank + 1, len(self._conns))
        return results

    def _send_step(self, payload: bytes) -> bool:
        self._broadcast(_STEP + payload)
        return True

    def _send_bitmask(self, payload: bytes) -> None:
        self._broadcast(_MASK + payload)

    def _send_flush(self) -> bool:
        self._broadcast(_FLUSH)
        return True

    def _wait(self, reply: bool) -> bytes:
        return self._receive(self._output_rank, expect=_OUTPUT)

    def _broadcast(self, message: bytes) -> None:
        try:
            for conn in self._conns:
                conn.send_bytes(message)
        except OSError as exc:
            raise self._dead(f"a rank is gone ({exc})") from None

    def _receive(self, rank: int, expect: bytes) -> bytes:
        """The next reply of `rank`, watching every rank's process meanwhile."""
        if self._error is not None:
            raise self._error
        conn = self._conns[rank]
        ready = wait([conn, *(p.sentinel for p in self._procs)])
        startup = expect == _RESULT
        if conn not in ready:
            dead = next(r for r, p in enumerate(self._procs) if p.sentinel in ready)
            raise self._rank_failure(dead, startup)
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            raise self._rank_failure(rank, startup) from None
        if data[:1] == _ERROR:
            raise self._rank_error(rank, pickle.loads(data[1:]), startup)
        if data[:1] != expect:
            raise self._dead(f"{self._names[rank]} sent {data[:1]!r} where {expect!r} was due")
        return memoryview(data)[1:]

    def _rank_failure(self, rank: int, startup: bool) -> BaseException:
        """Why `rank` stopped: its last words when it sent them, else how its process ended."""
        conn, proc = self._conns[rank], self._procs[rank]
        with contextlib.suppress(EOFError, OSError):
            if conn.poll():
                data = conn.recv_bytes()
                if data[:1] == _ERROR:
                    return self._rank_error(rank, pickle.loads(data[1:]), startup)
        proc.join(1.0)
        return self._dead(f"{self._names[rank]} (pid {proc.pid}) is gone ({describe_exit(proc)})")

    def _rank_error(self, rank: int, exc: BaseException, startup: bool) -> BaseException:
        if startup and isinstance(exc, CorectlError):
            return exc  # an error the user can act on (too small a KV cache, a bad option)
        # A peer's death fails the survivors' collectives and stage transfers, often before its
        # process is seen to end: the dead rank is the one to name.
        others = [p.sentinel for r, p in enumerate(self._procs) if r != rank]
        ended = wait(others, timeout=_PEER_EXIT_WAIT_S)
        if ended:
            return self._rank_failure(next(r for r, p in enumerate(self._procs) if p.sentinel in ended), startup)
        return self._dead(f"{self._names[rank]} failed: {type(exc).__name__}: {exc}")

    def _dead(self, reason: str) -> EngineDeadError:
        if self._error is None:
            self._error = EngineDeadError(reason)
        return self._error

    def is_alive(self) -> bool:
        return self._error is None and all(p.exitcode is None for p in self._procs)

    def check_alive(self) -> None:
        if self._error is None:
            dead = next((rank for rank, proc in enumerate(self._procs) if proc.exitcode is not None), None)
            if dead is not None:
                self._rank_failure(dead, startup=False)  # records how it ended, its last words first
        if self._error is not None:
            raise self._error

    def shutdown(self) -> None:
        self._finalizer()


def _stop_ranks(procs, conns: list[Connection], death_writer: Connection) -> None:
    # Highest rank first, rank 0 last: rank 0 hosts the group's TCP store, and a peer still alive
    # when it goes (NCCL's heartbeat thread polls the store) fills the log with connection errors.
    for proc, conn in reversed(list(zip(procs, conns))):
        with contextlib.suppress(OSError, ValueError):
            conn.send_bytes(_STOP)
        proc.join(_STOP_GRACE_S)
        if proc.exitcode is None:
            proc.kill()
            proc.join(_STOP_GRACE_S)
    for conn in [*conns, death_writer]:
        conn.close()



# -- the rank's process --------------------------------------------------------------------------

def _rank_main(spec: WorkerSpec, rank: int, world_size: int, init_method: str, conn: Connection,
               death_reader: Connection, environ: dict[str, str]) -> None:
    # A forked rank has its server's environment, from when the server started: take the engine's.
    os.environ.clear()
    os.environ.update(environ)
    # `ps` and /proc name the rank (a forked rank's command line is its server's).
    with contextlib.suppress(OSError):
        with open("/proc/self/comm", "w") as comm:
            comm.write(multiprocessing.current_process().name)
    _exit_with_parent(death_reader)
    # The engine decides when ranks stop: a Ctrl-C or SIGTERM to the process group must let the
    # server drain first (the engine process ignores them too).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        rank_worker = RankWorker(spec, rank, world_size, init_method, device_index=rank)
        conn.send_bytes(_RESULT + pickle.dumps(None))
        _serve(rank_worker, conn)
    except EOFError:
        return  # the engine went away
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send_bytes(_ERROR + _pickled_error(exc))
        raise SystemExit(1) from exc
    rank_worker.shutdown()


def _serve(rank_worker: RankWorker, conn: Connection) -> None:
    while True:
        data = conn.recv_bytes()
        kind, payload = data[:1], memoryview(data)[1:]
        if kind == _STEP:
            output = rank_worker.step(payload)
        elif kind == _MASK:
            rank_worker.sample_pending(payload)
            continue
        elif kind == _FLUSH:
            output = rank_worker.flush()
        elif kind == _CALL:
            method, args = pickle.loads(payload)
            conn.send_bytes(_RESULT + pickle.dumps(rank_worker.call(method, *args)))
            continue
        else:
            return
        if output is not None:
            conn.send_bytes(_OUTPUT + output)


def _pickled_error(exc: BaseException) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:  # an exception type that does not pickle still reports its message
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


def _exit_with_parent(death_reader: Connection) -> None:
    """End this process as soon as the engine's is gone, even mid-collective (a hung peer)."""
    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            death_reader.recv()
        os._exit(1)

    threading.Thread(target=watch, name="corectl-tp-parent-watch", daemon=True).start()
