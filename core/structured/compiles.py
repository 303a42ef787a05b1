"""Grammar compiles off the engine loop: two lanes by estimated cost, shared by spec, cached within a byte bound.

A compile cannot be interrupted once a thread runs it (the grammar library holds it in C++), and a
large one takes seconds and hundreds of MB. So:

- Lanes. A spec's cost is estimated from its text (`estimated_cost`: its bytes plus its repetition
  and length bounds, which drive the compile's time more than its length does). Cheap specs compile
  on the small lane (`SMALL_LANE_WORKERS` threads), the rest on the large lane
  (`LARGE_LANE_WORKERS`), so however many large grammars arrive, a small one never waits behind them.
- Abandonment. Each compile counts the requests waiting for it. When the last one leaves (it timed
  out, was aborted, or failed), a compile still queued is cancelled (it never runs) and a running
  one is dropped from the cache: it finishes in the background and is freed.
- Cache. Finished grammars are kept by spec, least recently used first out, while their sizes
  (`StructuredOutputBackend.grammar_bytes`, plus the spec itself) sum to at most `cache_bytes`. A
  failed compile is kept too (it fails the next request with that spec at once), at the spec's size.
"""
from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

SMALL_LANE_WORKERS = 2
LARGE_LANE_WORKERS = 1
# Specs estimated at or above this cost compile on the large lane. A 1024-entry `choice` list of
# 64-character strings, or a `maxLength` of 1024, is at the bound; both compile in about a second
# on one core, where small specs take milliseconds.
SMALL_GRAMMAR_COST = 16 * 1024
DEFAULT_CACHE_BYTES = 512 * 1024 * 1024
# Each repetition or length bound in a spec counts this many bytes a unit (`[a-z]{0,2000}` takes as
# long to compile as a 32 KB choice list).
_BOUND_WEIGHT = 16
_NUMBER = re.compile(rb"\d{2,9}")


def estimated_cost(spec_text: bytes) -> int:
    """A spec's compile cost in bytes of text: its length plus every number of two or more digits
    in it, weighted (the numbers of a spec are its repetition and length bounds, enums aside)."""
    return len(spec_text) + _BOUND_WEIGHT * sum(int(number) for number in _NUMBER.findall(spec_text))


class Compile:
    """One spec's compile, shared by the requests that wait for it."""

    def __init__(self, key: bytes, lane: str):
        self.key = key
        self.lane = lane
        self.future: Future | None = None
        self.waiters = 0
        self.queued_at = time.monotonic()
        self.started_at: float | None = None
        self.nbytes = 0

    def describe_wait(self, now: float) -> str:
        """Where the compile stands, for an error that says which limit applied."""
        lane = "large-grammar" if self.lane == "large" else "small-grammar"
        workers = LARGE_LANE_WORKERS if self.lane == "large" else SMALL_LANE_WORKERS
        if self.started_at is None:
            return (f"it waited {now - self.queued_at:.1f} s on the {lane} lane, which compiles {workers} "
                    "grammar(s) at a time, without starting")
        return f"it compiled for {now - self.started_at:.1f} s on the {lane} lane"


class GrammarCompiles:
    """`compile_fn(spec)` makes a grammar, `size_fn(grammar)` says its bytes; both run on lane threads."""

    def __init__(self, compile_fn: Callable[[Any], Any], size_fn: Callable[[Any], int],
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        self._compile_fn = compile_fn
        self._size_fn = size_fn
        self._lanes = {"small": ThreadPoolExecutor(SMALL_LANE_WORKERS, thread_name_prefix="corectl-grammar"),
                       "large": ThreadPoolExecutor(LARGE_LANE_WORKERS, thread_name_prefix="corectl-grammar-large")}
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()  # the cache is read by the engine loop and written by lane threads
        self._cache: OrderedDict[bytes, Compile] = OrderedDict()
        self._cached_bytes = 0

    def join(self, key: bytes, spec: Any) -> Compile:
        """Wait for the compile of `spec`, whose JSON text is `key`: the cached or running one, or a
        new one on its lane."""
        with self._lock:
            job = self._cache.get(key)
            if job is not None:
                self._cache.move_to_end(key)
            else:
                job = Compile(key, "small" if estimated_cost(key) < SMALL_GRAMMAR_COST else "large")
                self._cache[key] = job
                job.future = self._lanes[job.lane].submit(self._run, job, spec)
            job.waiters += 1
        return job

    def leave(self, job: Compile) -> None:
        """One request stopped waiting; the last one out abandons a compile that has not finished."""
        with self._lock:
            job.waiters -= 1
            if job.waiters or job.future.done():
                return
            if self._cache.get(job.key) is job:
                del self._cache[job.key]
        job.future.cancel()  # False once running: the thread finishes it and nothing keeps the result

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def _run(self, job: Compile, spec: Any) -> Any:
        job.started_at = time.monotonic()
        try:
            grammar = self._compile_fn(spec)
        except BaseException:
            self._keep(job, len(job.key))
            raise
        self._keep(job, len(job.key) + self._size_fn(grammar))
        return grammar

    def _keep(self, job: Compile, nbytes: int) -> None:
        """Count a finished compile in the cache (unless it was abandoned), then evict the least
        recently used finished ones until the rest fit; the requests that hold a grammar keep it."""
        with self._lock:
            if self._cache.get(job.key) is not job:
                return
            job.nbytes = nbytes
            self._cached_bytes += nbytes
            for key, entry in list(self._cache.items()):
                if self._cached_bytes <= self.cache_bytes:
                    break
                if entry.nbytes:
                    del self._cache[key]
                    self._cached_bytes -= entry.nbytes
