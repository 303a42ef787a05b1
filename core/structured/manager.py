"""Structured outputs in the engine process: grammars compiled off the loop, one matcher per request,
one bitmask per step, its rows filled in one call to the backend.

The scheduler owns the manager and is its only caller. A request that asks for structured output
has its grammar compiled off the loop (`compiles.GrammarCompiles`: a small and a large lane, shared
by spec, cached within a byte bound; the backend itself is built on a lane thread the first time);
it stays in the waiting queue, skipped, until the grammar is ready, so it blocks no one. A compile
that fails, or that is still running `compile_timeout_s` after the request arrived, ends that
request with an error that says which limit applied.

Each request's matcher advances with every token the request accepts. Preemption recomputes K/V but
keeps the tokens, so the matcher stays where it is. Under async scheduling a step's masks are filled
after the step before it has been read, while the device runs the step's forward pass (see
`Scheduler`).

Speculative decoding: a constrained request whose matcher can roll back carries the drafts its
grammar accepts (`valid_drafts` cuts the rest before verification) and gets one mask row per
verified position, row j filled after the matcher has walked d_0..d_{j-1}; the matcher is rolled
back after each walk, so it only ever moves with the tokens the request accepts.

A grammar the backend could not prove empty may still reach a point where it allows no token
(a rule that never ends behind a prefix). Its row then allows every token, so the sampler never
sees an all-forbidden row, and the request is marked: the scheduler drops the token it samples and
ends the request with the reason (`dead_end`), a client error rather than an overload.

A request whose spec carries a `ReasoningGate` thinks first (`reasoning.GatePhase`): while it
thinks its row gets no mask and its matcher does not move; the end marker hands the next token to
the grammar. Its first token, when it may open the reasoning, may be the grammar's or the start
marker. The grammar is compiled and cached without the gate, which does not change it.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, wait

import msgspec
import numpy as np

from ..request import Request
from ..sampling_params import StructuredOutputsParams
from ..step_messages import GrammarBitmask
from .backend import GrammarMatcher, StructuredOutputBackend, bitmask_width
from .compiles import DEFAULT_CACHE_BYTES, Compile, GrammarCompiles
from .reasoning import GatePhase


class StructuredOutputManager:
    """`backend_cls` is built as `backend_cls(tokenizer_dir, vocab_size, stop_token_ids)` on first use."""

    def __init__(self, backend_cls: type[StructuredOutputBackend], tokenizer_dir: str, vocab_size: int,
                 stop_token_ids: list[int], compile_timeout_s: float, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self._backend_args = (tokenizer_dir, vocab_size, list(stop_token_ids))
        self._backend_cls = backend_cls
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self.compiles = GrammarCompiles(self._compile, lambda grammar: self._backend.grammar_bytes(grammar),
                                        cache_bytes)
        self.compile_timeout_s = compile_timeout_s
        self.width = bitmask_width(vocab_size)
        self._compiling: dict[Request, tuple[Compile, float]] = {}
        self._matchers: dict[Request, GrammarMatcher] = {}
        self._gates: dict[Request, GatePhase] = {}
        # Request -> (its first mask row, among the last step's, that allowed nothing; the reason).
        self._dead_ends: dict[Request, tuple[int, str]] = {}

    # -- requests in and out -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Start (or share) the compile of the request's grammar; the clock of its bound starts now."""
        spec = req.sampling_params.structured_outputs
        if spec.reasoning is not None:
            self._gates[req] = GatePhase(spec.reasoning)
            spec = msgspec.structs.replace(spec, reasoning=None)
        job = self.compiles.join(msgspec.json.encode(spec), spec)
        self._compiling[req] = (job, time.monotonic() + self.compile_timeout_s)

    def remove(self, req: Request) -> None:
        compiling = self._compiling.pop(req, None)
        if compiling is not None:
            self.compiles.leave(compiling[0])
        self._matchers.pop(req, None)
        self._gates.pop(req, None)
        self._dead_ends.pop(req, None)

    def __contains__(self, req: Request) -> bool:
        return req in self._matchers or req in self._compiling

    @property
    def constrained(self) -> Iterable[Request]:
        """The requests whose grammar is ready (they may be scheduled)."""
        return self._matchers.keys()

    def ready(self, req: Request) -> bool:
        """Whether the request's grammar has compiled (its matcher is made then)."""
        if req in self._matchers:
            return True
        job, _ = self._compiling[req]
        if not job.future.done() or job.future.exception() is not None:
            return False
        del self._compiling[req]
        self.compiles.leave(job)
        self._matchers[req] = self._backend.new_matcher(job.future.result())
        return True

    def failures(self) -> list[tuple[Request, str]]:
        """Requests whose grammar failed to compile or overran the bound, with the reason."""
        now, failed = time.monotonic(), []
        for req, (job, deadline) in self._compiling.items():
            if job.future.done() and job.future.exception() is not None:
                failed.append((req, str(job.future.exception())))
            elif not job.future.done() and now > deadline:
                kind = req.sampling_params.structured_outputs.kind
                failed.append((req, f"structured_outputs.{kind} took longer than the engine's limit of "
                                    f"{self.compile_timeout_s:g} s to compile (structured_outputs_compile_timeout): "
                                    f"{job.describe_wait(now)}; simplify it"))
        return failed

    def wait_for_compile(self, timeout_s: float) -> None:
        """Sleep until some grammar finishes compiling or `timeout_s` passes (the loop is idle)."""
        pending = [job.future for job, _ in self._compiling.values() if not job.future.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def dead_end(self, req: Request) -> str | None:
        """Why the request's grammar allowed no token at one of its last mask rows (None: every
        row allowed some)."""
        dead = self._dead_ends.get(req)
        return None if dead is None else dead[1]

    def dead_end_row(self, req: Request) -> int:
        """Which of the request's last mask rows allowed no token (0 without drafts)."""
        return self._dead_ends[req][0]

    def can_draft(self, req: Request) -> bool:
        """Whether the request may carry drafts: its matcher rolls back, and it does not reason
        first (its gate moves over tokens outside the grammar)."""
        matcher = self._matchers.get(req)
        return matcher is not None and matcher.supports_rollback and req not in self._gates

    def valid_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the request's grammar accepts from where it stands, short
        of a token that ends the grammar (no mask follows it: the verify step samples it itself);
        the matcher ends where it started."""
        matcher, walked, ended = self._matchers[req], 0, False
        for token in drafts:
            if not matcher.accept_token(token):
                break
            walked += 1
            if matcher.is_terminated():
                ended = True
                break
        if walked:
            matcher.rollback(walked)
        return drafts[:walked - ended]

    # -- per step ------------------------------------------------------------------------------

    def bitmask(self, reqs: list[Request], drafts: dict[str, list[int]] | None = None) -> GrammarBitmask | None:
        """The next-token masks of requests that sample this step, whose matchers have accepted
        every token before the one sampled (the engine guarantees it: see `Scheduler`); a request
        with `drafts` (valid ones: `valid_drafts`) gets a row per verified position. A thinking
        request gets a row only while min_tokens holds its stop tokens back (the worker leaves
        min_tokens to the masks of requests with a grammar); None when no row is needed."""
        # A request removed since it was scheduled (it finished while the step before was in
        # flight) gets no row: its token is dropped.
        masked = [req for req in reqs if req in self._matchers and (not self._thinks(req) or _under_min_tokens(req))]
        if not masked:
            return None
        walks = [[] if drafts is None else drafts.get(req.request_id, []) for req in masked]
        firsts = list(itertools.accumulate((1 + len(walk) for walk in walks), initial=0))
        bitmask = np.empty((firsts[-1], self.width), dtype=np.int32)
        single = [i for i, (req, walk) in enumerate(zip(masked, walks)) if not walk and not self._thinks(req)]
        self._backend.fill_bitmasks([self._matchers[masked[i]] for i in single], bitmask, [firsts[i] for i in single])
        for req, walk, first in zip(masked, walks, firsts):
            self._dead_ends.pop(req, None)
            if walk:
                self._fill_along(self._matchers[req], walk, bitmask, first)
            for position in range(1 + len(walk)):
                self._finish_row(req, bitmask, first + position, position)
                if _under_min_tokens(req, position):
                    _hold_back_stops(bitmask[first + position], req)
        return GrammarBitmask([req.request_id for req in masked], self.width, bitmask.tobytes(),
                              [1 + len(walk) for walk in walks] if any(walks) else [])

    @staticmethod
    def _fill_along(matcher: GrammarMatcher, drafts: list[int], bitmask: np.ndarray, first: int) -> None:
        """Rows `first`..`first + len(drafts)`: the tokens allowed after each prefix of the drafts."""
        for position, token in enumerate(drafts):
            matcher.fill_bitmask(bitmask, first + position)
            matcher.accept_token(token)
        matcher.fill_bitmask(bitmask, first + len(drafts))
        matcher.rollback(len(drafts))

    def _thinks(self, req: Request) -> bool:
        gate = self._gates.get(req)
        return gate is not None and gate.thinking

    def _finish_row(self, req: Request, bitmask: np.ndarray, row: int, position: int) -> None:
        """After the backend filled the grammar rows: a thinking request's row allows every token, a
        gate that may open adds its start marker, and a row that allows nothing marks a dead end
        at its `position` among the request's rows (the first such one)."""
        gate = self._gates.get(req)
        if gate is not None and gate.thinking:
            bitmask[row] = -1  # every token
            return
        if gate is not None and gate.phase == "opening":
            start = gate.gate.start
            bitmask[row].view(np.uint32)[start // 32] |= np.uint32(1 << (start % 32))
        if not bitmask[row].any():
            kind = req.sampling_params.structured_outputs.kind
            self._dead_ends.setdefault(req, (position, (
                f"structured_outputs.{kind} admits no string that continues this output (after "
                f"{req.num_output_tokens + position} tokens it allows no token at all: a part of it can "
                "never end or match); the request ends here")))
            bitmask[row] = -1  # the sampler sees a row it can sample; the scheduler drops the token

    def accept(self, req: Request, token_id: int) -> bool:
        """Advance the request's matcher; False when its grammar does not allow the token. A token
        its reasoning takes (free, or a marker) leaves the matcher where it is."""
        gate = self._gates.get(req)
        if gate is not None and not gate.advance(token_id):
            return True
        return self._matchers[req].accept_token(token_id)

    def is_terminated(self, req: Request) -> bool:
        return self._matchers[req].is_terminated()

    def _compile(self, spec: StructuredOutputsParams):
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_cls(*self._backend_args)
        return self._backend.compile(spec)


def _under_min_tokens(req: Request, position: int = 0) -> bool:
    """Whether min_tokens holds stop tokens back at the request's next output position + `position`."""
    return req.num_output_tokens + position < req.sampling_params.min_tokens


def _hold_back_stops(row: np.ndarray, req: Request) -> None:
    """min_tokens under a grammar: forbid the stop tokens in the mask, unless the grammar allows
    nothing else (then it wins: the output must stay valid). The worker leaves these rows alone."""
    params = req.sampling_params
    stops = set(params.stop_token_ids or ())
    if req.eos_token_id is not None and not params.ignore_eos:
        stops.add(req.eos_token_id)
    held = row.view(np.uint32).copy()
    for token in stops:
        if token // 32 < len(held):
            held[token // 32] &= ~np.uint32(1 << (token % 32))
    if held.any():
        row.view(np.uint32)[:] = held
