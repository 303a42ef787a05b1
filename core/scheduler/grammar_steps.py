"""Structured outputs in the scheduler's steps (the grammars themselves live in
`corectl/structured/manager.py`).

A constrained request waits in the queue until its grammar has compiled, each step carries the masks
of the constrained rows it samples, and every token a constrained request accepts advances its
grammar, which ends the request when it terminates. A mask needs the request's previous token. Under
synchronous scheduling the step carries its masks. Under async scheduling (`defer`) the previous
token may still be in flight, so the step only says its masks are pending (`grammar_pending`): the
engine launches the forward pass, reads the step before, and then hands the worker
`pending_bitmask()`, filled while the device runs the forward pass (vLLM's split of forward and
sampling). A request that reasons before its grammar (a `ReasoningGate`) is one of those requests
while it thinks: any token in flight may be the end marker that makes the next one constrained, and
the manager decides at fill time whether it gets a row.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..request import Request, RequestStatus
from ..step_messages import GrammarBitmask
from .inflight import StepsInFlight
from .step_plan import StepPlan

if TYPE_CHECKING:
    from ..structured.manager import StructuredOutputManager

logger = logging.getLogger("corectl.scheduler")


class GrammarSteps:
    """The scheduler's side of structured outputs: which rows of a step carry masks, when they are
    filled, and how a step's tokens advance (or end) each constrained request."""

    def __init__(self, structured: StructuredOutputManager | None, defer: bool, in_flight: StepsInFlight):
        self.structured = structured
        self.defer = defer
        self.in_flight = in_flight
        # The constrained requests the last step samples for, when its masks are pending.
        self._rows: list[Request] = []
        # Their drafts (speculative decoding): each gets a mask row per verified position.
        self._drafts: dict[str, list[int]] = {}

    def holds(self, req: Request) -> bool:
        return self.structured is not None and req in self.structured

    def compiling(self, req: Request) -> bool:
        return self.holds(req) and not self.structured.ready(req)

    def may_draft(self, req: Request, proposes_drafts: bool) -> bool:
        """Whether speculation serves the request: under a grammar only with drafts the scheduler
        proposes (n-gram), which the matcher checks, and a matcher that rolls back."""
        return not self.holds(req) or (proposes_drafts and self.structured.can_draft(req))

    def valid_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        """The drafts cut before the first one the request's grammar refuses."""
        return self.structured.valid_drafts(req, drafts) if drafts and self.holds(req) else drafts

    def for_step(self, scheduled: list[Request], plan: StepPlan) -> tuple[GrammarBitmask | None, bool]:
        """The step's masks, or (None, True) when they are left pending (see the module doc)."""
        rows = self._rows_of(scheduled, plan)
        pending = self.defer and bool(rows)
        self._rows = rows if pending else []
        self._drafts = plan.drafts if pending else {}
        return (self.structured.bitmask(rows, plan.drafts) if rows and not pending else None), pending

    def _rows_of(self, scheduled: list[Request], plan: StepPlan) -> list[Request]:
        """The constrained requests this step samples for (counts before the step; a token in
        flight is one the step computes)."""
        if self.structured is None or not self.structured.constrained:
            return []
        return [req for req in scheduled if req in self.structured
                and req.num_computed_tokens + plan.known_tokens(req) == req.num_tokens + self.in_flight.num_tokens(req)]

    def pending_bitmask(self) -> GrammarBitmask | None:
        """The masks of the last scheduled step's constrained rows, once the step before it has been
        read (`Scheduler.update`): each matcher has then accepted every token before the one this
        step samples. None when no row needs one (requests that finished meanwhile, or think unbounded)."""
        rows, self._rows = self._rows, []
        drafts, self._drafts = self._drafts, {}
        return self.structured.bitmask(rows, drafts)

    def append(self, req: Request, token_ids: list[int], rows: range, max_model_len: int) -> tuple[int, str | None]:
        """Append the request's tokens of this step (`token_ids[rows]`: one, or a verify step's
        accepted drafts and the token after them) up to the first that ends it (its length, a stop,
        its grammar); returns where the output ends and the grammar's reason when that aborts it."""
        error, rows = self.dead_end(req, rows)
        end = rows.start
        while end < rows.stop and not req.status.finished:
            token = token_ids[end]
            end += 1
            req.append_output_token(token)
            if len(req.all_token_ids) >= max_model_len:
                req.status = RequestStatus.FINISHED_LENGTH
            elif not self.ends(req, token):
                req.check_stop()
        if error is not None and not req.status.finished:
            req.status = RequestStatus.FINISHED_ABORTED
        elif error is not None:
            error = None  # it ended before the row that allowed nothing
        return end, error

    def dead_end(self, req: Request, rows: range) -> tuple[str | None, range]:
        """Whether the request's grammar allowed no token at one of the rows it sampled from this
        step: the reason it ends, and the tokens before that row (the one sampled from the
        unmasked row is not output). A dead row past the verdict's last (a rejected draft's) is none."""
        error = None if self.structured is None else self.structured.dead_end(req)
        if error is None:
            return None, rows
        position = self.structured.dead_end_row(req)
        if position >= len(rows):
            return None, rows
        return error, range(rows.start, rows.start + position)

    def ends(self, req: Request, token: int) -> bool:
        """Advance a constrained request's grammar: it ends the request when it terminates (a stop,
        whatever min_tokens says: the output must stay valid), or aborts it on a token it refuses."""
        if not self.holds(req):
            return False
        if not self.structured.accept(req, token):
            logger.warning("request %s sampled token %d, which its grammar refuses; aborting it", req.request_id, token)
            req.status = RequestStatus.FINISHED_ABORTED
        elif self.structured.is_terminated(req):
            req.status = RequestStatus.FINISHED_STOPPED
        return req.status.finished
