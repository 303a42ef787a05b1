"""Which waiting requests a step may start, so that no step mixes more than `max_loras` adapters.

The running requests' adapters are resident on the device; a waiting request joins when its
adapter is one of them or a slot is free (requests without an adapter always may). One whose
adapter does not fit is passed over, and the requests behind it go on. So that a stream of
requests for resident adapters cannot keep it waiting for ever, after `PATIENCE_STEPS` steps in a
row that passed a request over, requests for resident adapters stop joining: those adapters drain,
their slots free up, and the passed-over request gets one.
"""
from __future__ import annotations

from ..request import Request, RequestStatus

PATIENCE_STEPS = 16


class AdapterAdmission:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._adapters: set[int] = set()
        self._passed_over = False
        self._steps_passing_over = 0

    def begin(self, running: list[Request]) -> None:
        """Start a step's admissions from the adapters its running requests hold."""
        self._adapters = {req.lora_request.lora_int_id for req in running if req.lora_request is not None}
        self._passed_over = False

    def admits(self, req: Request) -> bool:
        """Whether `req` may start this step; passing it over is recorded."""
        lora = req.lora_request
        if lora is None:
            return True
        if lora.lora_int_id in self._adapters:
            return self._steps_passing_over < PATIENCE_STEPS
        if len(self._adapters) < self.max_loras:
            self._adapters.add(lora.lora_int_id)
            return True
        self._passed_over = True
        return False

    def end(self) -> None:
        """Close the step's admissions (counting the steps in a row that passed a request over)."""
        self._steps_passing_over = self._steps_passing_over + 1 if self._passed_over else 0


def adapter_names(requests: dict[str, Request]) -> tuple[list[str], list[str]]:
    """The adapters of the running requests and of the others (waiting or preempted), by name."""
    running: set[str] = set()
    waiting: set[str] = set()
    for req in requests.values():
        if req.lora_request is not None:
            (running if req.status == RequestStatus.RUNNING else waiting).add(req.lora_request.lora_name)
    return sorted(running), sorted(waiting)
