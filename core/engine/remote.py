"""The engine core in its own process, reached over a unix socket (the server's default transport).

    config = EngineConfig()
    async with anyio.create_task_group() as tg:
        transport = await RemoteEngine.start(config, tg)
        async with EngineClient.serving(transport, config, tg) as client:
            ...

The child is started with multiprocessing's "spawn" method, which re-imports the parent's main
module: a script using this transport needs the `if __name__ == "__main__":` guard.

The child process builds `EngineCore(config)` and loops: apply the messages that arrived, step, send
the step's outputs; `EngineCore` decides what each message does. Its loop does no HTTP and no
detokenization. Frames are msgspec-msgpack messages (`messages.ClientMessage` one way,
`messages.EngineMessage` the other) prefixed with their length (4 bytes, big endian).

Liveness: the socket closing means the process is gone; a process that sends nothing for
`hang_timeout` seconds while it owes a step (it holds unfinished requests, or has not yet seen the
messages sent to it) is declared hung and killed. Either way `is_alive()` turns false and `outputs()`
raises `EngineDeadError`, which the client passes to every waiting request.

Several API processes (`corectl serve --api-server-count N`): `SharedEngine.launch` starts the engine
process with N connections, one per API process (`connections.py` routes and counts per connection),
and each API process reaches it with `RemoteEngine.attach`, which watches the process by its pid and,
closing, leaves the engine to the launcher (it stops once every connection has closed).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio
import msgspec
from anyio.abc import SocketAttribute, SocketStream, TaskGroup, UNIXSocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from ..config import EngineConfig
from ..process_exit import describe_exit
from ..errors import (
    ConfigError,
    CorectlError,
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
)
from .connections import ClientConnections
from .messages import (
    AbortRequests,
    AddRequests,
    ClientMessage,
    EngineControl,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFailed,
    EngineInfo,
    EngineMessage,
    EngineReady,
    ShutdownEngine,
)
from .transport import EngineTransport

if TYPE_CHECKING:  # the engine (torch, the model code) loads in the child process only
    from .core import EngineCore

logger = logging.getLogger("corectl.engine")

_HEADER = struct.Struct(">I")
_WATCH_INTERVAL_S = 0.25
# How often an idle engine process looks at its ranks (a dead one ends it: see `_serve`).
_IDLE_RANK_CHECK_S = 0.5
_CLOSE_GRACE_S = 10.0


# -- errors across the socket ---------------------------------------------------------------------

def _rebuild_error(failed: EngineFailed) -> CorectlError:
    """The child's exception as the parent should raise it (user errors keep their class)."""
    if failed.kind == "ConfigError" and failed.field:
        prefix = f"{failed.field}: "
        message = failed.message[len(prefix):] if failed.message.startswith(prefix) else failed.message
        return ConfigError(failed.field, message)
    if failed.kind == "ModelNotFoundError":
        return ModelNotFoundError(failed.message)
    if failed.kind == "InvalidRequestError":
        return InvalidRequestError(failed.message, param=failed.field, code=failed.code or "invalid_request_error")
    return EngineDeadError(f"engine process failed: {failed.kind}: {failed.message}")


def _describe_failure(exc: BaseException) -> EngineFailed:
    field = getattr(exc, "field", None) or getattr(exc, "param", None)
    return EngineFailed(type(exc).__name__, str(exc), field, getattr(exc, "code", None))


# -- the parent side ------------------------------------------------------------------------------

class RemoteEngine(EngineTransport):
    """An `EngineTransport` to an engine core running in a child process."""

    def __init__(self, process, stream: SocketStream, reader: BufferedByteReceiveStream, info: EngineInfo,
                 socket_dir: str | None, hang_timeout: float):
        """`process`: the engine's `multiprocessing` process, or an `_AttachedProcess` (then
        `socket_dir` is None: the engine belongs to the launcher, and closing only disconnects)."""
        self.info = info
        self._process = process
        self._stream = stream
        self._reader = reader
        self._socket_dir = socket_dir
        self._hang_timeout = hang_timeout
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._send_lock = anyio.Lock()
        # Messages sent and messages the engine says it applied: while they differ it owes a step.
        self._sent = 0
        self._applied = 0
        self._busy = False  # the last step left unfinished requests in the engine
        self._last_heard = time.monotonic()
        self._error: EngineDeadError | None = None
        self._closed = False

    @classmethod
    async def start(cls, config: EngineConfig, task_group: TaskGroup, *, hang_timeout: float = 60.0,
                    process_init: Callable[[], None] | None = None) -> "RemoteEngine":
        """Spawn the engine process and wait until its model is loaded.

        `process_init` (picklable, e.g. a module-level function) runs first in the child, e.g. to
        set up logging like the parent's. Startup errors are raised here with the child's message.
        """
        _check_hang_timeout(hang_timeout)
        process, socket_dir, links = await _launch(config, process_init, 1)
        (stream, reader), info = links[0]
        engine = cls(process, stream, reader, info, socket_dir, hang_timeout)
        task_group.start_soon(engine._watch)
        return engine

    @classmethod
    async def attach(cls, link: "EngineLink", task_group: TaskGroup, *, hang_timeout: float = 60.0) -> "RemoteEngine":
        """Reach an engine process that `SharedEngine.launch` started, over the connection `link` hands over."""
        _check_hang_timeout(hang_timeout)
        stream = await UNIXSocketStream.from_socket(link.sock)
        engine = cls(_AttachedProcess(link.pid), stream, BufferedByteReceiveStream(stream), link.info, None,
                     hang_timeout)
        task_group.start_soon(engine._watch)
        return engine

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        try:
            payload = self._encoder.encode(AddRequests(requests))
        except (OverflowError, msgspec.EncodeError) as exc:  # e.g. a seed or top_k past 64 bits
            raise InvalidRequestError(f"the request cannot be sent to the engine: {exc}") from exc
        await self._send(payload)

    async def abort_requests(self, request_ids: list[str]) -> None:
        if self.is_alive():
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await self._send(self._encoder.encode(AbortRequests(request_ids)))

    async def control(self, message: EngineControl) -> None:
        self._check_alive()
        await self._send(self._encoder.encode(message))

    async def outputs(self) -> AsyncIterator[EngineCoreOutputs]:
        while True:
            try:
                frame = await _read_frame(self._reader)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                    anyio.ClosedResourceError) as exc:
                if self._closed and self._error is None:
                    return
                # The socket closes a moment before the dead process is reaped; wait so the error says how it died.
                await anyio.to_thread.run_sync(self._process.join, 2.0)
                raise self._fail(f"the engine process is gone ({_how_it_ended(self._process)})") from exc
            message = self._decoder.decode(frame)
            if isinstance(message, EngineFailed):
                raise self._fail(str(_rebuild_error(message)))
            self._last_heard = time.monotonic()
            self._applied = message.num_messages_applied
            stats = message.outputs.stats
            self._busy = stats.num_running + stats.num_waiting > 0
            yield message.outputs

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._socket_dir is None:  # attached: the engine serves other API processes until the launcher stops it
                await self._stream.aclose()
                return
            if self._error is None:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await self._send(self._encoder.encode(ShutdownEngine()))
            await anyio.to_thread.run_sync(_stop_process, self._process, _CLOSE_GRACE_S)
            await self._stream.aclose()
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def is_alive(self) -> bool:
        return self._error is None and not self._closed and self._process.exitcode is None

    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise EngineDeadError("the engine is shut down")

    async def _send(self, payload: bytes) -> None:
        # Shielded: a frame cut short would garble the stream, and a message counted but never
        # written would leave the engine "owing" a step for a message it never got (then killed as hung).
        with anyio.CancelScope(shield=True):
            async with self._send_lock:
                if self._sent == self._applied:
                    self._last_heard = time.monotonic()  # the hang clock starts when the engine owes a step
                self._sent += 1
                await self._stream.send(_HEADER.pack(len(payload)) + payload)

    def _fail(self, reason: str) -> EngineDeadError:
        if self._error is None:
            self._error = EngineDeadError(reason)
            logger.error("engine failure: %s", reason)
        return self._error

    async def _watch(self) -> None:
        """Notice a process that died or hung even while nobody is reading its socket."""
        while not self._closed and self._error is None:
            await anyio.sleep(_WATCH_INTERVAL_S)
            if self._closed:
                return
            owes_step = self._busy or self._sent > self._applied
            silent = time.monotonic() - self._last_heard
            if self._process.exitcode is not None:
                self._fail(f"the engine process is gone ({_how_it_ended(self._process)})")
            elif owes_step and silent > self._hang_timeout:
                self._fail(f"the engine sent nothing for {silent:.1f} s while requests were pending "
                           f"(hang timeout {self._hang_timeout:g} s); killed it")
                await anyio.to_thread.run_sync(_stop_process, self._process, 0.0)
            else:
                continue
            await self._stream.aclose()  # wakes the reader, which raises the error to the client


def _check_hang_timeout(hang_timeout: float) -> None:
    if not hang_timeout > 0:
        raise ConfigError("engine_hang_timeout", f"must be a positive number of seconds, got {hang_timeout!r}")


async def _launch(config: EngineConfig, process_init, num_clients: int):
    """Spawn the engine process with `num_clients` connections and wait until its model is loaded:
    (process, socket folder, one (stream, reader) and info per connection)."""
    socket_dir = tempfile.mkdtemp(prefix="corectl-engine-")
    path = os.path.join(socket_dir, "engine.sock")
    process = multiprocessing.get_context("spawn").Process(
        target=_engine_process_main, args=(config, path, process_init, num_clients), name="corectl-engine")
    try:
        listener = await anyio.create_unix_listener(path)
        try:
            await anyio.to_thread.run_sync(process.start)
            streams = await _accept_while_alive(listener, process, num_clients)
        finally:
            await listener.aclose()
        links = []
        for stream in streams:
            reader = BufferedByteReceiveStream(stream)
            links.append(((stream, reader), await _ready(stream, reader, process)))
    except BaseException:
        _stop_process(process, grace_s=0.0)
        shutil.rmtree(socket_dir, ignore_errors=True)
        raise
    return process, socket_dir, links


async def _ready(stream: SocketStream, reader: BufferedByteReceiveStream, process) -> EngineInfo:
    try:
        first = msgspec.msgpack.decode(await _read_frame(reader), type=EngineMessage)
    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
        await anyio.to_thread.run_sync(process.join, 5.0)
        raise EngineDeadError(f"the engine process exited while starting ({describe_exit(process)}); "
                              "its log above says why") from None
    if isinstance(first, EngineFailed):
        await stream.aclose()
        raise _rebuild_error(first)
    if not isinstance(first, EngineReady):
        raise EngineDeadError(f"the engine process sent {type(first).__name__} before it was ready")
    return first.info


@dataclasses.dataclass
class EngineLink:
    """An API process's connection to a shared engine process (picklable: multiprocessing hands the
    socket to the API process it spawns)."""

    sock: socket.socket
    info: EngineInfo
    pid: int


class SharedEngine:
    """An engine process with one connection per API process (`corectl serve --api-server-count N`),
    owned by the launcher, which hands `links[i]` to API process i and stops the engine at the end."""

    def __init__(self, process, socket_dir: str, links: list[EngineLink]):
        self.process = process
        self.links = links
        self._socket_dir = socket_dir

    @classmethod
    async def launch(cls, config: EngineConfig, num_clients: int,
                     process_init: Callable[[], None] | None = None) -> "SharedEngine":
        process, socket_dir, links = await _launch(config, process_init, num_clients)
        handed = []
        for (stream, _), info in links:
            # A duplicate outlives this event loop's stream, which closes with it.
            handed.append(EngineLink(stream.extra(SocketAttribute.raw_socket).dup(), info, process.pid))
            await stream.aclose()
        return cls(process, socket_dir, handed)

    def stop(self, grace_s: float = _CLOSE_GRACE_S) -> None:
        """Wait for the engine to stop (it does once every API process has disconnected), else kill it."""
        for link in self.links:
            link.sock.close()
        _stop_process(self.process, grace_s)
        shutil.rmtree(self._socket_dir, ignore_errors=True)


class _AttachedProcess:
    """The engine process as an API process that did not start it sees it: by its pid."""

    def __init__(self, pid: int):
        self.pid = pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; else 1 (its launcher, its parent, reaps it and logs how it ended)."""
        try:
            running = open(f"/proc/{self.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            running = False
        return None if running else 1

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _how_it_ended(process) -> str:
    if isinstance(process, _AttachedProcess):
        return f"pid {process.pid}; the server's log says how it ended"
    return describe_exit(process)


async def _read_frame(reader: BufferedByteReceiveStream) -> bytes:
    (length,) = _HEADER.unpack(await reader.receive_exactly(_HEADER.size))
    return await reader.receive_exactly(length)


async def _accept_while_alive(listener, process, count: int) -> list[SocketStream]:
    """Accept the child's `count` connections, or fail as soon as the child exits without making them."""
    accepted: list[SocketStream] = []
    async with anyio.create_task_group() as tg:
        async def accept() -> None:
            while len(accepted) < count:
                accepted.append(await listener.accept())
            tg.cancel_scope.cancel()

        tg.start_soon(accept)
        while process.exitcode is None:
            await anyio.sleep(0.1)
        if len(accepted) < count:
            await anyio.sleep(0.1)  # the child may have connected just before exiting
        tg.cancel_scope.cancel()
    if len(accepted) < count:
        for stream in accepted:
            await stream.aclose()
        raise EngineDeadError(f"the engine process exited while starting ({describe_exit(process)}); "
                              "its log above says why")
    return accepted



def _stop_process(process, grace_s: float) -> None:
    if process.pid is None:
        return
    process.join(grace_s)
    if process.exitcode is None:
        process.kill()
        process.join(5.0)


# -- the child side -------------------------------------------------------------------------------

Inbox = queue.SimpleQueue  # of (connection index, ClientMessage, or None at its EOF)


class _Channel:
    """One connection of the child: a reader thread queues its decoded messages in the shared inbox."""

    def __init__(self, sock: socket.socket, index: int, inbox: Inbox):
        self._sock = sock
        self._index = index
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.inbox = inbox

    def start(self) -> None:
        threading.Thread(target=self._read_loop, name=f"corectl-engine-inbox-{self._index}", daemon=True).start()

    def send(self, message: EngineMessage) -> None:
        payload = self._encoder.encode(message)
        self._sock.sendall(_HEADER.pack(len(payload)) + payload)

    def _read_loop(self) -> None:
        try:
            while True:
                header = self._recv_exactly(_HEADER.size)
                (length,) = _HEADER.unpack(header)
                self.inbox.put((self._index, self._decoder.decode(self._recv_exactly(length))))
        except (ConnectionError, OSError, EOFError):
            self.inbox.put((self._index, None))

    def _recv_exactly(self, size: int) -> bytes:
        chunks, remaining = [], size
        while remaining:
            chunk = self._sock.recv(min(remaining, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)


def _engine_process_main(config: EngineConfig, socket_path: str, process_init: Callable[[], None] | None,
                         num_clients: int = 1) -> None:
    if process_init is not None:
        process_init()
    inbox: Inbox = queue.SimpleQueue()
    channels = []
    for index in range(num_clients):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path)
        channels.append(_Channel(sock, index, inbox))
    channel = channels[0]
    try:
        from .core import EngineCore

        core = EngineCore(config)
    except Exception as exc:
        if not isinstance(exc, CorectlError):
            logger.exception("the engine failed to start")
        channel.send(_describe_failure(exc))
        return
    # From here on the parent decides when the engine stops: a Ctrl-C or a SIGTERM sent to the whole
    # process group must let the server drain its requests first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for each in channels:
        each.send(EngineReady(core.info))
        each.start()
    try:
        _serve(core, inbox, ClientConnections([each.send for each in channels]))
    except (BrokenPipeError, ConnectionError):
        return  # the parent went away: nobody is left to serve
    except Exception as exc:
        logger.exception("the engine loop failed")
        for each in channels:
            with contextlib.suppress(OSError):
                each.send(_describe_failure(exc))
        raise SystemExit(1) from exc


def _serve(core: EngineCore, inbox: Inbox, connections: ClientConnections) -> None:
    while True:
        block = not core.has_unfinished_requests()
        while True:
            try:
                index, message = inbox.get(block, _IDLE_RANK_CHECK_S)
            except queue.Empty:
                if block:
                    core.executor.check_alive()  # idle: no step would notice a rank that died
                    continue
                break
            block = False
            if isinstance(message, ShutdownEngine):
                return
            if message is None:
                if connections.close(index, core):
                    return
                continue
            connections.apply(index, message, core)
        connections.send(core.step())

