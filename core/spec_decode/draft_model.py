"""Draft-model proposals: a small causal LM with the target's vocabulary runs k tokens ahead.

The scheduler reserves a verify step's draft positions with placeholders (`config.PLACEHOLDER`, as many
as the request may draft); the worker fills them here before building the step's inputs. The
draft runs greedily through an ordinary `ModelRunner` of its own (the same input building,
attention backend and sampler as the target), driven by synthetic `SchedulerOutput`s: one step
catches the draft's K/V up with the request's tokens and proposes d_0, then one single-token
step per further draft. A greedy proposal is deterministic, so verification treats it as a
one-hot q, exactly as an n-gram draft (rejection sampling stays exact for every target setting).

The draft's K/V lives in its own paged cache owned by this proposer (not the target's block
pool): as many blocks as the target's plus one per sequence slot, so it never runs out before the
target does; a request's draft blocks are freed when the target forgets it (finished, aborted,
preempted). K/V is kept for the request's known tokens; positions written by drafts are
recomputed from the accepted tokens at the next proposal.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError, ModelNotFoundError
from ..loaders.resolve import resolve_model_source
from ..loaders.source import ModelSource
from ..sampling_params import SamplingParams
from ..step_messages import CachedRequestData, NewRequestData, SchedulerOutput
from ..tokenizer import Tokenizer
from .config import FIELD, draft_engine_config

if TYPE_CHECKING:
    from ..worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def draft_source(config, **changes) -> ModelSource:
    """The draft model's or EAGLE head's source (`draft_engine_config`, `changes` on top); a path
    or id that resolves to nothing is the speculative config's error, named as such."""
    try:
        return resolve_model_source(draft_engine_config(config, **changes))
    except ModelNotFoundError as exc:
        raise ConfigError(FIELD, f"the draft model or head: {exc}") from None


def check_draft_vocabulary(draft: str, draft_vocab: int, target: str, target_vocab: int) -> None:
    """Refuse a draft model whose vocabulary is not the target's, naming both sides."""
    if draft_vocab != target_vocab:
        raise ConfigError(FIELD, f"the draft model {draft!r} has a {draft_vocab}-token vocabulary but "
                          f"the target {target!r} has {target_vocab}: a draft must share the target's vocabulary")


def check_draft_tokenizer(draft: str, draft_dir: Path | None, target: str, target_dir: Path | None) -> None:
    """Refuse a draft whose tokenizer gives an id another token than the target's does: a vocabulary
    of the same size is not the same vocabulary, and every draft of such a model would be rejected.
    Nothing to compare without a tokenizer on either side (a shape preset, --skip-tokenizer-init)."""
    if draft_dir is None or target_dir is None or Path(draft_dir).resolve() == Path(target_dir).resolve():
        return
    try:
        drafts = Tokenizer.from_dir(draft_dir).hf.get_vocab()
    except ModelNotFoundError:
        return
    by_id = {token_id: token for token, token_id in drafts.items()}
    targets = Tokenizer.from_dir(target_dir).hf.get_vocab()
    for token, token_id in sorted(targets.items(), key=lambda item: item[1]):
        theirs = by_id.get(token_id)
        if theirs is not None and theirs != token:
            raise ConfigError(FIELD, f"the draft model {draft!r} has another tokenizer than the target {target!r}: "
                              f"token {token_id} is {theirs!r} in the draft's and {token!r} in the target's; a draft "
                              "must share the target's tokenizer")


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """A request to draft for: its known tokens (prompt and output) and how many drafts it takes."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_drafts: int


class DraftModelProposer:
    """Owns the draft's runner, its KV blocks and, per request, how many tokens its K/V holds."""

    def __init__(self, runner: ModelRunner, block_size: int):
        self.runner = runner
        self.block_size = block_size
        self._free: list[int] = []
        self._blocks: dict[str, list[int]] = {}
        self._computed: dict[str, int] = {}
        self._forgotten: list[str] = []
        # Per request, where its last drafts began and what they were (`last_proposal`).
        self._proposed: dict[str, tuple[int, list[int]]] = {}

    def set_kv_caches(self, kv_caches: list, num_blocks: int) -> None:
        """The draft's cache tensors, `num_blocks` blocks each (block 0 is the null block)."""
        self.runner.set_kv_caches(kv_caches)
        self._free = list(range(num_blocks - 1, 0, -1))

    def forget(self, req_ids: Iterable[str]) -> None:
        """The target forgot these requests: their draft blocks return to the pool."""
        for req_id in req_ids:
            self._free += self._blocks.pop(req_id, [])
            self._proposed.pop(req_id, None)
            if self._computed.pop(req_id, None) is not None:
                self._forgotten.append(req_id)

    def observe(self, host, hidden: torch.Tensor, states) -> torch.Tensor:
        """A target step's hidden states, returned as they are: a draft model reads only tokens."""
        return hidden

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Each request's drafts; a request the cache has no room for gets copies of its last
        token (verification rejects what the target does not want, so any proposal is safe)."""
        drafts = {r.req_id: [r.token_ids[-1]] * r.num_drafts for r in requests}
        self._proposed.update((r.req_id, (len(r.token_ids), drafts[r.req_id])) for r in requests)
        room = [r for r in requests if self._reserve(r)]
        if not room:
            return drafts
        new = [NewRequestData(req_id=r.req_id, token_ids=r.token_ids, num_prompt_tokens=r.num_prompt_tokens,
                              sampling_params=_GREEDY, block_ids=list(self._blocks[r.req_id]),
                              num_computed_tokens=self._computed.get(r.req_id, 0)) for r in room]
        scheduled = {r.req_id: len(r.token_ids) - self._computed.get(r.req_id, 0) for r in room}
        forgotten, self._forgotten = self._forgotten, []
        step = SchedulerOutput(new, CachedRequestData(), scheduled, sum(scheduled.values()), forgotten)
        for position in range(max(r.num_drafts for r in room)):
            if position:
                ahead = [r for r in room if r.num_drafts > position]
                step = SchedulerOutput([], CachedRequestData(
                    req_ids=[r.req_id for r in ahead], new_block_ids=[[] for _ in ahead],
                    num_computed_tokens=[len(r.token_ids) + position - 1 for r in ahead],
                ), {r.req_id: 1 for r in ahead}, len(ahead), [])
            out = self.runner.execute_model(step)
            for req_id, token in zip(out.req_ids, out.sampled_token_ids):
                drafts[req_id][position] = token
        for r in room:
            self._computed[r.req_id] = len(r.token_ids)
        return drafts

    def last_proposal(self, req_id: str) -> tuple[int, list[int]]:
        """(position of the first draft, the drafts) of the request's latest proposal; (0, []) before
        any. Under pipeline stages the first stage restores the accepted ones from it."""
        return self._proposed.get(req_id, (0, []))

    def _reserve(self, request: DraftRequest) -> bool:
        """Blocks for the request's tokens and all but its last draft (never fed to the draft)."""
        held = self._blocks.setdefault(request.req_id, [])
        needed = -(-(len(request.token_ids) + request.num_drafts - 1) // self.block_size) - len(held)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            held.append(self._free.pop())
        return True
