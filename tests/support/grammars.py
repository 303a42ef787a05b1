"""Requests under a grammar and the engine-side manager that serves them, for the structured-output tests
(SmolLM2's vocabulary: 49,152 tokens, EOS 2)."""
from __future__ import annotations

import time

from corectl.request import Request
from corectl.sampling_params import SamplingParams, StructuredOutputsParams

EOS = 2
VOCAB = 49152


def constrained(req_id: str, spec: StructuredOutputsParams, **params) -> Request:
    """A request of a three-token prompt whose output `spec` constrains."""
    return Request(req_id, [1, 2, 3], SamplingParams(structured_outputs=spec, **params), eos_token_id=EOS,
                   max_tokens=32)


def wait_ready(manager, req: Request, timeout_s: float = 60.0) -> None:
    """Until the request's grammar has compiled (a `StructuredOutputManager`); fails on a compile error."""
    deadline = time.monotonic() + timeout_s
    while not manager.ready(req):
        assert not manager.failures() and time.monotonic() < deadline
        manager.wait_for_compile(0.05)
