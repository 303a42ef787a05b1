"""Structured outputs in the engine process: grammars compiled off the loop, one matcher per request,
one bitmask per step.

The scheduler owns the manager and is its only caller. A request that asks for structured output
has its grammar compiled on a small thread pool (the backend itself is built there too, the first
time); it stays in the waiting queue, skipped, until the grammar is ready, so it blocks no one.
Compiled grammars are cached by spec (LRU), and concurrent requests with one spec share a compile.
A compile that fails, or that is still running `compile_timeout_s` after the request arrived, ends
that request with an error; a compile thread cannot be interrupted, so an overrunning one finishes
in the background and its grammar is cached for later requests.

Each request's matcher advances with every token the request accepts. Preemption recomputes K/V but
keeps the tokens, so the matcher stays where it is; nothing is ever rolled back. Under async
scheduling a step's masks are filled after the step before it has been read, while the device runs
the step's forward pass (see `Scheduler`).

A request whose spec carries a `ReasoningGate` thinks first (`reasoning.GatePhase`): while it
thinks its row gets no mask and its matcher does not move; the end marker hands the next token to
the grammar. Its first token, when it may open the reasoning, may be the grammar's or the start
marker. The grammar is compiled and cached without the gate, which does not change it.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import msgspec
import numpy as np

from ..request import Request
from ..sampling_params import StructuredOutputsParams
from ..scheduler.output import GrammarBitmask
from .backend import GrammarMatcher, StructuredOutputBackend, bitmask_width
from .reasoning import GatePhase


class StructuredOutputManager:
    """`backend_cls` is built as `backend_cls(tokenizer_dir, vocab_size, stop_token_ids)` on first use."""

    def __init__(self, backend_cls: type[StructuredOutputBackend], tokenizer_dir: str, vocab_size: int,
                 stop_token_ids: list[int], compile_timeout_s: float, max_workers: int = 2,
                 cache_size: int = 256):
        self._backend_args = (tokenizer_dir, vocab_size, list(stop_token_ids))
        self._backend_cls = backend_cls
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="corectl-grammar")
        self.compile_timeout_s = compile_timeout_s
        self.width = bitmask_width(vocab_size)
        self._cache: OrderedDict[bytes, Future] = OrderedDict()
        self._cache_size = cache_size
        self._compiling: dict[Request, tuple[Future, float]] = {}
        self._matchers: dict[Request, GrammarMatcher] = {}
        self._gates: dict[Request, GatePhase] = {}

    # -- requests in and out -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Start (or share) the compile of the request's grammar; the clock of its bound starts now."""
        spec = req.sampling_params.structured_outputs
        if spec.reasoning is not None:
            self._gates[req] = GatePhase(spec.reasoning)
            spec = msgspec.structs.replace(spec, reasoning=None)
        key = msgspec.msgpack.encode(spec)
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        self._compiling[req] = (future, time.monotonic() + self.compile_timeout_s)

    def remove(self, req: Request) -> None:
        self._compiling.pop(req, None)
        self._matchers.pop(req, None)
        self._gates.pop(req, None)

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
        future, _ = self._compiling[req]
        if not future.done() or future.exception() is not None:
            return False
        del self._compiling[req]
        self._matchers[req] = self._backend.new_matcher(future.result())
        return True

    def failures(self) -> list[tuple[Request, str]]:
        """Requests whose grammar failed to compile or overran the bound, with the reason."""
        now, failed = time.monotonic(), []
        for req, (future, deadline) in self._compiling.items():
            if future.done() and future.exception() is not None:
                failed.append((req, str(future.exception())))
            elif not future.done() and now > deadline:
                kind = req.sampling_params.structured_outputs.kind
                reason = f"structured_outputs.{kind} took longer than {self.compile_timeout_s:g} s to compile"
                failed.append((req, f"{reason}; simplify it"))
        return failed

    def wait_for_compile(self, timeout_s: float) -> None:
        """Sleep until some grammar finishes compiling or `timeout_s` passes (the loop is idle)."""
        pending = [future for future, _ in self._compiling.values() if not future.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # -- per step ------------------------------------------------------------------------------

    def bitmask(self, reqs: list[Request]) -> GrammarBitmask | None:
        """The next-token masks of requests that sample this step, whose matchers have accepted
        every token before the one sampled (the engine guarantees it: see `Scheduler`). A thinking
        request gets a row only while min_tokens holds its stop tokens back (the worker leaves
        min_tokens to the masks of requests with a grammar); None when no row is needed."""
        # A request removed since it was scheduled (it finished while the step before was in
        # flight) gets no row: its token is dropped.
        masked = [req for req in reqs if req in self._matchers and (not self._thinks(req) or _under_min_tokens(req))]
        if not masked:
            return None
        bitmask = np.empty((len(masked), self.width), dtype=np.int32)
        for row, req in enumerate(masked):
            self._fill(req, bitmask, row)
            if _under_min_tokens(req):
                _hold_back_stops(bitmask[row], req)
        return GrammarBitmask([req.request_id for req in masked], self.width, bitmask.tobytes())

    def _thinks(self, req: Request) -> bool:
        gate = self._gates.get(req)
        return gate is not None and gate.thinking

    def _fill(self, req: Request, bitmask: np.ndarray, row: int) -> None:
        gate = self._gates.get(req)
        if gate is not None and gate.thinking:
            bitmask[row] = -1  # every token
            return
        self._matchers[req].fill_bitmask(bitmask, row)
        if gate is not None and gate.phase == "opening":
            start = gate.gate.start
            bitmask[row].view(np.uint32)[start // 32] |= np.uint32(1 << (start % 32))

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


def _under_min_tokens(req: Request) -> bool:
    return req.num_output_tokens < req.sampling_params.min_tokens


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
