"""What one `Scheduler.schedule()` call has decided so far: the tokens each request takes from the
step's budget, its new blocks, its drafts and the image encoding its chunk may start."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..kv import KVCacheManager
from ..multimodal.budget import EncoderBudget
from ..request import Request
from ..step_messages import CachedRequestData, NewRequestData


@dataclass
class StepPlan:
    budget: int
    # The image encoding the step's chunks may start (`corectl.multimodal.budget`).
    encoder: EncoderBudget
    # The most requests this step may hold (pipeline parallelism's micro-batches), None: no cap.
    max_seqs: int | None = None
    num_scheduled: dict[str, int] = field(default_factory=dict)
    running: dict[str, tuple[Request, list[int]]] = field(default_factory=dict)
    new: list[Request] = field(default_factory=list)
    preempted: bool = False
    # Draft tokens of speculating requests, the last of their scheduled tokens.
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # Prompts this step leaves unfinished, and how many of them are long (`PrefillLimits`).
    partial_prefills: int = 0
    long_partial_prefills: int = 0

    @property
    def full(self) -> bool:
        return self.budget <= 0 or (self.max_seqs is not None and len(self.num_scheduled) >= self.max_seqs)

    def take(self, req: Request, num_tokens: int) -> None:
        self.num_scheduled[req.request_id] = num_tokens
        self.budget -= num_tokens

    def drop(self, req: Request) -> None:
        """Undo scheduling a running request that is preempted later in the same step."""
        self.budget += self.num_scheduled.pop(req.request_id, 0)
        self.running.pop(req.request_id, None)
        self.drafts.pop(req.request_id, None)

    def known_tokens(self, req: Request) -> int:
        """The request's tokens this step computes before its drafts."""
        return self.num_scheduled[req.request_id] - len(self.drafts.get(req.request_id, ()))

    def new_request_data(self, kv: KVCacheManager) -> list[NewRequestData]:
        """What the workers learn of the requests this step starts (counts before this step)."""
        return [
            NewRequestData(
                req_id=req.request_id,
                token_ids=list(req.all_token_ids),
                num_prompt_tokens=req.num_prompt_tokens,
                sampling_params=req.sampling_params,
                block_ids=kv.block_ids(req),
                num_computed_tokens=req.num_computed_tokens,
                sample_index=req.sample_index,
                lora_request=req.lora_request,
                mm_inputs=req.mm_inputs,
            )
            for req in self.new
        ]

    def cached_request_data(self, running: list[Request], with_token_ids: bool) -> CachedRequestData:
        """The continuing requests' (`running`, in `self.running`'s order) new blocks and counts; with
        `with_token_ids` (pipeline stages, which never see the sampled ids) the tokens each computes."""
        return CachedRequestData(
            req_ids=list(self.running),
            new_block_ids=[ids for _, ids in self.running.values()],
            num_computed_tokens=[req.num_computed_tokens for req in running],
            new_token_ids=[] if not with_token_ids else [
                req.all_token_ids[req.num_computed_tokens:req.num_computed_tokens + self.num_scheduled[req.request_id]]
                for req in running],
        )
