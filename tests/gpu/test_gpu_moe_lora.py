"""LoRA on MoE experts compiled on the GPU (`fused_moe_lora`) against the experts' torch path with
the same adapters, at Qwen3-30B-A3B's layer shape (128 experts, top 8, hidden 2048, experts 768
wide) in bf16: a decode batch, a prefill chunk, tokens of several adapters and of none."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl.backends.triton.lora.moe_lora import fused_moe_lora  # noqa: E402
from corectl.lora.experts import ExpertLoRA  # noqa: E402
from corectl.lora.layers import LoRABatch  # noqa: E402
from corectl.models.moe import FusedMoE, fused_moe_torch, select_experts  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K, SLOTS, RANK = 128, 2048, 768, 8, 4, 16
CUDA = torch.device("cuda")


def _adapters(token_slots: list[int]) -> ExpertLoRA:
    batch = LoRABatch(SLOTS, len(token_slots), CUDA)
    batch.token_slots[:] = torch.tensor(token_slots, dtype=torch.int32, device=CUDA)
    lora = ExpertLoRA(FusedMoE(EXPERTS, HIDDEN, INTER, TOP_K, True), batch, SLOTS, RANK, torch.bfloat16, CUDA)
    shapes = {"gate_up_proj": ((EXPERTS, 2, RANK, HIDDEN), (EXPERTS, 2 * INTER, RANK)),
              "down_proj": ((EXPERTS, 1, RANK, INTER), (EXPERTS, HIDDEN, RANK))}
    for slot in range(SLOTS):
        lora.load_slot(slot, {p: tuple(torch.randn(s, device=CUDA) / s[-1] ** 0.5 for s in pair)
                              for p, pair in shapes.items()})
        batch.scales[slot] = batch.scale_list[slot] = 0.5 + slot
        batch.ranks[slot] = RANK
    return lora


@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_fused_moe_lora_matches_the_torch_path_at_a_real_shape(num_tokens):
    generator = torch.Generator().manual_seed(num_tokens)
    # Every slot and the base in the batch (the first token always adapted).
    token_slots = [0, *torch.randint(-1, SLOTS, (num_tokens - 1,), generator=generator).tolist()]
    lora = _adapters(token_slots)
    hidden = torch.randn(num_tokens, HIDDEN, device=CUDA).bfloat16()
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=CUDA) / HIDDEN ** 0.5).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device=CUDA) / INTER ** 0.5).bfloat16()
    weights, ids = select_experts(torch.randn(num_tokens, EXPERTS, device=CUDA), TOP_K, renormalize=True)
    out = fused_moe_lora(hidden, gate_up, down, weights, ids, lora).float()
    ref = fused_moe_torch(hidden, gate_up, down, weights, ids, lora=lora).float()
    base = fused_moe_torch(hidden, gate_up, down, weights, ids).float()
    error = (out - ref).norm() / ref.norm()
    delta = (ref - base).norm() / ref.norm()
    print(f"{num_tokens} tokens: relative error {error:.2e}, adapters move the output by {delta:.2e}")
    assert error < 2e-2 and delta > 10 * error
