"""What a step gives back to the scheduler (worker -> scheduler)."""
from __future__ import annotations

import itertools

import msgspec


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs for a run of positions: row i holds the chosen token first, then the top-k.

    `ranks[i]` is the chosen token's rank in the distribution (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False):
    """What a step produced: one sampled token for every request that reached the end of its tokens.

    Requests still in a partial (chunked) prefill produce no token and are absent from `req_ids`.
    `logprobs` rows align with `req_ids`; `prompt_logprobs` holds, per request, the logprobs of
    the prompt positions computed this step (position 0 has none and is skipped).
    `pooled` holds a pooling engine's vectors (raw, little-endian float32 bytes) for the requests
    whose prompt's last chunk ran this step; such an engine samples nothing.
    `num_sampled` (a verify step of speculative decoding) holds how many tokens each request
    emitted: `sampled_token_ids` and the `logprobs` rows are then every request's tokens, request
    after request. Empty: one token each.
    """

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: LogprobsLists | None = None
    prompt_logprobs: dict[str, LogprobsLists] = {}
    pooled: dict[str, bytes] = {}
    num_sampled: list[int] = []

    def token_rows(self) -> list[range]:
        """The rows of `sampled_token_ids` (and `logprobs`) of each request, in `req_ids` order."""
        if not self.num_sampled:
            return [range(row, row + 1) for row in range(len(self.req_ids))]
        ends = list(itertools.accumulate(self.num_sampled))
        return [range(end - count, end) for end, count in zip(ends, self.num_sampled)]
