"""What callers receive: vLLM-shaped RequestOutput / CompletionOutput, and EmbeddingRequestOutput
from a pooling engine."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per position: token id -> Logprob, the chosen token first.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Why the engine ended the sample as "abort" when the request itself was at fault (its grammar
    # did not compile, overran the compile bound, or allowed no token): a client error (400), not
    # an overload.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    # When each step's tokens arrived (one entry a step and sample that got tokens), and how many of
    # them came with the latest delta (several steps' where a stream interval held them back).
    token_times: list[float] = field(default_factory=list)
    delta_token_times: int = 0


def num_token_ids(samples: list) -> int:
    """The token ids of `samples` (anything with `token_ids`) together."""
    # The common case kept cheap: a stream counts every delta, several times.
    return len(samples[0].token_ids) if len(samples) == 1 else sum(len(s.token_ids) for s in samples)


@dataclass
class RequestOutput:
    """One user request. In streaming (delta) mode each output carries only what is new since the
    previous one; otherwise texts and token ids are cumulative."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    @property
    def num_tokens(self) -> int:
        """The token ids this output carries over its samples (a delta's: the new ones)."""
        return num_token_ids(self.outputs)


@dataclass
class EmbeddingOutput:
    """One prompt's embedding, truncated and normalised as its request asked (vLLM's shape)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """A pooling engine's answer to one prompt (vLLM's `EmbeddingRequestOutput`), delivered once,
    finished. `finish_reason` is "stop", or "abort" (with an empty embedding) when the engine
    could not take the request (its queue was full)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    finish_reason: str | None = "stop"
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
