"""Beam search over the engine, as vLLM V1 runs it (`LLM.beam_search`).

Each step sends every live beam (its prompt plus the tokens it chose) as a one-token request that
asks for the top `2 * beam_width` logprobs; each beam grows by each of those tokens, and the
`beam_width` best by cumulative logprob go on. A beam that ends in EOS is complete. The beams of a
prompt share its KV blocks through the prefix cache, so a step costs about one decode per beam.
Scores divide the cumulative logprob by the sequence length (prompt included, EOS not) to the
power `length_penalty`, as vLLM's `get_beam_search_score`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .errors import InvalidRequestError
from .outputs import PositionLogprobs, RequestOutput
from .sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`. `temperature` scales the logits each step's top tokens come from
    (0: the raw logits' order, the usual beam search)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidRequestError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}",
                                      param="beam_width")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the beam's, `logprobs` one dict per beam token."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None,
                      length_penalty: float) -> float:
    length = len(tokens) - (1 if eos_token_id is not None and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length ** length_penalty)


def run_beam_search(generate: Callable[[list[list[int]], SamplingParams], list[RequestOutput]],
                    prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
                    decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
    """`generate` runs a batch of token-id prompts with one SamplingParams; `decode` (None without a
    tokenizer) gives each finished sequence its text."""
    step = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature)
    live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        beams = [beam for group in live for beam in group]
        if not beams:
            break
        results = iter(generate([beam.tokens for beam in beams], step))
        for index, group in enumerate(live):
            grown: list[BeamSearchSequence] = []
            for beam in group:
                position = next(results).outputs[0].logprobs[0]
                for token, logprob in position.items():
                    child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [position],
                                               beam.cum_logprob + logprob.logprob)
                    if token == eos_token_id and not params.ignore_eos:
                        child.finish_reason = "stop"
                        done[index].append(child)
                    else:
                        grown.append(child)
            live[index] = _best(grown, params, eos_token_id)
    outputs = []
    for index, group in enumerate(live):
        for beam in group:
            beam.finish_reason = "length"
        best = _best(done[index] + group, params, eos_token_id)
        for beam in best:
            beam.text = None if decode is None else decode(beam.tokens)
        outputs.append(BeamSearchOutput(best))
    return outputs


def _best(beams: list[BeamSearchSequence], params: BeamSearchParams,
          eos_token_id: int | None) -> list[BeamSearchSequence]:
    ranked = sorted(beams, key=lambda b: beam_search_score(b.tokens, b.cum_logprob, eos_token_id,
                                                           params.length_penalty), reverse=True)
    return ranked[:params.beam_width]
