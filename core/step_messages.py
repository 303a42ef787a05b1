"""Every type that crosses the scheduler<->worker boundary, in-process or to a rank's process.

What the scheduler hands the worker each step (`SchedulerOutput`) and what the step gives back
(`ModelRunnerOutput`). They sit below both (and below the sampler, the grammar manager and the
executors that carry them), so none of those imports another's package for a message type.

`SchedulerOutput` carries diffs, as vLLM V1 does: a request travels in full once
(`NewRequestData`, also after a preemption), afterwards only its new block ids and computed-token
count, so a worker may live in another process and keep its own per-request state.
"""
from __future__ import annotations

import itertools

import msgspec

from .lora.request import LoRARequest
from .multimodal.inputs import MultiModalInput
from .sampling_params import SamplingParams

# -- scheduler -> worker -----------------------------------------------------------------------


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    sample_index: int = 0
    lora_request: LoRARequest | None = None
    mm_inputs: list[MultiModalInput] = []


class CachedRequestData(msgspec.Struct, array_like=True, gc=False):
    """Running requests a step continues. `new_token_ids` (pipeline parallelism only, else empty):
    each request's tokens this step computes that the host knows (a token still in flight is left
    out: the first stage takes it on the device), since the stages before the last never read the
    ids the last one samples (vLLM's field of the same name)."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []
    new_token_ids: list[list[int]] = []


class GrammarBitmask(msgspec.Struct, array_like=True, gc=False):
    """Which tokens each constrained request of a step may sample next: row i of `bitmask` is
    request `req_ids[i]`'s, int32 words in xgrammar's layout (bit `t % 32` of word `t // 32` set
    when token `t` is allowed), `width` words a row, as little-endian bytes. In a verify step
    `num_rows[i]` consecutive rows are request i's, one per verified position (empty: one each)."""

    req_ids: list[str]
    width: int
    bitmask: bytes
    num_rows: list[int] = []


class KVBlockTransfer(msgspec.Struct, array_like=True, gc=False):
    """Blocks a KV connector moves for one request (`corectl.kv_transfer`): `block_ids` are this
    instance's device blocks; the other end is named by `transfer_id` and `first_block` (the index
    of the first of them in the saved run: a disaggregated transfer) or by `keys` (one per block:
    a host tier's slots)."""

    req_id: str
    block_ids: list[int]
    transfer_id: str = ""
    first_block: int = 0
    keys: list[int] = []


class KVTransferMetadata(msgspec.Struct, array_like=True, gc=False):
    """One step's KV-connector work, done by the worker before the step's forward pass: `saves`
    copy blocks out (their K/V is read before anything this step writes), `loads` copy blocks in
    (synchronous ones before this forward pass, asynchronous ones reported done in a later step),
    `cancelled` names asynchronous loads whose request has gone (their blocks may be reused)."""

    saves: list[KVBlockTransfer] = []
    loads: list[KVBlockTransfer] = []
    cancelled: list[str] = []


class KVTransferReport(msgspec.Struct, array_like=True, gc=False):
    """What a worker's KV connector finished since its last report: asynchronous loads done
    (`loaded`, with the bytes they brought) or failed (`failed`: the request's block ids that hold
    no valid K/V; it recomputes from the first)."""

    loaded: list[str] = []
    failed: dict[str, list[int]] = {}
    bytes_loaded: int = 0


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False):
    """One step's work. `num_computed_tokens` values are counts *before* this step's tokens.

    `finished_req_ids` lists requests the worker must forget (finished, aborted or preempted
    since the previous step); a preempted request comes back later as a new request.
    `grammar_bitmask` masks the logits of the rows that sample under a grammar this step;
    `grammar_pending`: those masks come after the launch, and the worker samples this step only
    once they arrive (async scheduling: see `Executor.sample_pending`).
    `spec_token_ids` holds the draft tokens of speculating requests (speculative decoding): the
    last of their scheduled tokens, verified by the step (`corectl.spec_decode`).
    `kv_transfer` is the step's KV-connector work; set whenever a connector has anything under
    way, so the worker polls it even on a step that computes nothing.
    `encoder_evicted` names the images the scheduler evicted from the worker's encoder cache
    (`corectl.multimodal.cache_manager`): the worker drops them before the step runs.
    """

    new_requests: list[NewRequestData]
    cached_requests: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]
    grammar_bitmask: GrammarBitmask | None = None
    grammar_pending: bool = False
    spec_token_ids: dict[str, list[int]] = {}
    kv_transfer: KVTransferMetadata | None = None
    encoder_evicted: list[str] = []

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# -- worker -> scheduler -----------------------------------------------------------------------


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
    `kv_transfer` reports the KV connector's finished transfers (None without a connector).
    """

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: LogprobsLists | None = None
    prompt_logprobs: dict[str, LogprobsLists] = {}
    pooled: dict[str, bytes] = {}
    num_sampled: list[int] = []
    kv_transfer: KVTransferReport | None = None

    def token_rows(self) -> list[range]:
        """The rows of `sampled_token_ids` (and `logprobs`) of each request, in `req_ids` order."""
        if not self.num_sampled:
            return [range(row, row + 1) for row in range(len(self.req_ids))]
        ends = list(itertools.accumulate(self.num_sampled))
        return [range(end - count, end) for end, count in zip(ends, self.num_sampled)]
