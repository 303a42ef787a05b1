"""corectl: paged-KV continuous-batching LLM inference.

    from corectl import LLM, SamplingParams
    llm = LLM()                       # the embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)

Public names load on first use so that `import corectl` stays cheap (no torch until needed).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy_exports import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "corectl.llm",
    "SamplingParams": "corectl.sampling_params",
    "StructuredOutputsParams": "corectl.sampling_params",
    "ReasoningGate": "corectl.sampling_params",
    "EngineConfig": "corectl.config",
    "RequestOutput": "corectl.outputs",
    "CompletionOutput": "corectl.outputs",
    "EmbeddingRequestOutput": "corectl.outputs",
    "EmbeddingOutput": "corectl.outputs",
    "PoolingParams": "corectl.pooling",
    "EngineClient": "corectl.engine.client",
    "LoRARequest": "corectl.lora.request",
    "BeamSearchParams": "corectl.beam_search",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__ = lazy_getattr("corectl", _EXPORTS, globals())


if TYPE_CHECKING:
    from .beam_search import BeamSearchParams
    from .config import EngineConfig
    from .engine.client import EngineClient
    from .llm import LLM
    from .lora.request import LoRARequest
    from .outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
    from .pooling import PoolingParams
    from .sampling_params import ReasoningGate, SamplingParams, StructuredOutputsParams
