"""Logprobs of chosen tokens, their ranks and the top-k alternatives, kept on device until output."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..step_messages import LogprobsLists


def reported_values(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """The values a `corectl.config.LOGPROBS_MODES` mode reports for fp32 `logits` [N, V], in a
    tensor of their own (sampling goes on to change `logits` in place): log-softmax values for the
    *_logprobs modes, the logits themselves for *_logits. Raw modes pass the model's logits, processed
    ones those a row samples from (after logit_bias, min_tokens, penalties, allowed/bad words and, on
    random rows, temperature and top-k/top-p/min-p: a masked token at -inf)."""
    return logits.log_softmax(dim=-1) if mode.endswith("_logprobs") else logits.clone()


@dataclass(frozen=True, slots=True)
class LogprobsTensors:
    """Row i: column 0 is the chosen token, columns 1.. the K most likely tokens; `ranks[i]` is
    the chosen token's rank (1 = most likely; tokens tied with it count as above it)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def to_lists(self, num_per_row: list[int]) -> LogprobsLists:
        """Copy to the host, keeping `1 + num_per_row[i]` entries of row i."""
        rows, width = self.token_ids.shape
        if len(num_per_row) != rows:
            raise ValueError(f"num_per_row has {len(num_per_row)} entries for {rows} rows")
        if any(not 0 <= n < width for n in num_per_row):
            raise ValueError(f"each row holds at most {width - 1} top logprobs, asked for {num_per_row}")
        token_ids = self.token_ids.tolist()
        logprobs = self.logprobs.tolist()
        return LogprobsLists(
            token_ids=[ids[: 1 + n] for ids, n in zip(token_ids, num_per_row)],
            logprobs=[lps[: 1 + n] for lps, n in zip(logprobs, num_per_row)],
            ranks=self.ranks.tolist(),
        )


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Pick out `token_ids`' entries of `logprobs` [N, V] with their ranks and the `num_top` best."""
    chosen_ids = token_ids.unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)
    ranks = (logprobs >= chosen).sum(dim=-1)
    if num_top == 0:
        return LogprobsTensors(chosen_ids, chosen, ranks)
    top = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(
        torch.cat([chosen_ids, top.indices], dim=1), torch.cat([chosen, top.values], dim=1), ranks
    )


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprobs of each prompt position's next token `target_ids[i]` under `logits[i]` (fp32 [N, V])."""
    return gather_logprobs(logits.log_softmax(dim=-1), target_ids, k)
