"""A verify step's sampling: the target's logits at every drafted position, processed exactly as
the plain sampler processes one row (logit_bias, min_tokens, penalties, temperature, top-k/p,
min-p: `corectl.sample.sampler.target_logits`), then rejection sampling (`rejection.py`).

Row j of a request stands where its drafts d_0..d_{j-1} have been accepted, so its penalty and
min_tokens history is the request's output followed by those drafts: each row sees exactly the
history it would have had without speculation. A rejected draft never enters any history the
host keeps. Logprobs come from each emitted position's raw or processed logits (the sampler's
`logprobs_mode`), as without speculation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sample.logprobs import LogprobsTensors, gather_logprobs
from ..sample.metadata import SamplingMetadata
from ..sample.sampler import Sampler, processed_and_reported
from ..sampling_params import SamplingParams
from .rejection import Verified, VerifyLayout, rejection_sample


@dataclass(frozen=True, slots=True)
class VerifyRows:
    """The per-row inputs of `SamplingMetadata.build` for a verify step's flat rows, and each
    request's first row."""

    params: list[SamplingParams]
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    generators: list[torch.Generator | None]
    first_rows: list[int]


def expand_rows(params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                outputs: Sequence[Sequence[int]], generators: Sequence[Sequence[torch.Generator] | None],
                drafts: Sequence[Sequence[int]]) -> VerifyRows:
    """One row per verified position: request i's k_i + 1 rows share its parameters and prompt;
    row j's output history ends with the request's first j drafts, and it draws from `generators[i][j]`,
    seeded for its own output position (None: an unseeded request)."""
    rows = VerifyRows([], [], [], [], [])
    for p, prompt, output, generator, draft in zip(params, prompts, outputs, generators, drafts):
        rows.first_rows.append(len(rows.params))
        for j in range(len(draft) + 1):
            rows.params.append(p)
            rows.prompt_token_ids.append(prompt)
            rows.output_token_ids.append([*output, *draft[:j]] if j else output)
            rows.generators.append(None if generator is None else generator[j])
    return rows


def verify(logits: torch.Tensor, meta: SamplingMetadata, layout: VerifyLayout,
           sampler: Sampler) -> tuple[Verified, LogprobsTensors | None]:
    """Verify a step's drafts from the target's fp32 `logits` `[T, V]` (modified in place);
    `meta` holds one row per flat row (`expand_rows`). Tokens are drawn, and logprobs reported,
    as `sampler` samples a plain step."""
    processed, reported = processed_and_reported(logits, meta, sampler.logprobs_mode)
    random = meta.random
    verified = rejection_sample(
        processed, layout, greedy_rows=None if random is None else random.greedy_rows, all_greedy=random is None,
        generators={} if random is None else random.generators, draw=sampler.draw, race=sampler.race,
    )
    if reported is None:
        return verified, None
    return verified, gather_logprobs(reported, verified.row_token_ids, meta.max_num_logprobs)
