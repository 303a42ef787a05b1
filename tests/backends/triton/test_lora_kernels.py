"""LoRA shrink and expand kernels (segment and gathered forms) against the per-token torch reference."""
import pytest
import torch
from corectl.backends.triton.lora import lora_expand, lora_shrink
from corectl.lora.punica import LoRASegments, expand_reference, shrink_reference

DTYPES = [torch.float32, torch.bfloat16]
# Requests of 3, 1, 5 and 2 tokens: adapter slot 1, base, slot 0, slot 1 again.
REQUESTS = [(3, 1), (1, -1), (5, 0), (2, 1)]


def _layout(requests, decode: bool):
    slots = torch.tensor([s for n, s in requests for _ in range(n)], dtype=torch.int32)
    if decode:
        return slots, None
    starts, lens, seg_slots, start = [], [], [], 0
    for n, s in requests:
        if s >= 0:
            starts.append(start), lens.append(n), seg_slots.append(s)
        start += n
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return slots, LoRASegments(as_i32(starts), as_i32(lens), as_i32(seg_slots), max(lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decode", [True, False], ids=["gathered", "segment"])
@pytest.mark.parametrize("rank", [8, 24])
def test_shrink_matches_reference(dtype, decode, rank, assert_close):
    requests = [(1, s) for _, s in REQUESTS] if decode else REQUESTS
    slots, segments = _layout(requests, decode)
    x = torch.randn(slots.shape[0], 40).to(dtype)
    a = torch.randn(2, rank, 40).to(dtype)
    parts = lora_shrink(x, a, slots, segments, check_indices=True)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (slots.shape[0], rank)
    assert (parts[:, slots < 0] == 0).all()
    # The interpreter sums in another order than the reference's bmm; inputs are exact in fp32.
    torch.testing.assert_close(parts.sum(0), shrink_reference(x, a, slots), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("decode", [True, False], ids=["gathered", "segment"])
def test_gated_shrink_forms_the_activation(decode):
    """A down projection's shrink takes the gated MLP's [gate | up] and multiplies silu(gate) * up."""
    slots, segments = _layout([(1, s) for _, s in REQUESTS] if decode else REQUESTS, decode)
    gate_up, a = torch.randn(slots.shape[0], 2 * 40), torch.randn(2, 8, 40)
    gate, up = gate_up.chunk(2, dim=-1)
    parts = lora_shrink(gate_up, a, slots, segments, gated=True)
    expected = shrink_reference(torch.nn.functional.silu(gate) * up, a, slots)
    torch.testing.assert_close(parts.sum(0), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("decode", [True, False], ids=["gathered", "segment"])
def test_shrink_splits_the_input_features(decode, assert_close):
    """One token (or one short prompt) spreads its reduction over many programs, each over its share
    of the 3000 input features (the last share ragged); the segment form sums the shares itself."""
    slots, segments = _layout([(1, 1)] if decode else [(3, 1)], decode)
    x, a = torch.randn(slots.shape[0], 3000), torch.randn(2, 8, 3000)
    parts = lora_shrink(x, a, slots, segments)
    assert parts.shape[0] > 1 if decode else parts.shape[0] == 1
    # Relative to the whole result: a near-zero sum of 3000 fp32 terms has no useful elementwise bound.
    assert_close(parts.sum(0), shrink_reference(x, a, slots), tol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decode", [True, False], ids=["gathered", "segment"])
@pytest.mark.parametrize("rank", [16, 128])
def test_expand_adds_every_slice(dtype, decode, rank, assert_close):
    """One launch adds three slices (widths 24, 8 and 16, the middle 48 of 64 columns), slice j from
    columns j of the shrink's three partial sums, and touches only rows with an adapter."""
    requests = [(1, s) for _, s in REQUESTS] if decode else REQUESTS
    slots, segments = _layout(requests, decode)
    num_tokens = slots.shape[0]
    parts = torch.randn(3, num_tokens, 3 * rank)
    b = torch.randn(2, 48, rank).to(dtype)
    scales = torch.tensor([0.5, 2.0])
    out = torch.randn(num_tokens, 64).to(dtype)
    expected = out.clone()
    xa = parts.sum(0)
    for j, (first, last) in enumerate([(0, 24), (24, 32), (32, 48)]):
        expand_reference(xa[:, j * rank:(j + 1) * rank], b[:, first:last], scales, slots,
                         expected[:, 8 + first:8 + last])
    before = out.clone()
    lora_expand(parts, b, scales, slots, segments, out[:, 8:56], [24, 8, 16], check_indices=True)
    assert torch.equal(out[:, :8], before[:, :8]) and torch.equal(out[:, 56:], before[:, 56:])
    assert torch.equal(out[slots < 0], before[slots < 0])
    if dtype == torch.float32:
        assert_close(out, expected)
    else:
        # Base output and delta are each bf16-sized: where they cancel, the sum keeps their absolute step.
        step = 2.0 ** -7 * expected.float().abs().max().item()
        torch.testing.assert_close(out.float(), expected.float(), rtol=2.0 ** -6, atol=2 * step)


def test_launchers_name_bad_arguments():
    x, a = torch.randn(4, 32), torch.randn(2, 8, 32)
    slots = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="token_slots values must lie in"):
        lora_shrink(x, a, slots, check_indices=True)
    with pytest.raises(ValueError, match="token_slots must be int32"):
        lora_shrink(x, a, slots.long())
    with pytest.raises(ValueError, match="a has 32 input features, x has 16"):
        lora_shrink(torch.randn(4, 16), a, slots)
    with pytest.raises(ValueError, match="out must be"):
        lora_expand(torch.randn(1, 4, 8), torch.randn(2, 10, 8), torch.ones(2), slots.clamp(max=1), None,
                    torch.zeros(4, 12))
    with pytest.raises(ValueError, match=r"slice_sizes \[6, 6\] must be 1 to 3 widths adding up to b's 10 rows"):
        lora_expand(torch.randn(1, 4, 16), torch.randn(2, 10, 8), torch.ones(2), slots.clamp(max=1), None,
                    torch.zeros(4, 10), [6, 6])


@pytest.mark.parametrize("decode", [True, False], ids=["gathered", "segment"])
def test_layer_with_kernels_matches_torch_path(decode):
    """A packed qkv layer with three adapters in slots: the Triton kernels (installed as layer
    kernels) add what the grouped torch path adds, into the q, k and v slices."""
    from corectl.backends.triton.layer_kernels import triton_layer_kernels
    from corectl.lora.layers import LoRABatch, attach_lora
    from corectl.lora.manager import slot_groups
    from corectl.models.parallel import PackedLinear
    from torch import nn

    model = nn.Module()
    model.qkv_proj = PackedLinear(32, {"q": 32, "k": 16, "v": 16}, bias=False, unit=8)
    nn.init.normal_(model.qkv_proj.weight)
    batch = LoRABatch(max_loras=3, max_tokens=16, device=torch.device("cpu"))
    modules = attach_lora(model, batch, max_loras=3, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    for slot, rank in enumerate([8, 16, 4]):
        pairs = {proj: (torch.randn(rank, 32), torch.randn(out, rank)) for proj, out in
                 [("q_proj", 32), ("k_proj", 16), ("v_proj", 16)]}
        model.qkv_proj.load_slot(slot, pairs)
        batch.ranks[slot], batch.scale_list[slot] = rank, 0.5 * (slot + 1)
        batch.scales[slot] = batch.scale_list[slot]
    assert set(modules) == {"q_proj", "k_proj", "v_proj"}
    requests = [(1, s) for _, s in REQUESTS] + [(1, 2)] if decode else REQUESTS + [(2, 2)]
    slots, segments = _layout(requests, decode)
    num_tokens = slots.shape[0]
    batch.token_slots[:num_tokens] = slots
    starts = torch.tensor([0] + [n for n, _ in requests]).cumsum(0)[:-1].to(torch.int32).numpy()
    lens = torch.tensor([n for n, _ in requests], dtype=torch.int32).numpy()
    req_slots = torch.tensor([s for _, s in requests], dtype=torch.int32).numpy()
    keep = req_slots >= 0
    batch.groups = slot_groups(starts[keep], lens[keep], req_slots[keep], torch.device("cpu"))
    batch.segments, batch.active = segments, True
    x = torch.randn(num_tokens, 32)
    torch_path = model.qkv_proj(x)
    model.qkv_proj.kernels = triton_layer_kernels()
    with_kernels = model.qkv_proj(x)
    torch.testing.assert_close(with_kernels, torch_path, rtol=1e-4, atol=1e-4)
    base = model.qkv_proj.base(x)
    assert torch.equal(with_kernels[slots < 0], base[slots < 0])
    assert not torch.allclose(with_kernels[slots >= 0], base[slots >= 0])
