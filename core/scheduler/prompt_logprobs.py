"""Shaping the worker's logprobs into per-request pieces for EngineCoreOutput."""
from __future__ import annotations

from ..step_messages import LogprobsLists


def logprobs_rows(lists: LogprobsLists | None, start: int, stop: int) -> LogprobsLists | None:
    """The positions `start:stop` of a step's logprobs: the rows of one request's new tokens."""
    if lists is None:
        return None
    return LogprobsLists(token_ids=lists.token_ids[start:stop], logprobs=lists.logprobs[start:stop],
                         ranks=lists.ranks[start:stop])


class PromptLogprobsBuffer:
    """Prompt logprobs gathered over a chunked prefill, handed out with the request's first token.

    The worker reports each chunk's rows as it computes them; a request only produces output
    once its prefill ends, so the rows wait here until then.
    """

    def __init__(self) -> None:
        self._rows: dict[str, LogprobsLists] = {}

    def add(self, req_id: str, chunk: LogprobsLists) -> None:
        held = self._rows.get(req_id)
        if held is None:
            self._rows[req_id] = LogprobsLists(
                token_ids=list(chunk.token_ids), logprobs=list(chunk.logprobs), ranks=list(chunk.ranks)
            )
            return
        held.token_ids.extend(chunk.token_ids)
        held.logprobs.extend(chunk.logprobs)
        held.ranks.extend(chunk.ranks)

    def pop(self, req_id: str) -> LogprobsLists | None:
        """Take the request's rows (also used to drop them after a preemption or abort)."""
        return self._rows.pop(req_id, None)
