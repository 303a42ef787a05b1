"""One API process: uvicorn serving the Litestar app on a socket already bound, until stopped.
`corectl serve` runs it in its own process, or in each of `--api-server-count` processes."""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket

import uvicorn

logger = logging.getLogger("corectl.server")
# How long before the drain deadline the requests still running are ended, for their answers to go out.
_ANSWER_GRACE_S = 1.0


def serve_api(settings, sock: socket.socket, engine_links=None, index: int | None = None) -> int:
    """Serve HTTP on the bound `sock` until stopped; returns the exit status. `engine_links`: the
    connections to engines another process started (API process `index` of several), else the
    server starts its own."""
    from ..http.app import create_app
    from ..http.state import ServerState

    state = ServerState(settings)
    state.engine_links, state.api_server_index = engine_links, index
    config = uvicorn.Config(create_app(state), host=settings.host, port=settings.port, log_config=None,
                            access_log=False, lifespan="on", timeout_graceful_shutdown=settings.shutdown_timeout,
                            ssl_keyfile=settings.ssl_keyfile, ssl_certfile=settings.ssl_certfile,
                            ssl_ca_certs=settings.ssl_ca_certs, ssl_cert_reqs=settings.ssl_cert_reqs,
                            root_path=settings.root_path, log_level=settings.uvicorn_log_level)
    server = _Server(config, state)
    state.request_exit = server.request_exit
    quiet = _QuietStartupTraceback(state)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    # uvicorn re-raises the signal that stopped it once it is done; these handlers make that a no-op
    # so a drained shutdown exits 0.
    previous = {sig: signal.signal(sig, _ignore_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    except SystemExit:
        if state.startup_error is None:
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    if state.startup_error is not None:
        raise state.startup_error
    logger.info("server stopped (exit status %d)", state.exit_code)
    return state.exit_code


def _ignore_signal(signum, frame) -> None:
    return None


class _Server(uvicorn.Server):
    """uvicorn's server, told about SIGTERM (to refuse new requests) and about engine failures."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cutoff: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        # What exists now (modules, the app, the tokenizer, the engine client) lives as long as the
        # process. Frozen, it is left out of the collector's passes, as vLLM's API server does: a full
        # collection walked its ~120k objects for 69 ms (every few hundred requests on the F1 stand-in),
        # and the collector's CPU a request halved (docs/performance.md, "API process").
        gc.collect()
        gc.freeze()

    def handle_exit(self, sig, frame) -> None:
        if not self.state.draining:
            logger.info("shutting down: refusing new requests, waiting up to %g s for running ones",
                        self.state.settings.shutdown_timeout)
        self.state.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_cutoff)
        super().handle_exit(sig, frame)

    def _start_cutoff(self) -> None:
        if self._cutoff is None:
            self._cutoff = self._loop.create_task(self._end_running_requests())

    async def _end_running_requests(self) -> None:
        """Just before uvicorn's drain deadline cancels the handlers (a bare 500, a stream cut without
        [DONE]), the requests still running end with a 503 the clients can read: an error event and
        [DONE] on a stream."""
        from ..http.errors import APIError

        timeout = self.state.settings.shutdown_timeout
        await asyncio.sleep(max(0.0, timeout - min(_ANSWER_GRACE_S, timeout / 2)))
        client = self.state.client
        if client is None:
            return
        ended = await client.abort_all(APIError(503, f"the server is shutting down and its --shutdown-timeout of "
                                                     f"{timeout:g} s ran out before this request finished"))
        if ended:
            logger.warning("shutdown timeout reached: %d running request(s) ended with a 503", ended)

    def request_exit(self) -> None:
        self.should_exit = True


class _QuietStartupTraceback(logging.Filter):
    """A startup error the user can act on (bad option, missing model) is reported once, in words;
    uvicorn would also log its traceback."""

    def __init__(self, state):
        super().__init__()
        self._state = state

    def filter(self, record: logging.LogRecord) -> bool:
        from corectl.errors import CorectlError

        expected = isinstance(self._state.startup_error, CorectlError)
        return not (expected and "Traceback" in str(record.msg).split("\n", 1)[0])

