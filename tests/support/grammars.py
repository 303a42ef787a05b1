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


def constrained_texts(llm) -> list[str]:
    """What an `LLM` samples under grammars (regex, choice, a JSON schema; greedy and seeded n = 2),
    for the parallel-engine tests to compare against one device."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    specs = [StructuredOutputsParams(regex=r"[a-z]{3,6}"), StructuredOutputsParams(choice=["red", "green", "blue"]),
             StructuredOutputsParams(json=schema, disable_any_whitespace=True)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=spec) for spec in specs]
    params.append(SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=20, structured_outputs=specs[2]))
    outputs = llm.generate(["a", "b", "c", "d"], params, use_tqdm=False)
    return [c.text for out in outputs for c in out.outputs]
