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


class BeamSearch:
    """The beams of a batch of prompts, advanced one step at a time by whoever runs the engine:
    `requests()` gives the token ids to send this step (empty once every beam is done), each as a
    one-token request with `step_params`; `advance` takes each one's logprobs, in the same order."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None):
        self.params = params
        self.eos_token_id = eos_token_id
        self.step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1,
                                          temperature=params.temperature)
        self.prompt_lengths = [len(prompt) for prompt in prompts]
        self._live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
        self._done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._steps = 0

    def requests(self) -> list[list[int]]:
        if self._steps >= self.params.max_tokens:
            return []
        return [beam.tokens for group in self._live for beam in group]

    def advance(self, positions: list[PositionLogprobs]) -> None:
        results = iter(positions)
        for index, group in enumerate(self._live):
            grown: list[BeamSearchSequence] = []
            for beam in group:
                position = next(results)
                for token, logprob in position.items():
                    child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [position],
                                               beam.cum_logprob + logprob.logprob)
                    if token == self.eos_token_id and not self.params.ignore_eos:
                        child.finish_reason = "stop"
                        self._done[index].append(child)
                    else:
                        grown.append(child)
            self._live[index] = _best(grown, self.params, self.eos_token_id)
        self._steps += 1

    def results(self, decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
        """Each prompt's best beams; `decode` (None without a tokenizer) gives each its text."""
        outputs = []
        for index, group in enumerate(self._live):
            for beam in group:
                beam.finish_reason = "length"
            best = _best(self._done[index] + group, self.params, self.eos_token_id)
            for beam in best:
                beam.text = None if decode is None else decode(beam.tokens)
            outputs.append(BeamSearchOutput(best))
        return outputs


def run_beam_search(generate: Callable[[list[list[int]], SamplingParams], list[RequestOutput]],
                    prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
                    decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
    """Beam search driven by `generate`, which runs a batch of token-id prompts with one
    SamplingParams and returns their outputs in order."""
    search = BeamSearch(prompts, params, eos_token_id)
    while batch := search.requests():
        search.advance([out.outputs[0].logprobs[0] for out in generate(batch, search.step_params)])
    return search.results(decode)


def _best(beams: list[BeamSearchSequence], params: BeamSearchParams,
          eos_token_id: int | None) -> list[BeamSearchSequence]:
    ranked = sorted(beams, key=lambda b: beam_search_score(b.tokens, b.cum_logprob, eos_token_id,
                                                           params.length_penalty), reverse=True)
    return ranked[:params.beam_width]
