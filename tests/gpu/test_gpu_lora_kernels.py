"""The dense LoRA kernels compiled on the GPU at llama3-8b's projection shapes in bf16: a W10-style
decode step (256 tokens of 8 adapters and the base) in sorted tiles and gathered, and a mixed step
(those and three prompts) in sorted tiles of 64 rows, against the fp32 torch reference; a batch-1 step on the stacked weights (x @ A.T from the base GEMV) against the
layers' shrink path; and sleep level 1 keeping a stacked weight one storage."""
from __future__ import annotations

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl.backends.triton.layer_kernels import triton_layer_kernels  # noqa: E402
from corectl.backends.triton.lora import lora_expand, lora_shrink  # noqa: E402
from corectl.lora.layers import LoRABatch, attach_lora  # noqa: E402
from corectl.lora.punica import LoRASegments, expand_reference, shrink_reference  # noqa: E402
from corectl.models.kernels import install_layer_kernels  # noqa: E402
from corectl.models.parallel import PackedLinear, RowParallelLinear  # noqa: E402
from corectl.worker.sleep import OffloadedTensors  # noqa: E402
from torch import nn  # noqa: E402

CUDA = torch.device("cuda")
HIDDEN, INTER, RANK, SLOTS = 4096, 14336, 16, 8
# (input features, slice widths, gated): qkv's three slices, and down's gated input.
PROJECTIONS = {"qkv": (HIDDEN, [4096, 1024, 1024], False), "down": (INTER, [HIDDEN], True)}


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("projection", list(PROJECTIONS))
@pytest.mark.parametrize("form", ["sorted", "gathered", "mixed"])
def test_decode_step_of_eight_adapters_matches_reference(projection, form):
    """`mixed`: the decode tokens and three prompts of 300 rows (two adapters and the base), a
    mixed step's sorted tiles of 64 rows (the prefill knobs)."""
    k, widths, gated = PROJECTIONS[projection]
    generator = torch.Generator().manual_seed(0)
    # Round-robin over the slots, every ninth token the base: slots unsorted, 32-ish tokens each.
    req_slots = [-1 if t % 9 == 8 else t % SLOTS for t in range(256)] + ([1, 5, -1] if form == "mixed" else [])
    lens = np.array([1] * 256 + [300] * (len(req_slots) - 256), dtype=np.int32)
    token_slots = np.repeat(np.array(req_slots, dtype=np.int32), lens)
    rows = token_slots.shape[0]
    batch = LoRABatch(SLOTS, 2048, CUDA)
    batch.sorted = form != "gathered"
    batch.write_slots(token_slots, tiles=True, prefill=form == "mixed")
    if form == "mixed":
        keep = np.array(req_slots) >= 0
        seg = torch.tensor(np.stack([(np.cumsum(lens) - lens)[keep], lens[keep], np.array(req_slots)[keep]]),
                           dtype=torch.int32, device=CUDA)
        batch.segments = LoRASegments(seg[0], seg[1], seg[2], 300)
    layout = batch.kernel_layout(rows)
    assert (layout is None) == (form == "gathered")
    assert form == "gathered" or layout.max_len == (64 if form == "mixed" else 16)
    slots = batch.token_slots[:rows]
    x = torch.randn(rows, 2 * k if gated else k, generator=generator).to(CUDA, torch.bfloat16)
    a = (torch.randn(SLOTS, len(widths) * RANK, k, generator=generator) / k ** 0.5).to(CUDA, torch.bfloat16)
    b = (torch.randn(SLOTS, sum(widths), RANK, generator=generator) / RANK ** 0.5).to(CUDA, torch.bfloat16)
    scales = torch.linspace(0.5, 2.0, SLOTS, device=CUDA)
    out = torch.randn(rows, sum(widths), generator=generator).to(CUDA, torch.bfloat16)
    expected = out.float()
    activation = nn.functional.silu(x[:, :k].float()) * x[:, k:].float() if gated else x.float()
    xa = shrink_reference(activation, a.float(), slots)
    first = 0
    for j, width in enumerate(widths):
        expand_reference(xa[:, j * RANK:(j + 1) * RANK], b[:, first:first + width].float(), scales, slots,
                         expected[:, first:first + width])
        first += width
    parts = lora_shrink(x, a, slots, layout, check_indices=True, gated=gated)
    assert _relative(parts.sum(0)[slots >= 0], xa[slots >= 0]) < 1e-2
    before = out.clone()
    lora_expand(parts, b, scales, slots, layout, out, widths, check_indices=True)
    assert torch.equal(out[slots < 0], before[slots < 0])
    error, moved = _relative(out, expected), _relative(before, expected)
    print(f"{projection} {form}: relative error {error:.2e}, adapters move the output by {moved:.2e}")
    assert error < 1e-2 and moved > 10 * error


def _model(stacked: bool, monkeypatch) -> tuple[nn.Module, LoRABatch]:
    monkeypatch.setenv("CORECTL_LORA_STACKED", "1" if stacked else "0")
    generator = torch.Generator().manual_seed(1)
    model = nn.Module()
    model.qkv_proj = PackedLinear(HIDDEN, {"q": 4096, "k": 1024, "v": 1024}, bias=False, unit=128)
    model.down_proj = RowParallelLinear(INTER, HIDDEN, bias=False)
    for param in model.parameters():
        param.data = (torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5).to(CUDA, torch.bfloat16)
    batch = LoRABatch(SLOTS, 16, CUDA)
    attach_lora(model, batch, SLOTS, RANK, torch.bfloat16, CUDA)
    for name, layer in [("qkv", model.qkv_proj), ("down", model.down_proj)]:
        projections = {"qkv": [("q_proj", 4096), ("k_proj", 1024), ("v_proj", 1024)], "down": [("down_proj", HIDDEN)]}
        for slot in range(SLOTS):
            layer.load_slot(slot, {p: (torch.randn(RANK, layer.base.in_features, generator=generator) / 64,
                                       torch.randn(n, RANK, generator=generator) / 4) for p, n in projections[name]})
    install_layer_kernels(model, triton_layer_kernels())
    batch.scales.copy_(torch.linspace(0.5, 2.0, SLOTS))
    return model, batch


def test_batch_one_on_stacked_weights_matches_the_shrink_path(monkeypatch):
    """One token of slot 5, then one of the base: the stacked GEMV (base output and every slot's
    x @ A.T) and the expand give what the base layer, the shrink and the expand give."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(1, HIDDEN, generator=generator).to(CUDA, torch.bfloat16)
    gate_up = torch.randn(1, 2 * INTER, generator=generator).to(CUDA, torch.bfloat16)
    results = {}
    for stacked in (True, False):
        model, batch = _model(stacked, monkeypatch)
        assert (model.qkv_proj.stacked is not None) == stacked
        for slot in (5, -1):
            batch.write_slots(np.array([slot], dtype=np.int32), tiles=True)
            results[stacked, slot] = (model.qkv_proj(x), model.down_proj.forward_gated(gate_up))
    for slot in (5, -1):
        for got, expected in zip(results[True, slot], results[False, slot]):
            error = _relative(got, expected)
            print(f"slot {slot}: stacked against apart, relative error {error:.2e}")
            assert error < 1e-2
    assert _relative(results[True, 5][0], results[True, -1][0]) > 0.05


def test_sleep_keeps_a_stacked_weight_one_storage(monkeypatch):
    model, _ = _model(True, monkeypatch)
    qkv = model.qkv_proj
    before = qkv.stacked.clone()
    offloaded = OffloadedTensors(model)
    assert qkv.base.weight.numel() == 0
    offloaded.restore()
    assert qkv.base.weight.data_ptr() == qkv.stacked.data_ptr()
    assert qkv.lora_a.untyped_storage().data_ptr() == qkv.stacked.untyped_storage().data_ptr()
    assert torch.equal(qkv.stacked, before)
    qkv.lora_a[0].fill_(1.0)
    assert (qkv.stacked[6144:6144 + 3 * RANK] == 1.0).all()
