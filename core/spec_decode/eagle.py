"""EAGLE / EAGLE-3 proposals: a one-layer head over the target's hidden states runs k tokens ahead.

Head position p takes the token at p + 1 and the target's hidden state at p (its final one for
EAGLE, three layers' inputs for EAGLE-3: `eagle_heads.py`), and its output predicts the token at
p + 2. So after each target step the runner hands over the rows it computed (`observe`); the head
runs over every position whose next token is known then (a prompt's, a decode step's previous
one), which keeps its K/V level with the target's and holds back only the rows of the newest
positions. A verify step's rows wait for the verdict: when the scheduler asks for drafts
(`propose`), the accepted ones and the newest token are known, the head catches up to the
request's last position and proposes d_0 from it, then runs one token a step on its own output
(the drafted token and the head's hidden state) for d_1..d_{k-1}. Positions written by those
steps and by rejected drafts are written again from the target's rows on the next pass.

The head's K/V lives in its own paged cache owned by this proposer, like a draft model's
(`draft_model.py`): one layer, as many blocks as the target's plus one per sequence slot, freed
when the target forgets the request. A request whose prompt came partly from the prefix cache
has no target rows for the cached positions: the head's own positions start at its first
computed one (`_Track.base`; rotary attention depends only on distances). Drafts are greedy and
verified as one-hot proposals, so nothing here can change what the target emits.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import ForwardContext
from ..sampling_params import SamplingParams
from ..step_messages import CachedRequestData, NewRequestData, SchedulerOutput
from .draft_model import DraftRequest

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class _Track:
    """What the head holds of one request: K/V for target positions [base, base + done) in
    `blocks`, and the target's rows for the next positions, from base + done on (`pending`)."""

    base: int
    done: int
    blocks: list[int]
    pending: torch.Tensor

    @property
    def end(self) -> int:
        """The first target position the head has not run."""
        return self.base + self.done


class EagleProposer:
    """Owns the head, its runner's paged cache and, per request, a `_Track`. `runner` is a
    `ModelRunner` over the head (its request states, uploads and attention backend; the head's
    forward takes hidden states, so the runner's own step is not used); `target` lends its
    embedding and, for EAGLE, its LM head; `hidden_size` is the target's."""

    def __init__(self, runner, target: nn.Module, hidden_size: int, block_size: int):
        self.runner = runner
        self.head = runner.model
        self.target = target
        self.hidden_size = hidden_size
        self.block_size = block_size
        self._free: list[int] = []
        self._tracks: dict[str, _Track] = {}
        self._forgotten: list[str] = []

    def set_kv_caches(self, kv_caches: list, num_blocks: int) -> None:
        """The head's cache tensors, `num_blocks` blocks each (block 0 is the null block)."""
        self.runner.set_kv_caches(kv_caches)
        self.forget(list(self._tracks))
        self._free = list(range(num_blocks - 1, 0, -1))

    def forget(self, req_ids: Iterable[str]) -> None:
        """The target forgot these requests: their head blocks return to the pool."""
        for req_id in req_ids:
            track = self._tracks.pop(req_id, None)
            if track is not None:
                self._free += track.blocks
                self._forgotten.append(req_id)

    @torch.inference_mode()
    def observe(self, host, out: torch.Tensor, states) -> torch.Tensor:
        """Take a target step's rows (`out`: the forward's output, with the EAGLE-3 layers after the
        final hidden states) and run the head over the positions whose next token is now known;
        returns the final hidden states, which the runner samples from."""
        hidden = out[:, : self.hidden_size]
        # EAGLE-3's three layers follow the final hidden states; EAGLE reads the final ones.
        rows = out[:, self.hidden_size:] if out.shape[1] > self.hidden_size else out
        ready = {}
        for req_id, first_row, count in zip(host.req_ids, host.query_starts, host.query_lens):
            track = self._append(req_id, int(host.positions[first_row]), rows[first_row: first_row + count])
            token_ids = states[req_id].token_ids
            upto = min(len(token_ids) - 1, track.end + track.pending.shape[0])
            if upto > track.end and self._reserve(req_id, upto):
                ready[req_id] = (token_ids, upto)
        if ready:
            self._extend(ready, draft=False)
        for req_id in host.req_ids:
            # The rows left are views of the step's output, which a replayed CUDA graph overwrites.
            if req_id in self._tracks:
                self._tracks[req_id].pending = self._tracks[req_id].pending.clone()
        return hidden

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Each request's drafts. One whose newest position's target row the head lacks, or whose
        blocks cannot be had, gets copies of its last token (verification rejects what the target
        does not want, so any proposal is safe)."""
        drafts = {r.req_id: [r.token_ids[-1]] * r.num_drafts for r in requests}
        room = [r for r in requests if r.num_drafts and self._can_draft(r)
                and self._reserve(r.req_id, len(r.token_ids) + r.num_drafts - 2)]
        if not room:
            return drafts
        tokens, hidden = self._extend({r.req_id: (r.token_ids, len(r.token_ids) - 1) for r in room}, draft=True)
        steps, current = [(room, tokens)], room
        for position in range(1, max(r.num_drafts for r in room)):
            ahead = [r for r in current if r.num_drafts > position]
            if len(ahead) < len(current):
                keep = [i for i, r in enumerate(current) if r.num_drafts > position]
                index = torch.tensor(keep, device=tokens.device)
                tokens, hidden = tokens.index_select(0, index), hidden.index_select(0, index)
            tokens, hidden = self._step(ahead, tokens, hidden, position)
            steps.append((ahead, tokens))
            current = ahead
        # One read back for every draft of the step.
        values = iter(torch.cat([t for _, t in steps]).tolist())
        for position, (batch, _) in enumerate(steps):
            for r in batch:
                drafts[r.req_id][position] = next(values)
        return drafts

    def _can_draft(self, request: DraftRequest) -> bool:
        track = self._tracks.get(request.req_id)
        newest = len(request.token_ids) - 2
        return track is not None and track.end <= newest < track.end + track.pending.shape[0]

    def _append(self, req_id: str, start: int, rows: torch.Tensor) -> _Track:
        """Rows for target positions start.. join the request's pending rows, in place of any
        the step computed again (a verify step's rejected positions)."""
        track = self._tracks.get(req_id)
        if track is None or start < track.base or start > track.end + track.pending.shape[0]:
            track = self._tracks[req_id] = _Track(start, 0, [] if track is None else track.blocks, rows)
        elif start < track.end:
            track.done, track.pending = start - track.base, rows
        else:
            track.pending = torch.cat([track.pending[: start - track.end], rows])
        return track

    def _reserve(self, req_id: str, num_positions: int) -> bool:
        """Blocks for target positions below `num_positions`; a request that cannot have them is
        dropped (the head starts it again from its next rows)."""
        track = self._tracks[req_id]
        needed = -(-(num_positions - track.base) // self.block_size) - len(track.blocks)
        if needed > len(self._free):
            self.forget([req_id])
            return False
        for _ in range(needed):
            track.blocks.append(self._free.pop())
        return True

    def _extend(self, upto: dict[str, tuple[list[int], int]],
                draft: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run the head over each request's pending positions below its `upto` (given with the
        request's tokens; each position's next token must be among them), from the target's rows.
        With `draft`, returns per request in order the greedy draft from its last position and
        the head's hidden state there."""
        new, scheduled, rows = [], {}, []
        for req_id, (token_ids, end) in upto.items():
            track = self._tracks[req_id]
            count = end - track.end
            # Head position q holds target position base + q, whose input token is the one after it.
            new.append(NewRequestData(req_id=req_id, token_ids=token_ids[track.base + 1: end + 1],
                                      num_prompt_tokens=end - track.base, sampling_params=_GREEDY,
                                      block_ids=list(track.blocks), num_computed_tokens=track.done))
            scheduled[req_id] = count
            rows.append(track.pending[:count])
            track.pending, track.done = track.pending[count:], track.done + count
        forgotten, self._forgotten = self._forgotten, []
        sched = SchedulerOutput(new, CachedRequestData(), scheduled, sum(scheduled.values()), forgotten)
        self.runner.states.apply(sched)
        return self._run(sched, None, torch.cat(rows), from_target=True, draft=draft)

    def _step(self, ahead: list[DraftRequest], tokens: torch.Tensor, hidden: torch.Tensor,
              position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: each request's previous draft and the head's hidden state after it."""
        computed = [len(r.token_ids) - 1 - self._tracks[r.req_id].base + position - 1 for r in ahead]
        ids = [r.req_id for r in ahead]
        sched = SchedulerOutput([], CachedRequestData(req_ids=ids, new_block_ids=[[] for _ in ids],
                                                      num_computed_tokens=computed),
                                {req_id: 1 for req_id in ids}, len(ids), [])
        self.runner.states.apply(sched)
        return self._run(sched, tokens, hidden, from_target=False, draft=True)

    def _run(self, sched: SchedulerOutput, input_ids: torch.Tensor | None, hidden: torch.Tensor,
             from_target: bool, draft: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head's forward over a step (`input_ids`: the drafted tokens on the device, None when
        the host holds them); with `draft`, the drafts and hidden states of each request's last
        row, after which the requests' states expect one more unread token: the next step's input."""
        runner = self.runner
        host = runner.states.build_step(sched, self.block_size, {})
        inputs = runner.upload(host)
        ids = inputs.input_ids if input_ids is None else input_ids
        metadata = runner.backend.build_metadata(inputs.attn, check_indices=False)
        ctx = ForwardContext(runner.backend, metadata, runner.kv_caches)
        for_logits, next_hidden = self.head(self.head.embed(ids, self.target), hidden, inputs.positions, ctx,
                                            from_target)
        if not draft:
            return None
        if inputs.logits_indices is not None:
            for_logits = for_logits.index_select(0, inputs.logits_indices)
            next_hidden = next_hidden.index_select(0, inputs.logits_indices)
        runner.states.expect_sampled([runner.states[req_id] for req_id in host.sample_req_ids])
        return self.head.draft_tokens(for_logits, self.target), next_hidden
