"""Sleep mode over HTTP, as vLLM serves it (with `--enable-sleep-mode`): `POST /sleep?level=1|2`,
`POST /wake_up` (optionally `?tags=weights&tags=kv_cache`, one part at a time) and `GET /is_sleeping`;
and vLLM's `POST /reset_prefix_cache`, which forgets the cached prefixes once the running requests
have finished (benchmark passes then start cold).

A sleep waits for the running requests to finish; from the moment it is asked for, generation
and embedding requests get a 503 until the engine is awake again (`ServerState.check_accepting`).
"""
from __future__ import annotations

import msgspec
from litestar import Controller, Response, get, post
from litestar.params import Parameter

from .auth import require_api_key
from .errors import ERROR_RESPONSES, APIError
from .state import ServerState


class SleepStatus(msgspec.Struct):
    is_sleeping: bool


class SleepController(Controller):
    guards = [require_api_key]
    tags = ["Operations"]

    @post("/sleep", status_code=200, responses=ERROR_RESPONSES)
    async def sleep(self, server: ServerState, level: int = Parameter(query="level", default=1)) -> Response:
        _check_enabled(server)
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 (weights to host memory) or 2 (weights dropped), got {level}",
                           "level")
        await server.engine.sleep_mode.sleep(level)
        return Response(b"", status_code=200)

    @post("/wake_up", status_code=200, responses=ERROR_RESPONSES)
    async def wake_up(self, server: ServerState,
                      tags: list[str] | None = Parameter(query="tags", default=None)) -> Response:
        _check_enabled(server)
        await server.engine.sleep_mode.wake_up(tags)
        return Response(b"", status_code=200)

    @post("/reset_prefix_cache", status_code=200, responses=ERROR_RESPONSES)
    async def reset_prefix_cache(self, server: ServerState) -> Response:
        await server.engine.sleep_mode.reset_prefix_cache()
        return Response(b"", status_code=200)

    @get("/is_sleeping")
    async def is_sleeping(self, server: ServerState) -> SleepStatus:
        return SleepStatus(server.engine.sleep_mode.is_sleeping)


def _check_enabled(server: ServerState) -> None:
    if not server.settings.engine.enable_sleep_mode:
        raise APIError(400, "sleep mode is off; start the server with --enable-sleep-mode")
