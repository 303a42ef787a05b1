"""LoRA shrink and expand kernels (segment and gathered forms) against the per-token torch reference."""
import numpy as np
import pytest
import torch
from corectl.backends.triton.lora import lora_expand, lora_shrink
from corectl.backends.triton.lora.config import SortedConfig
from corectl.lora.punica import LoRASegments, expand_reference, shrink_reference, sorted_tiles
from support.close import BF16_STEP

DTYPES = [torch.float32, torch.bfloat16]
# Sorted tiles of a decode step (16 rows), of W10's decode tile (32) and of a mixed step's (64 rows:
# the kernels' prefill knobs and row blocks).
TILES = {"sorted": 16, "sorted32": 32, "sorted_mixed": 64}
FORMS = ["gathered", "segment", *TILES]
# Requests of 3, 1, 5 and 2 tokens: adapter slot 1, base, slot 0, slot 1 again.
REQUESTS = [(3, 1), (1, -1), (5, 0), (2, 1)]
# A decode step of 37 tokens, slots unsorted: slot 1's 19 rows are two tiles of 16.
DECODE = [(1, s) for s in [1, -1, 0, 1, 1, 2] * 6 + [1]]


def _requests(form: str, requests=REQUESTS):
    return {"gathered": [(1, s) for _, s in requests], "segment": requests, "sorted": DECODE, "sorted32": DECODE,
            "sorted_mixed": requests + DECODE[:8]}[form]


def _layout(requests, form: str):
    slots = torch.tensor([s for n, s in requests for _ in range(n)], dtype=torch.int32)
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    if form == "gathered":
        return slots, None
    if form in TILES:
        # Padded as LoRABatch pads a graph's tiles: zero-length tiles past the step's.
        order, tiles = sorted_tiles(slots.numpy(), TILES[form])
        padded = torch.zeros(3, tiles.shape[1] + 2, dtype=torch.int32)
        padded[:, :tiles.shape[1]] = torch.from_numpy(tiles)
        return slots, LoRASegments(padded[0], padded[1], padded[2], TILES[form], torch.from_numpy(order))
    starts, lens, seg_slots, start = [], [], [], 0
    for n, s in requests:
        if s >= 0:
            starts.append(start), lens.append(n), seg_slots.append(s)
        start += n
    return slots, LoRASegments(as_i32(starts), as_i32(lens), as_i32(seg_slots), max(lens))


def test_sorted_tiles_cover_each_slots_rows():
    """Every adapted row once, in tiles of one slot and at most 16 rows; base rows in none."""
    slots = torch.tensor([s for _, s in DECODE], dtype=torch.int32).numpy()
    order, (starts, lens, tile_slots) = sorted_tiles(slots, 16)
    assert sorted(order.tolist()) == [i for i, s in enumerate(slots) if s >= 0]
    assert lens.tolist() == [6, 16, 3, 6] and tile_slots.tolist() == [0, 1, 1, 2]
    for start, length, slot in zip(starts, lens, tile_slots):
        assert (slots[order[start:start + length]] == slot).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rank", [8, 24])
def test_shrink_matches_reference(dtype, form, rank, assert_close):
    slots, segments = _layout(_requests(form), form)
    x = torch.randn(slots.shape[0], 40).to(dtype)
    a = torch.randn(3, rank, 40).to(dtype)
    parts = lora_shrink(x, a, slots, segments, check_indices=True)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (slots.shape[0], rank)
    adapted = slots >= 0
    if form not in TILES:  # sorted tiles leave base rows unwritten: the expand never reads them
        assert (parts[:, ~adapted] == 0).all()
    # The interpreter sums in another order than the reference's bmm; inputs are exact in fp32.
    torch.testing.assert_close(parts.sum(0)[adapted], shrink_reference(x, a, slots)[adapted], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", FORMS)
def test_gated_shrink_forms_the_activation(form):
    """A down projection's shrink takes the gated MLP's [gate | up] and multiplies silu(gate) * up."""
    slots, segments = _layout(_requests(form), form)
    gate_up, a = torch.randn(slots.shape[0], 2 * 40), torch.randn(3, 8, 40)
    gate, up = gate_up.chunk(2, dim=-1)
    parts = lora_shrink(gate_up, a, slots, segments, gated=True)
    expected = shrink_reference(torch.nn.functional.silu(gate) * up, a, slots)
    torch.testing.assert_close(parts.sum(0)[slots >= 0], expected[slots >= 0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", FORMS)
def test_shrink_splits_the_input_features(form, assert_close):
    """One token (or one short prompt, or one sorted tile) spreads its reduction over many programs,
    each over its share of the 3000 input features (the last share ragged); the segment form sums
    the shares itself, the sorted form leaves them to its expand."""
    slots, segments = _layout(_requests(form, [(3, 1)]), form)
    x, a = torch.randn(slots.shape[0], 3000), torch.randn(3, 8, 3000)
    parts = lora_shrink(x, a, slots, segments)
    assert parts.shape[0] == 1 if form == "segment" else parts.shape[0] > 1
    adapted = slots >= 0
    # Relative to the whole result: a near-zero sum of 3000 fp32 terms has no useful elementwise bound.
    assert_close(parts.sum(0)[adapted], shrink_reference(x, a, slots)[adapted], tol=1e-5)


def _expand_case(form: str, rank: int, widths: list[int], dtype: torch.dtype):
    """A random expand into the middle columns of a wider output: (arguments, expected output)."""
    slots, segments = _layout(_requests(form), form)
    num_tokens, width = slots.shape[0], sum(widths)
    parts = torch.randn(3, num_tokens, len(widths) * rank)
    b = torch.randn(3, width, rank).to(dtype)
    scales = torch.tensor([0.5, 2.0, -1.0])
    out = torch.randn(num_tokens, width + 16).to(dtype)
    expected = out.clone()
    xa, first = parts.sum(0), 0
    for j, size in enumerate(widths):
        expand_reference(xa[:, j * rank:(j + 1) * rank], b[:, first:first + size], scales, slots,
                         expected[:, 8 + first:8 + first + size])
        first += size
    return (parts, b, scales, slots, segments, out), expected


def _check_expand(out, before, expected, slots, dtype, assert_close, rank):
    assert torch.equal(out[:, :8], before[:, :8]) and torch.equal(out[:, -8:], before[:, -8:])
    assert torch.equal(out[slots < 0], before[slots < 0])
    if dtype == torch.float32:
        # The kernel sums the rank's products in another order than the reference's matmul: fp32
        # noise grows with the rank, and against the largest output (elementwise it may be a cancelled
        # sum's whole value). A wrong slice, slot or scale is off by whole units.
        assert_close(out, expected, tol=rank * 2.0 ** -24, norm="max")
    else:
        # Base output and delta are each bf16-sized: where they cancel, the sum keeps their absolute step.
        step = 2.0 ** -7 * expected.float().abs().max().item()
        torch.testing.assert_close(out.float(), expected.float(), rtol=2.0 ** -6, atol=2 * step)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rank", [16, 128])
def test_expand_adds_every_slice(dtype, form, rank, assert_close):
    """One launch adds three slices (widths 24, 8 and 16, the middle 48 of 64 columns), slice j from
    columns j of the shrink's three partial sums, and touches only rows with an adapter."""
    (parts, b, scales, slots, segments, out), expected = _expand_case(form, rank, [24, 8, 16], dtype)
    before = out.clone()
    lora_expand(parts, b, scales, slots, segments, out[:, 8:56], [24, 8, 16], check_indices=True)
    _check_expand(out, before, expected, slots, dtype, assert_close, rank)


def test_sorted_expand_program_covers_several_output_blocks(assert_close):
    """A sorted tile's program loops over output blocks of 64 columns (here two a program), each
    column in one slice: slices of 40, 72 and 24 columns cross the blocks' and programs' bounds."""
    (parts, b, scales, slots, segments, out), expected = _expand_case("sorted", 16, [40, 72, 24], torch.float32)
    before = out.clone()
    lora_expand(parts, b, scales, slots, segments, out[:, 8:144], [40, 72, 24], check_indices=True,
                config=SortedConfig(192, 8, 10))
    _check_expand(out, before, expected, slots, torch.float32, assert_close, 16)


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


@pytest.mark.parametrize("form, tiles", [("gathered", "16,64"), ("segment", "16,0"), ("segment", "16,64"),
                                         ("sorted", "16,64"), ("sorted", "32,64")])
def test_layer_with_kernels_matches_torch_path(form, tiles, monkeypatch):
    """A packed qkv layer with three adapters in slots: the Triton kernels (installed as layer
    kernels) add what the grouped torch path adds, into the q, k and v slices. Steps take the
    layout LoRABatch writes: a decode step gathered up to 16 tokens, sorted tiles of the decode tile
    rows past it; a prefill or mixed step sorted tiles of the prefill tile rows, or its segments
    (CORECTL_LORA_PREFILL_TILE=0). `tiles`: the decode and prefill tile rows."""
    from corectl.backends.triton.layer_kernels import triton_layer_kernels
    from corectl.lora.layers import LoRABatch, attach_lora
    from corectl.lora.manager import slot_groups
    from corectl.models.parallel import PackedLinear
    from torch import nn

    model = nn.Module()
    model.qkv_proj = PackedLinear(32, {"q": 32, "k": 16, "v": 16}, bias=False, unit=8)
    nn.init.normal_(model.qkv_proj.weight)
    decode_tile, prefill_tile = tiles.split(",")
    monkeypatch.setenv("CORECTL_LORA_TILE", decode_tile)
    monkeypatch.setenv("CORECTL_LORA_PREFILL_TILE", prefill_tile)
    batch = LoRABatch(max_loras=3, max_tokens=48, device=torch.device("cpu"))
    modules = attach_lora(model, batch, max_loras=3, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    for slot, rank in enumerate([8, 16, 4]):
        pairs = {proj: (torch.randn(rank, 32), torch.randn(out, rank)) for proj, out in
                 [("q_proj", 32), ("k_proj", 16), ("v_proj", 16)]}
        model.qkv_proj.load_slot(slot, pairs)
        batch.ranks[slot], batch.scale_list[slot] = rank, 0.5 * (slot + 1)
        batch.scales[slot] = batch.scale_list[slot]
    assert set(modules) == {"q_proj", "k_proj", "v_proj"}
    requests = _requests(form, REQUESTS + [(2, 2)])
    slots, segments = _layout(requests, form)
    num_tokens = slots.shape[0]
    batch.write_slots(slots.numpy(), tiles=True, prefill=form == "segment")
    starts = torch.tensor([0] + [n for n, _ in requests]).cumsum(0)[:-1].to(torch.int32).numpy()
    lens = torch.tensor([n for n, _ in requests], dtype=torch.int32).numpy()
    req_slots = torch.tensor([s for _, s in requests], dtype=torch.int32).numpy()
    keep = req_slots >= 0
    batch.groups = slot_groups(starts[keep], lens[keep], req_slots[keep], torch.device("cpu"))
    batch.segments, batch.active = (segments if form == "segment" else None), True
    layout = batch.kernel_layout(num_tokens)
    assert (layout is None) == (form == "gathered")
    # The segment form where prefill tiles are off; sorted tiles of the step's kind's rows elsewhere.
    expected_rows = {"gathered": None, "segment": int(prefill_tile) or None, "sorted": int(decode_tile)}[form]
    assert (None if layout is None or layout.order is None else layout.max_len) == expected_rows
    x = torch.randn(num_tokens, 32)
    torch_path = model.qkv_proj(x)
    model.qkv_proj.kernels = triton_layer_kernels()
    with_kernels = model.qkv_proj(x)
    torch.testing.assert_close(with_kernels, torch_path, rtol=1e-4, atol=1e-4)
    base = model.qkv_proj.base(x)
    assert torch.equal(with_kernels[slots < 0], base[slots < 0])
    assert not torch.allclose(with_kernels[slots >= 0], base[slots >= 0])


def test_batch_one_stacked_layers_match_torch_path(monkeypatch, assert_close):
    """Batch 1 with each slot's A rows stacked under the base weight: the base GEMV gives the base
    output and x @ A.T of every slot, the expand adds the token's slot's; a packed qkv (with a bias)
    and a gated down projection (silu(gate) * up formed by the GEMV) add what the torch path adds."""
    from corectl.backends.triton.layer_kernels import triton_layer_kernels
    from corectl.lora.layers import LoRABatch, attach_lora
    from corectl.lora.punica import SlotGroup
    from corectl.models.parallel import PackedLinear, RowParallelLinear
    from torch import nn

    monkeypatch.setenv("CORECTL_LORA_STACKED", "1")
    model = nn.Module()
    model.qkv_proj = PackedLinear(32, {"q": 64, "k": 32, "v": 32}, bias=True, unit=8)
    model.down_proj = RowParallelLinear(16, 128, bias=False)
    for param in model.parameters():
        nn.init.normal_(param)
    model.to(torch.bfloat16)
    batch = LoRABatch(max_loras=2, max_tokens=4, device=torch.device("cpu"))
    attach_lora(model, batch, max_loras=2, max_rank=2, dtype=torch.bfloat16, device=torch.device("cpu"))
    qkv, down = model.qkv_proj, model.down_proj
    for layer, shapes in [(qkv, [("q_proj", 64), ("k_proj", 32), ("v_proj", 32)]), (down, [("down_proj", 128)])]:
        assert layer.stacked is not None and layer.base.weight.data_ptr() == layer.stacked.data_ptr()
        for slot in range(2):
            layer.load_slot(slot, {p: (torch.randn(2, layer.base.in_features), torch.randn(n, 2)) for p, n in shapes})
    batch.scales[:] = torch.tensor([0.5, 2.0])
    batch.ranks, batch.scale_list = [2, 2], [0.5, 2.0]
    for slot in [1, -1]:
        batch.write_slots(np.array([slot], dtype=np.int32), tiles=True)
        batch.groups = [] if slot < 0 else [SlotGroup(slot, slice(0, 1))]
        x, gate_up = torch.randn(1, 32).bfloat16(), torch.randn(1, 32).bfloat16()
        activation = torch.nn.functional.silu(gate_up[:, :16]) * gate_up[:, 16:]
        qkv.kernels = down.kernels = None
        # The base token's reference is the base layer alone (the torch path has no group for it).
        expected_qkv, expected_down = (qkv(x), down(activation)) if slot >= 0 else (qkv.base(x), down.base(activation))
        qkv.kernels = down.kernels = triton_layer_kernels()
        assert qkv._stacked_forward(x, gated=False) is not None
        # Four bf16 roundings apart: silu, its product with up, x @ A.T (rounded before the expand, as
        # in PEFT's bf16 layers) and the output. The interpreter truncates, so all four may shrink the
        # value the same way (a GPU's round-to-nearest ones mostly cancel: tests/gpu checks those).
        assert_close(qkv(x), expected_qkv, tol=4 * BF16_STEP, norm="max")
        assert_close(down.forward_gated(gate_up), expected_down, tol=4 * BF16_STEP, norm="max")


def test_step_with_segments_runs_on_the_tiles_written():
    """A step with segments runs on the tiles its write_slots cut: a prefill or mixed step's 64 rows,
    a verify step's decode tiles (16 rows: it may replay a graph captured with them)."""
    from corectl.lora.layers import LoRABatch

    batch = LoRABatch(max_loras=3, max_tokens=48, device=torch.device("cpu"))
    slots, segments = _layout(REQUESTS, "segment")
    for prefill, rows in [(True, 64), (False, 16)]:
        batch.write_slots(slots.numpy(), tiles=True, prefill=prefill)
        batch.segments = segments
        assert batch.kernel_layout(slots.shape[0]).max_len == rows
        batch.reset()
        assert batch.kernel_layout(slots.shape[0]) is None  # 11 decode rows: gathered


def test_tile_rows_and_knobs_from_the_environment(monkeypatch):
    """The tile rows and knobs a measurement sets, and one clear error for a value the kernels cannot take."""
    from corectl import envs

    monkeypatch.setenv("CORECTL_LORA_TILE", "32")
    monkeypatch.setenv("CORECTL_LORA_PREFILL_TILE", "0")
    monkeypatch.setenv("CORECTL_LORA_PREFILL_KNOBS", "512,4,4096,128")
    assert envs.lora_tile_rows() == (32, 0) and envs.lora_knobs("prefill") == (512, 4, 4096, 128)
    assert envs.lora_knobs("decode") is None
    monkeypatch.setenv("CORECTL_LORA_TILE", "24")
    with pytest.raises(ValueError, match="CORECTL_LORA_TILE=24: expected 16, 32, 64 or 128"):
        envs.lora_tile_rows()
    monkeypatch.setenv("CORECTL_LORA_DECODE_KNOBS", "192,8,1024,48")
    with pytest.raises(ValueError, match="CORECTL_LORA_DECODE_KNOBS='192,8,1024,48': expected"):
        envs.lora_knobs("decode")
