"""The scheduler's side of speculative decoding: which draft tokens a decoding request carries into
a step, and the `spec_decode_*` counters of what verification accepted.

n-gram drafts are proposed when a request is scheduled, from its own tokens; a draft model's are
reserved as placeholders that the worker fills (`draft_model.py`). Either way they travel in
`SchedulerOutput.spec_token_ids` as extra new tokens of the request: the target computes k + 1
positions through the ordinary paged prefill/extend path. A request's `num_computed_tokens`
advances by its one known token at scheduling and by the accepted drafts when the step's result
arrives, so a rejected draft's K/V slot is simply overwritten by the next step. Drafts are capped
so that every emitted token fits `max_tokens` and `max_model_len`. Under a grammar only n-gram
drafts are carried, cut where the grammar refuses them (`StructuredOutputManager.valid_drafts`;
see docs/speculative.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config import PLACEHOLDER, SpeculativeConfig
from .ngram import NgramProposer

if TYPE_CHECKING:
    from ..request import Request


class SpecDecodeCounters:
    """vLLM's `spec_decode_*` counters, cumulative: verified drafts (requests x steps that carried
    drafts), their draft tokens, the accepted ones, and acceptances by draft position."""

    def __init__(self, k: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


class DraftPlanner:
    """Proposes each decoding request's drafts for a step, within what it may still emit."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.k = config.num_speculative_tokens
        # A request drafts while its drafts and the token after them fit both lengths.
        self.max_model_len = min(max_model_len, config.max_model_len or max_model_len)
        self.disable_by_batch_size = config.disable_by_batch_size
        # None: a draft model in the worker proposes; the scheduler only reserves the positions.
        self.proposer = None if config.method != "ngram" else NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self.counters = SpecDecodeCounters(self.k)

    def drafts_allowed(self, num_running: int) -> bool:
        """Whether a step with this many running requests carries drafts (vLLM's disable_by_batch_size)."""
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    def drafts(self, req: Request, budget: int) -> list[int]:
        """Drafts for a request whose next step computes only its newest token: at most k, and
        at most what leaves room for the token verification adds after them (max_tokens,
        max_model_len) within the step's remaining token `budget`."""
        limit = min(self.k, budget - 1, req.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
        if self.proposer is None:
            return [PLACEHOLDER] * max(limit, 0)
        return self.proposer.propose(req, req.all_token_ids, limit)
