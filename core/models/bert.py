"""Encoder-only models (BERT, XLM-RoBERTa) for the pooling runner: embeddings and sequence classifiers.

An encoder attends bidirectionally over its whole prompt and keeps no KV cache: the engine runs
encoder prompts whole, in one step each, without prefix caching (`EngineConfig.encoder_only`), so
every sequence of a step starts at position 0 and its keys are all in the step. Attention is
torch's SDPA over each sequence's span on every platform (the paged backends attend causally
over a cache an encoder does not fill); the backend's KV blocks are reserved but never read.

Token type ids are derived, not sent: the tokenizers give 0 up to and including a pair's first
separator and 1 after it, so a token's type is whether a separator (`sep_token_id`, which the
worker reads from the tokenizer when the config lacks it) comes before it in its sequence.
XLM-RoBERTa has one token type and positions offset by `pad_token_id + 1` (`position_offset`).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from ..attention import ForwardContext
from ..tokenizer import Tokenizer
from .layers import activation

# Checkpoint prefixes in front of the encoder's own names (a pooling engine adds `model.`).
_PREFIXES = ("model.", "bert.", "roberta.")
Spans = list[tuple[int, int]]


def position_offset(hf) -> int:
    """The first position id (RoBERTa-family models count positions from `pad_token_id + 1`)."""
    if getattr(hf, "model_type", "") in ("roberta", "xlm-roberta"):
        return (getattr(hf, "pad_token_id", None) or 0) + 1
    return 0


def read_separator(hf, tokenizer_dir) -> None:
    """Set `hf.sep_token_id` from the tokenizer where the config lacks it (BERT configs do)."""
    if getattr(hf, "sep_token_id", None) is None and tokenizer_dir is not None:
        hf.sep_token_id = Tokenizer.from_dir(tokenizer_dir).hf.sep_token_id


class _Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.offset = position_offset(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        hidden = (self.word_embeddings(input_ids) + self.position_embeddings(positions + self.offset)
                  + self.token_type_embeddings(token_types))
        return self.LayerNorm(hidden)


class _SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = size // self.num_heads
        self.query, self.key, self.value = nn.Linear(size, size), nn.Linear(size, size), nn.Linear(size, size)

    def forward(self, hidden: torch.Tensor, spans: Spans) -> torch.Tensor:
        q, k, v = (proj(hidden).view(-1, self.num_heads, self.head_dim).transpose(0, 1)
                   for proj in (self.query, self.key, self.value))
        out = torch.empty_like(q)
        for start, end in spans:
            out[:, start:end] = F.scaled_dot_product_attention(q[:, start:end], k[:, start:end], v[:, start:end])
        return out.transpose(0, 1).reshape(hidden.shape)


class _Output(nn.Module):
    """A projection added to the residual, then post-LayerNorm."""

    def __init__(self, size_in: int, size_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(size_in, size_out)
        self.LayerNorm = nn.LayerNorm(size_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = _SelfAttention(config)
        self.output = _Output(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, spans: Spans) -> torch.Tensor:
        return self.output(self.self(hidden, spans), hidden)


class _Intermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _Output(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, spans: Spans) -> torch.Tensor:
        hidden = self.attention(hidden, spans)
        return self.output(self.intermediate(hidden), hidden)


class _Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder's last hidden states [T, hidden] for the pooler (CLS or MEAN for embeddings)."""

    #: The engine runs this model's prompts whole and without a KV cache (`EngineConfig.encoder_only`).
    is_encoder = True
    supports_graph_capture = False
    graph_capture_blocker = "a step's sequence spans are read back to the host (`_sequence_spans`)"

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__()
        if max_positions + position_offset(config) > config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_positions} exceeds the model's {config.max_position_embeddings} "
                             f"position embeddings (less an offset of {position_offset(config)})")
        self.config = config
        self.dtype = dtype
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)
        self.sep_token_id = getattr(config, "sep_token_id", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        spans = _sequence_spans(positions)
        hidden = self.embeddings(input_ids, positions, self._token_types(input_ids, spans))
        for layer in self.encoder.layer:
            hidden = layer(hidden, spans)
        return hidden

    def _token_types(self, input_ids: torch.Tensor, spans: Spans) -> torch.Tensor:
        """0 up to and including each sequence's first separator, 1 after it (a pair's second text)."""
        types = torch.zeros_like(input_ids)
        if self.config.type_vocab_size < 2 or self.sep_token_id is None:
            return types
        is_sep = (input_ids == self.sep_token_id).long()
        for start, end in spans:
            seps = is_sep[start:end]
            types[start:end] = (seps.cumsum(0) - seps > 0).long()
        return types

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names with or without their `bert.`/`roberta.` prefix; tensors this model has no use
        for (a bare model's pooler, masked-LM heads, position-id buffers) are skipped."""
        params = dict(self.named_parameters())
        filled = set()
        for name, tensor in weights:
            for prefix in _PREFIXES:
                name = name.removeprefix(prefix)
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
            if name in params:
                params[name].copy_(tensor)
                filled.add(name)
        return filled


def _sequence_spans(positions: torch.Tensor) -> Spans:
    """Each sequence's rows in the step: whole prompts, so a sequence starts where its position is 0."""
    starts = torch.nonzero(positions == 0).flatten().tolist()
    ends = [*starts[1:], positions.shape[0]]
    expected = torch.cat([torch.arange(end - start, device=positions.device) for start, end in zip(starts, ends)])
    if not starts or starts[0] != 0 or not torch.equal(positions, expected.to(positions.dtype)):
        raise RuntimeError("an encoder step must hold whole prompts (EngineConfig.encoder_only)")
    return list(zip(starts, ends))


class _Pooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)


class BertForSequenceClassification(BertModel):
    """BERT with its pooler (tanh dense over [CLS]) and classifier: `classify` maps CLS vectors to logits."""

    classifier_pooling = "CLS"

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__(config, max_positions, dtype)
        self.pooler = _Pooler(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def classify(self, cls_vectors: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(cls_vectors.to(self.dtype)))).float()


class XLMRobertaModel(BertModel):
    """XLM-RoBERTa's encoder: BERT's layers, positions from `pad_token_id + 1`, one token type."""


class _RobertaHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """XLM-RoBERTa with its classification head (tanh dense, then out_proj, over <s>): the
    bge-reranker cross-encoders (`num_labels == 1`)."""

    classifier_pooling = "CLS"

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__(config, max_positions, dtype)
        self.classifier = _RobertaHead(config)

    def classify(self, cls_vectors: torch.Tensor) -> torch.Tensor:
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(cls_vectors.to(self.dtype)))).float()
