"""Decoder sequence classifiers (`*ForSequenceClassification` of Llama/Qwen2/Qwen3): the causal LM's
backbone with a `score` head over the last prompt token's hidden state, run by the pooling runner
(LAST pooling, then `classify`). The LM head is not used (the pooling worker drops it)."""
from __future__ import annotations

import torch
from torch import nn

from .llama import LlamaForCausalLM
from .qwen import Qwen2ForCausalLM, Qwen3ForCausalLM


class _ScoreHead:
    """Mixed into a causal LM: `score` (hidden -> num_labels, no bias) as HF's classifiers hold it."""

    classifier_pooling = "LAST"

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__(config, max_positions, dtype)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.score_dtype = dtype

    def classify(self, last_vectors: torch.Tensor) -> torch.Tensor:
        return self.score(last_vectors.to(self.score_dtype)).float()


class LlamaForSequenceClassification(_ScoreHead, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(_ScoreHead, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(_ScoreHead, Qwen3ForCausalLM):
    pass
