"""vLLM's bounds on prompts computed in chunks.

`long_prefill_token_threshold` T caps the tokens one step computes of any one request, so a long
prompt leaves room in the step's budget for others (vLLM V1's). With `max_num_partial_prefills`
above 1 (vLLM's concurrent partial prefills) at most that many prompts may stay unfinished after a
step, at most `max_long_partial_prefills` of them long (prompts over T): a long prompt that finds
those taken waits, and shorter prompts behind it go first. A request whose chunk finishes its
prompt never counts. Requests with images keep their chunks (an image's tokens may have to come
in one step), and an encoder-only model's prompts run whole.
"""
from __future__ import annotations

from ..config import EngineConfig
from ..request import Request
from .step_plan import StepPlan

# vLLM's threshold when concurrent partial prefills are on and none is given: 4% of the context.
DEFAULT_THRESHOLD_SHARE = 0.04


class PrefillLimits:
    def __init__(self, config: EngineConfig, max_model_len: int):
        self.max_partial = config.max_num_partial_prefills
        self.max_long = config.max_long_partial_prefills
        threshold = config.long_prefill_token_threshold
        if self.max_partial > 1 and threshold == 0:
            threshold = max(1, int(max_model_len * DEFAULT_THRESHOLD_SHARE))
        self.threshold = 0 if config.encoder_only else threshold

    def cap(self, req: Request, num_tokens: int) -> int:
        """The tokens of a chunk of `num_tokens` the step may compute for `req`."""
        if 0 < self.threshold < num_tokens and not req.mm_inputs:
            return self.threshold
        return num_tokens

    def occupy(self, req: Request, plan: StepPlan) -> None:
        """Count in `plan` a running prompt left unfinished that this step does not schedule (another
        micro-batch holds it, or its images wait): it keeps its place among the partial prefills."""
        if self.max_partial > 1:
            plan.partial_prefills += 1
            plan.long_partial_prefills += self._long(req)

    def admits(self, req: Request, partial: bool, plan: StepPlan) -> bool:
        """Whether `req` may run this step with a chunk that leaves its prompt unfinished (`partial`);
        counts it in `plan` when it may."""
        if not partial or self.max_partial == 1:
            return True
        full = plan.partial_prefills >= self.max_partial
        if full or (self._long(req) and plan.long_partial_prefills >= self.max_long):
            return False
        self.occupy(req, plan)
        return True

    def _long(self, req: Request) -> bool:
        return req.num_prompt_tokens > self.threshold
