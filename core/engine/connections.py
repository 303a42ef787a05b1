"""The engine process's client connections: one per API process (`corectl serve --api-server-count N`).

Every connection is a client of its own: it counts the messages it sent, the core requests the engine
took in from it and the sleep-mode controls it asked for, and reads them back from its step reports
(`EngineStep.num_messages_applied`, `EngineCoreOutputs.num_requests_received`, `controls_done` and
`control_errors`), so the engine reports each connection's counts, not the engine's totals. A
request's outputs go to the connection that added it; every connection gets every step's report
(its stats and snapshot describe the whole engine, and the hang watch of an API process expects a
report per step while the engine is busy). A connection that closes has its requests aborted; the
engine stops once every connection has closed.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from .messages import AbortRequests, AddRequests, EngineCoreOutputs, EngineMessage, EngineStep

if TYPE_CHECKING:
    from .core import EngineCore

Send = Callable[[EngineMessage], None]


class ClientConnections:
    def __init__(self, senders: list[Send]):
        self._senders = senders
        self._open = set(range(len(senders)))
        self._applied = [0] * len(senders)
        self._received = [0] * len(senders)
        self._owners: dict[str, int] = {}  # core request id -> its connection (several connections only)
        # Sleep-mode controls in the order the engine runs them: (connection, its own number for it).
        self._controls: list[tuple[int, int]] = []
        self._controls_sent = [0] * len(senders)
        self._controls_done = [0] * len(senders)
        self._controls_reported = 0

    def apply(self, index: int, message, core: EngineCore) -> None:
        """Apply a message connection `index` sent, counting it as that connection's."""
        self._applied[index] += 1
        if isinstance(message, AddRequests):
            self._received[index] += len(message.requests)
            if len(self._senders) > 1:
                for request in message.requests:
                    self._owners[request.request_id] = index
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self._owners.pop(request_id, None)
        else:
            self._controls_sent[index] += 1
            self._controls.append((index, self._controls_sent[index]))
        core.apply(message)

    def close(self, index: int, core: EngineCore) -> bool:
        """Connection `index` went away: abort its requests; True once no connection is left."""
        self._open.discard(index)
        mine = [request_id for request_id, owner in self._owners.items() if owner == index]
        for request_id in mine:
            del self._owners[request_id]
        if mine:
            core.abort_requests(mine)
        return not self._open

    def send(self, outputs: EngineCoreOutputs) -> None:
        """One step's report to every open connection, each with its own outputs and counts."""
        if len(self._senders) == 1:
            self._senders[0](EngineStep(outputs, self._applied[0]))
            return
        errors = self._control_errors(outputs)
        routed: list[list] = [[] for _ in self._senders]
        owners = self._owners
        for out in outputs.outputs:
            routed[owners.get(out.req_id, 0)].append(out)
            if out.finish_reason is not None:
                owners.pop(out.req_id, None)
        for index in sorted(self._open):
            mine = msgspec.structs.replace(outputs, outputs=routed[index], num_requests_received=self._received[index],
                                           controls_done=self._controls_done[index], control_errors=errors[index])
            self._senders[index](EngineStep(mine, self._applied[index]))

    def _control_errors(self, outputs: EngineCoreOutputs) -> list[list[tuple[int, str]]]:
        """Each connection's controls carried out by this step, and their errors under its own numbers."""
        numbers: dict[int, tuple[int, int]] = {}
        while self._controls_reported < outputs.controls_done:
            index, own = self._controls[self._controls_reported]
            self._controls_reported += 1
            self._controls_done[index] = own
            numbers[self._controls_reported] = (index, own)
        errors: list[list[tuple[int, str]]] = [[] for _ in self._senders]
        for number, message in outputs.control_errors:
            index, own = numbers[number]
            errors[index].append((own, message))
        return errors
