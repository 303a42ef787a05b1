"""Tensor-parallel building blocks: each rank holds and loads only its slice of a weight.

vLLM's split (`linear.py`, `vocab_parallel_embedding.py`), written for this engine:
  - `PackedLinear` is column parallel: each packed shard (q, k, v; gate, up) is split along its
    output rows in whole units (a head's `head_dim` rows for q/k/v, single rows for gate/up);
    KV heads are shared by consecutive ranks when there are more ranks than KV heads.
  - `RowParallelLinear` splits the input features and sums the partial products over the ranks.
  - `VocabParallelEmbedding` and `ParallelLMHead` split the vocabulary into equal ranges (the last
    padded with zero rows); the logits are gathered on every rank (`gather_logits`), so every rank
    samples the same ids and can feed them to its next step.

The layout comes from `corectl.distributed.get_tp()` when a layer is built. At world size 1 every
layer is the plain torch layer: no collective, no mask and no copy (the checks are one attribute
read). A checkpoint tensor reaches a parameter through the parameter's `weight_loader`, which
narrows it to the rank's slice before copying; checkpoint tensors map the file
(`safe_open(...).get_tensor` in safetensors >= 0.8), so a rank reads only the rows it keeps.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..distributed import all_gather, all_reduce, get_pp, get_tp, shard_range
from ..errors import ConfigError
from ..loaders.packing import PACKED_MODULES
from ..quantization.scope import deferred_weight_device
from .kernels import UsesLayerKernels
from .quantizable import QuantizableLinear


class PackedLinear(QuantizableLinear, nn.Linear):
    """Several checkpoint projections stored as one matrix (qkv, gate_up) so one GEMM computes
    them, column parallel: each rank holds its units of every shard.

    `shard_sizes` maps each checkpoint shard id to its full output size; `unit` is the number of
    rows that stay together on one rank (a head's `head_dim` for attention projections). `shards`
    maps each shard id to (offset in this rank's matrix, rows held, first checkpoint row held).
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool, unit: int = 1):
        tp = get_tp()
        shards: dict[str, tuple[int, int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            first, count = shard_range(size // unit, tp.rank, tp.world_size)
            shards[shard_id] = (offset, count * unit, first * unit)
            offset += count * unit
        super().__init__(in_features, offset, bias=bias, device=deferred_weight_device())
        self.shards = shards
        self.full_sizes = dict(shard_sizes)
        self._attach_dense_loaders()

    def _attach_dense_loaders(self) -> None:
        for param in self.parameters():
            param.weight_loader = self._load_shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_forward(x)

    def checkpoint_weight_names(self, prefix: str) -> list[str]:
        """`...q_proj.weight`, `...k_proj.weight`, ...: one checkpoint weight per shard."""
        stem, packed = prefix.rsplit(".", 1)
        by_shard = {shard: proj for proj, (target, shard) in PACKED_MODULES.items() if target == packed}
        return [f"{stem}.{by_shard[shard]}.weight" for shard in self.full_sizes]

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        offset, size, first = self.shards[shard_id]
        if loaded.shape[0] != self.full_sizes[shard_id]:
            raise ValueError(f"shard {shard_id!r} expects {self.full_sizes[shard_id]} rows, "
                             f"checkpoint has {tuple(loaded.shape)}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, first, size))


class RowParallelLinear(QuantizableLinear, nn.Linear):
    """A linear layer whose input features are split over the ranks; the partial outputs are
    summed. The bias is added once: rank 0 holds it, the other ranks hold zeros.

    `reduce_output` is the sum over ranks (None at world size 1); a platform that swaps the GEMM
    (the CPU's prepacked linear) keeps calling it, and keeps `forward_gated` (a gated MLP's call).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, split: bool = True):
        tp = get_tp()
        first, count = shard_range(in_features, tp.rank, tp.world_size) if split else (0, in_features)
        super().__init__(count, out_features, bias=bias, device=deferred_weight_device())
        self.first_input, self.full_in_features = first, in_features
        # Unsplit (`ReplicatedLinear`), every rank keeps the bias and nothing is summed.
        self.rank = tp.rank if split else 0
        self.reduce_output = all_reduce if tp.world_size > 1 and split else None
        self._attach_dense_loaders()

    def _attach_dense_loaders(self) -> None:
        self.weight.weight_loader = self._load_weight
        if self.bias is not None:
            self.bias.weight_loader = self._load_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.linear_forward(x))

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """`forward(silu(gate) * up)` of a gated MLP's packed `gate_up` in one fused step, or None
        where the layer has none (a method without one, `LinearMethod.apply_gated`, or a dense layer
        whose installed kernels have none for this shape); the caller then runs the activation and
        `forward`."""
        if self.quant_method is None:
            out = self.dense_kernel(gate_up, self.weight, self.bias, gated=True)
        else:
            out = self.quant_method.apply_gated(self, gate_up)
        return None if out is None else self._reduce(out)

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.reduce_output is None else self.reduce_output(out)

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expected = (self.out_features, self.full_in_features)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape mismatch: parameter {expected} vs checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(1, self.first_input, self.in_features))

    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
        if self.rank == 0:
            param.data.copy_(loaded)
        else:
            param.data.zero_()


class ReplicatedLinear(RowParallelLinear):
    """A linear layer every rank holds whole: nothing split, nothing summed. For the small
    projections whose output each rank needs in full (DeepSeek's low-rank q and latent kv)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias, split=False)


class ColumnParallelLinear(PackedLinear):
    """One projection whose output rows are split over the ranks in whole units of `unit` rows (a
    head's), so each rank computes its heads' outputs and nothing is summed. It is a packed layer
    of one shard, so every quantization method that splits a packed layer's shards splits it; its
    checkpoint tensors name no shard, so its loaders (dense or a method's) are given that one."""

    SHARD = "rows"

    def __init__(self, in_features: int, out_features: int, bias: bool, unit: int):
        super().__init__(in_features, {self.SHARD: out_features}, bias, unit)

    def _attach_dense_loaders(self) -> None:
        super()._attach_dense_loaders()
        self._name_the_shard()

    def set_quant_method(self, method, dtype: torch.dtype, device: torch.device) -> None:
        super().set_quant_method(method, dtype, device)
        self._name_the_shard()

    def checkpoint_weight_names(self, prefix: str) -> list[str]:
        return [f"{prefix}.weight"]

    def _name_the_shard(self) -> None:
        for param in self.parameters(recurse=False):
            if param.weight_loader != self._load_whole:
                param.shard_loader, param.weight_loader = param.weight_loader, self._load_whole

    def _load_whole(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        # A parameter re-made on its device (the bias, `set_quant_method`) keeps only `weight_loader`.
        loader = getattr(param, "shard_loader", self._load_shard)
        loader(param, loaded, shard_id or self.SHARD)


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(first token id, rows) of this rank's vocabulary range: ceil(vocab / N) rows each."""
    tp = get_tp()
    rows = -(-vocab_size // tp.world_size)
    return tp.rank * rows, rows


def _load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, first: int, vocab_size: int) -> None:
    if loaded.shape[0] != vocab_size or loaded.shape[1:] != param.shape[1:]:
        raise ValueError(f"vocabulary rows: expected ({vocab_size}, {param.shape[1]}), checkpoint has "
                         f"{tuple(loaded.shape)}")
    held = max(0, min(vocab_size - first, param.shape[0]))
    param.data.narrow(0, 0, held).copy_(loaded.narrow(0, first, held))
    param.data[held:].zero_()


class VocabParallelEmbedding(nn.Embedding):
    """Token embeddings split by vocabulary range; a token outside a rank's range embeds as zeros
    there, and the sum over ranks gives every token its row."""

    def __init__(self, vocab_size: int, hidden_size: int):
        first, rows = vocab_shard(vocab_size)
        super().__init__(rows, hidden_size)
        self.first_token = first
        self.vocab_size = vocab_size
        self.sharded = get_tp().world_size > 1
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _load_vocab_rows(param, loaded, self.first_token, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return super().forward(input_ids)
        local = input_ids - self.first_token
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(UsesLayerKernels, nn.Linear):
    """The output projection over this rank's vocabulary range (the embedding's layout, so a tied
    head shares the embedding's Parameter); `gather_logits` assembles the full rows. Its GEMM is
    the installed kernels' `dense_linear` where that takes the shape (a decode step's rows), else
    F.linear."""

    def __init__(self, hidden_size: int, vocab_size: int, device=None):
        first, rows = vocab_shard(vocab_size)
        super().__init__(hidden_size, rows, bias=False, device=device)
        self.first_token = first
        self.vocab_size = vocab_size
        self.weight.weight_loader = self._load

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dense_forward(hidden, self.weight, None)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _load_vocab_rows(param, loaded, self.first_token, self.vocab_size)


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, vocab] logits from every rank's [N, vocab / ranks] slice; the input itself where it holds
    every token (world size 1, or a head built whole on one of several ranks: `viewed_whole`)."""
    if local.shape[-1] >= vocab_size:
        return local
    return all_gather(local)[:, :vocab_size]


def check_tensor_parallel(hf_config, size: int) -> None:
    """Raise ConfigError when `size` ranks cannot split this model (heads, KV heads, MLP rows)."""
    if size == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    ffn = getattr(hf_config, "intermediate_size", None)
    expert_ffn = getattr(hf_config, "moe_intermediate_size", None)
    problems = []
    if heads % size:
        problems.append(f"its {heads} attention heads")
    if (kv_heads % size) if kv_heads >= size else (size % kv_heads):
        problems.append(f"its {kv_heads} KV heads (N must divide them, or be a multiple of them)")
    if ffn is not None and ffn % size:
        problems.append(f"its MLP width {ffn}")
    if expert_ffn is not None and expert_ffn % size:
        problems.append(f"its expert MLP width {expert_ffn}")
    if problems:
        raise ConfigError("tensor_parallel_size", f"{size} does not divide {' or '.join(problems)}; "
                          "choose a tensor-parallel size that does")


def stage_embedding(vocab_size: int, hidden_size: int, tied: bool) -> VocabParallelEmbedding | None:
    """The token embedding, held by the first pipeline stage, and by the last too when the LM head
    is tied to it (every rank without stages); None on the other stages."""
    pp = get_pp()
    return VocabParallelEmbedding(vocab_size, hidden_size) if pp.is_first or (tied and pp.is_last) else None


def stage_lm_head(hidden_size: int, vocab_size: int, embedding: VocabParallelEmbedding | None,
                  tied: bool) -> ParallelLMHead | None:
    """The LM head, held by the last pipeline stage (every rank without stages); None before it.
    A tied head is a Linear over the embedding's own Parameter, so a platform can swap the module
    (e.g. for a prepacked one) without knowing about tying."""
    if not get_pp().is_last:
        return None
    head = ParallelLMHead(hidden_size, vocab_size, device="meta" if tied else None)
    if tied:
        head.weight = embedding.weight
    return head
