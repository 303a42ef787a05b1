"""Decoder sequence classifiers (`*ForSequenceClassification` of Llama/Qwen2/Qwen3): the causal LM's
backbone with a `score` head over the last prompt token's hidden state, run by the pooling runner
(LAST pooling, then `classify`). The LM head is not used (the pooling worker drops it).

A causal LM trained to answer with a token (Qwen3-Reranker's "yes"/"no") is loaded as such a
classifier, as vLLM does it, with `--hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'`: its `score` rows are
the LM head's rows of those tokens, so a logit is what the LM gives the token at the last position.
`method` "from_2_way_softmax" (Qwen3-Reranker's) makes one label, the row of the second token minus
the first's: its sigmoid is the softmax probability of the second token against the first.
"no_post_processing" keeps one label per token.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..pooling import pooling_weights
from ..tokenizer import Tokenizer
from .llama import LlamaForCausalLM
from .qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

FROM_TOKEN_METHODS = ("from_2_way_softmax", "no_post_processing")
# vLLM's Qwen3-Reranker conversion: is_original_qwen3_reranker sets these.
_QWEN3_RERANKER = dict(method="from_2_way_softmax", classifier_from_token=["no", "yes"])


def classifier_from_tokens(hf_config, tokenizer_dir: Path | None) -> None:
    """Resolve a config's `classifier_from_token` (vLLM's) in place: the tokens' ids become
    `classifier_token_ids` and `num_labels` the head's size. A config without it is left alone."""
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        for key, value in _QWEN3_RERANKER.items():
            setattr(hf_config, key, value)
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens is None:
        return
    method = getattr(hf_config, "method", None)
    if method not in FROM_TOKEN_METHODS:
        raise ConfigError("hf_overrides", f"classifier_from_token needs method {' or '.join(FROM_TOKEN_METHODS)} "
                          f"(or is_original_qwen3_reranker), got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ConfigError("hf_overrides", f"from_2_way_softmax takes two tokens (false, true), got {tokens}")
    if tokenizer_dir is None:
        raise ConfigError("hf_overrides", "classifier_from_token names tokens: the model needs its tokenizer")
    vocab = Tokenizer.from_dir(tokenizer_dir).hf.get_vocab()
    unknown = [token for token in tokens if token not in vocab]
    if unknown:
        raise ConfigError("hf_overrides", f"classifier_from_token {unknown} are not tokens of the tokenizer")
    hf_config.classifier_token_ids = [vocab[token] for token in tokens]
    hf_config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)


class _ScoreHead:
    """Mixed into a causal LM: `score` (hidden -> num_labels, no bias) as HF's classifiers hold it,
    or made from the LM head's rows (`classifier_from_tokens`)."""

    classifier_pooling = "LAST"
    prepare_classifier = staticmethod(classifier_from_tokens)

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__(config, max_positions, dtype)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.score_dtype = dtype
        self._token_ids = getattr(config, "classifier_token_ids", None)
        self._two_way = getattr(config, "method", None) == "from_2_way_softmax"
        self._head_rows: dict[str, torch.Tensor] = {}  # the LM head's rows of the tokens, while loading

    def classify(self, last_vectors: torch.Tensor) -> torch.Tensor:
        return self.score(last_vectors.to(self.score_dtype)).float()

    def pooling_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint as the pooling worker loads it (`corectl.pooling.pooling_weights`, which
        drops the LM head), the head's rows of the classifier tokens taken on the way."""
        def tapped():
            for name, tensor in weights:
                if self._token_ids is not None and name in ("lm_head.weight", "model.embed_tokens.weight"):
                    self._head_rows[name] = tensor[self._token_ids].float()  # the whole vocabulary: not sharded
                yield name, tensor

        return pooling_weights(tapped())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        filled = super().load_weights(weights)
        if self._token_ids is None:
            return filled
        # A tied head is the embedding.
        rows = self._head_rows.get("model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight")
        if rows is None:
            raise ConfigError("model", "classifier_from_token reads the LM head's rows, which the checkpoint "
                              "does not hold")
        with torch.no_grad():
            self.score.weight.copy_(rows[1:2] - rows[0:1] if self._two_way else rows)
        self._head_rows.clear()
        return filled | {"score.weight"}


class LlamaForSequenceClassification(_ScoreHead, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(_ScoreHead, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(_ScoreHead, Qwen3ForCausalLM):
    pass
