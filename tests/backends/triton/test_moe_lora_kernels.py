"""LoRA inside the fused MoE layer (`fused_moe_lora`, under the interpreter) against the experts'
torch path with the same adapters (`fused_moe_torch(..., lora=...)`): tokens of several adapter
slots and of none in one batch, a rank below the slots' rank, FP8 experts."""
from __future__ import annotations

import pytest
import torch
from corectl.backends.triton.lora.moe_lora import fused_moe_lora
from corectl.lora.experts import ExpertLoRA
from corectl.lora.layers import LoRABatch
from corectl.models.moe import FusedMoE, fused_moe_torch, select_experts
from support.close import BF16_STEP

NUM_EXPERTS, HIDDEN, INTER, TOP_K, SLOTS, MAX_RANK = 4, 32, 24, 2, 3, 16


def adapters(dtype: torch.dtype, token_slots: list[int]) -> ExpertLoRA:
    """Three slots: rank 16, rank 8 (zero past it, as the manager loads it) and one on gate_up only."""
    batch = LoRABatch(SLOTS, len(token_slots) + 3, torch.device("cpu"))
    batch.token_slots[:len(token_slots)] = torch.tensor(token_slots, dtype=torch.int32)
    lora = ExpertLoRA(FusedMoE(NUM_EXPERTS, HIDDEN, INTER, TOP_K, True), batch, SLOTS, MAX_RANK, dtype,
                      torch.device("cpu"))
    e, h, i = NUM_EXPERTS, HIDDEN, INTER
    for slot, (rank, stacks) in enumerate([(16, ("gate_up_proj", "down_proj")), (8, ("gate_up_proj", "down_proj")),
                                           (4, ("gate_up_proj",))]):
        shapes = {"gate_up_proj": ((e, 2, rank, h), (e, 2 * i, rank)), "down_proj": ((e, 1, rank, i), (e, h, rank))}
        lora.load_slot(slot, {p: tuple(torch.randn(s) / s[-1] ** 0.5 for s in shapes[p]) for p in stacks})
        batch.scales[slot] = batch.scale_list[slot] = 0.5 + slot
        batch.ranks[slot] = rank
    return lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_slots", [[1], [0, -1, 2, 0, 1, -1, 1, 1, 0], [-1, -1]], ids=["decode", "mixed", "base"])
def test_fused_moe_lora_matches_the_torch_path(dtype, token_slots, assert_close):
    num_tokens = len(token_slots)
    lora = adapters(dtype, token_slots)
    hidden = torch.randn(num_tokens, HIDDEN).to(dtype)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN) / HIDDEN ** 0.5).to(dtype)
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER) / INTER ** 0.5).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, NUM_EXPERTS), TOP_K, renormalize=True)
    out = fused_moe_lora(hidden, gate_up, down, weights, ids, lora)
    ref = fused_moe_torch(hidden, gate_up, down, weights, ids, lora=lora)
    assert out.dtype == dtype
    tolerance = {} if dtype == torch.float32 else dict(tol=6 * BF16_STEP, norm="max")
    assert_close(out, ref, **tolerance)
    # Base tokens get the experts alone; every adapted token moves.
    adapted = torch.tensor(token_slots) >= 0
    without = fused_moe_torch(hidden, gate_up, down, weights, ids)
    assert_close(out, torch.where(adapted[:, None], out, without), **tolerance)
    assert ((out[adapted] - without[adapted]).abs().amax(-1) > 1e-2).all()


def test_fp8_experts_take_the_adapters_before_their_row_scales_are_undone(assert_close):
    from corectl.quantization.fp8 import quantize_rows

    token_slots = [0, 1, -1, 2]
    lora = adapters(torch.bfloat16, token_slots)
    hidden = torch.randn(4, HIDDEN).to(torch.bfloat16)
    experts = {}
    for name, shape in {"gate_up": (NUM_EXPERTS, 2 * INTER, HIDDEN), "down": (NUM_EXPERTS, HIDDEN, INTER)}.items():
        quantized, scale = quantize_rows(torch.randn(shape).reshape(-1, shape[-1]) / shape[-1] ** 0.5)
        experts[name], experts[f"{name}_scale"] = quantized.view(shape), scale.view(shape[:2])
    weights, ids = select_experts(torch.randn(4, NUM_EXPERTS), TOP_K, renormalize=True)
    args = (hidden, experts["gate_up"], experts["down"], weights, ids)
    scales = dict(gate_up_scale=experts["gate_up_scale"], down_scale=experts["down_scale"])
    out = fused_moe_lora(*args, lora, **scales)
    assert_close(out, fused_moe_torch(*args, **scales, lora=lora), 6 * BF16_STEP, norm="max")
