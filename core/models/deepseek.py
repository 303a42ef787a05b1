"""DeepSeek V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`; V2-Lite, V3/R1 shapes).

Following transformers' implementations operation for operation:
  - multi-head latent attention (MLA, `corectl.models.mla`): a latent paged cache of
    kv_lora_rank + qk_rope_head_dim numbers per token and layer, attended with the key and value
    up-projections absorbed into the query and the output;
  - mixture-of-experts layers from `first_k_dense_replace` on, each with shared experts
    (`n_shared_experts` x `moe_intermediate_size`) and a router in fp32: V2 softmaxes and picks
    the top-k (within the `topk_group` best groups for `group_limited_greedy`); V3 sigmoids,
    ranks by score plus `e_score_correction_bias`, keeps the `topk_group` groups with the best
    two-expert sums, and renormalises (`norm_topk_prob`); both scale by `routed_scaling_factor`.

Tensor parallelism splits the heads (`corectl.models.mla`) and the experts' rows, dense weights only
(quantized MLA projections run at one rank); pipeline stages split the layers as Llama's do
(`corectl.models.pipeline`), each stage's latent cache holding its layers.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from ..attention import ForwardContext
from ..distributed import get_pp
from .base import CausalLM
from .layers import RMSNorm, RotaryEmbedding
from .kernels import UsesLayerKernels
from .llama import GatedMLP
from .mla import MLAttention, latent_cache_layout
from .moe import TORCH_EXPERTS_BLOCKER, FusedMoE, fused_moe_torch, load_moe_weights
from .parallel import gather_logits, stage_embedding, stage_lm_head
from .pipeline import (
    IntermediateTensors,
    build_stage_layers,
    held_by_other_stage,
    held_layers,
    stage_input,
    stage_layers,
)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def select_deepseek_experts(logits: torch.Tensor, config, correction: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) of fp32 router logits by V2's or V3's rule (module doc)."""
    num_experts, top_k = logits.shape[-1], config.num_experts_per_tok
    groups, keep = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if correction is not None:
        scores = logits.sigmoid()
        choice = scores + correction
        group_scores = choice.view(-1, groups, num_experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
        ids = _in_best_groups(choice, group_scores, keep, float("-inf")).topk(top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if getattr(config, "topk_method", "greedy") == "group_limited_greedy":
            group_scores = scores.view(-1, groups, num_experts // groups).max(dim=-1).values
            scores = _in_best_groups(scores, group_scores, keep, 0.0)
        weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * config.routed_scaling_factor, ids


def _in_best_groups(scores: torch.Tensor, group_scores: torch.Tensor, keep: int, fill: float) -> torch.Tensor:
    """`scores` with experts outside each token's `keep` best groups set to `fill`."""
    groups = group_scores.shape[-1]
    mask = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, k=keep, dim=-1, sorted=False)[1], 1)
    mask = mask.unsqueeze(-1).expand(-1, groups, scores.shape[-1] // groups).reshape(scores.shape)
    return scores.masked_fill(~mask.bool(), fill)


class DeepseekExperts(FusedMoE):
    """Routed experts picking by DeepSeek's rules from fp32 logits (module doc)."""

    def __init__(self, config, correction: bool):
        super().__init__(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                         config.num_experts_per_tok, renormalize=False)
        self.config = config
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(config.n_routed_experts), requires_grad=False)
                                        if correction else None)

    @property
    def runs_kernel(self) -> bool:
        """Whether the worker's pre-routed MoE kernel runs these experts (it reads nothing back to the
        host); block-FP8 experts keep the torch path, which dequantizes each expert as it reads it."""
        return self.kernels is not None and self.kernels.fused_moe_routed is not None and self.weight_block is None

    @property
    def plain_routing(self) -> bool:
        """V2's greedy rule unscaled (V2-Lite): a softmax top-k, which the installed kernel routes
        itself in one launch."""
        return (self.e_score_correction_bias is None and getattr(self.config, "topk_method", "greedy") == "greedy"
                and self.config.routed_scaling_factor == 1.0)

    def run_experts(self, hidden: torch.Tensor, router_logits: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None) -> torch.Tensor:
        scales = {} if gate_up_scale is None else {"gate_up_scale": gate_up_scale, "down_scale": down_scale}
        if self.runs_kernel and self.plain_routing:
            return self.kernels.fused_moe(hidden, self.gate_up_proj, self.down_proj, router_logits, self.top_k,
                                          False, **scales)
        correction = None if self.e_score_correction_bias is None else self.e_score_correction_bias.float()
        weights, ids = select_deepseek_experts(router_logits, self.config, correction)
        if self.runs_kernel:
            return self.kernels.fused_moe_routed(hidden, self.gate_up_proj, self.down_proj, weights, ids, **scales)
        return fused_moe_torch(hidden, self.gate_up_proj, self.down_proj, weights, ids, gate_up_scale, down_scale,
                               weight_block=self.weight_block)


class RouterFp32(nn.Module):
    """The router's weight, applied in fp32 as transformers does (V3 stores it in fp32); not an
    nn.Linear, so a platform swapping linear layers for its own GEMMs leaves it alone."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight.float())


class DeepseekMoE(UsesLayerKernels, nn.Module):
    def __init__(self, config, correction: bool):
        super().__init__()
        self.gate = RouterFp32(config.hidden_size, config.n_routed_experts)
        self.experts = DeepseekExperts(config, correction)
        width = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = GatedMLP(SimpleNamespace(hidden_size=config.hidden_size, intermediate_size=width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # fp32 operands, as the router's own linear takes (decode sizes: one GEMV launch, where
        # cuBLAS's fp32 GEMV is a dot and a reduce).
        logits = self.router_forward(self.gate, hidden, dtype=torch.float32)
        return self.experts(hidden, logits) + self.shared_experts(hidden)


class DeepseekLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, interleave: bool, correction: bool):
        super().__init__()
        self.self_attn = MLAttention(config, layer_idx, rotary, interleave)
        dense = layer_idx < config.first_k_dense_replace or not config.n_routed_experts
        self.mlp = GatedMLP(config) if dense else DeepseekMoE(config, correction)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, ctx: ForwardContext):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekModel(nn.Module):
    """The decoder stack, or this pipeline stage's run of it, as Llama's (`DecoderModel`)."""

    def __init__(self, config, max_positions: int, dtype: torch.dtype, interleave: bool, correction: bool,
                 tied: bool):
        super().__init__()
        pp = get_pp()
        self.embed_tokens = stage_embedding(config.vocab_size, config.hidden_size, tied)
        rotary = RotaryEmbedding(config, config.qk_rope_head_dim, max_positions, dtype)
        self.layers = build_stage_layers(config.num_hidden_layers,
                                         lambda i: DeepseekLayer(config, i, rotary, interleave, correction))
        self.stage_layers = stage_layers(config.num_hidden_layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None

    def forward(self, input_ids, positions, ctx: ForwardContext,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        hidden, residual = stage_input(self.embed_tokens, input_ids, intermediate)
        for index in self.stage_layers:
            hidden, residual = self.layers[index](positions, hidden, residual, ctx)
        if self.norm is None:
            return IntermediateTensors(hidden, residual)
        return self.norm(hidden, residual)[0]


class DeepseekV2ForCausalLM(CausalLM):
    supports_pipeline_parallel = True
    graph_capture_blocker = TORCH_EXPERTS_BLOCKER
    correction = False

    def __init__(self, config, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.config = config
        interleave = self.correction is False or bool(getattr(config, "rope_interleave", True))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = DeepseekModel(config, max_positions, dtype, interleave, self.correction, self.tie_word_embeddings)
        self.lm_head = stage_lm_head(config.hidden_size, config.vocab_size, self.model.embed_tokens,
                                     self.tie_word_embeddings)
        self.kv_cache_layout = latent_cache_layout(config)

    @property
    def supports_graph_capture(self) -> bool:
        """Decode steps replay in CUDA graphs once every MoE layer's experts run the installed kernel
        (the worker installs kernels before it captures; until then, and on the torch path, not)."""
        return all(layer.mlp.experts.runs_kernel for layer in held_layers(self.model)
                   if isinstance(layer.mlp, DeepseekMoE))

    def forward(self, input_ids, positions, ctx: ForwardContext,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, ctx, intermediate)

    def after_loading(self) -> None:
        for layer in held_layers(self.model):
            layer.self_attn.absorb_weights()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head(hidden), self.config.vocab_size).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((name.replace(".self_attn.q_proj.", ".self_attn.q_full_proj.")
                    .replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"), tensor)
                   for name, tensor in weights)
        return load_moe_weights(self, renamed, self._skips)

    def _skips(self, name: str) -> bool:
        """Rotary buffers, a tied head, V3's multi-token-prediction layers (numbered past the
        model's layers: speculative heads this model does not run), other pipeline stages' parts."""
        match = _LAYER.match(name)
        return ("rotary_emb" in name or (self.tie_word_embeddings and name == "lm_head.weight")
                or (match is not None and int(match[1]) >= self.config.num_hidden_layers)
                or held_by_other_stage(self, name))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    correction = True
