"""Token sampling on the worker's device, without host syncs: see `sampler.py` for the order of operations."""
from .logprobs import LogprobsTensors, compute_prompt_logprobs
from .metadata import SamplingMetadata
from .sampler import Sampler, SamplerOutput

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata", "compute_prompt_logprobs"]
