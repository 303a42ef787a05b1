"""The dense LoRA kernels at llama3-8b's projections (`bash benchmarks/device_bench.sh sweep:lora`): one
layer's shrink + expand per launch config, replayed from a CUDA graph, in the steps W10 runs.

Cases (8 rank-16 adapters, max rank 16):
  - decode256: 256 decode tokens, adapters round-robin (W10's decode step);
  - decode1: one token (the gathered form; W2-style batch 1 without the stacked weight);
  - prefill: 16 prompts of 512 tokens, adapters round-robin (W10's first step, 8,192 rows);
  - mixed: 128 decode tokens and 15 prompts of 537 or 538 rows (8,192 rows: a W10 step while
    prompts are still being prefilled).
Forms: `gathered` (a program a token), `segment` (a program per request and row block: prefill
and mixed steps before sorted tiles, CORECTL_LORA_PREFILL_TILE=0) and `tiles=R` (rows sorted by
adapter in tiles of R rows) under each candidate `SortedConfig` (`CANDIDATES`); `*` marks what the
engine runs by default. Each row: microseconds a layer for qkv, o, gate_up and the gated down,
their sum, that times 32 layers (ms a step), and the largest relative error against the fp32
torch path of the four. The base projections' bf16 GEMMs (F.linear) at the case's rows are
printed first for scale. Adapter weights cycle through copies until a graph moves 256 MB, so decode
steps read them from HBM as a real step does (the base weights between layers evict them).
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
from corectl.backends.triton.bench.fp8 import graph_us
from corectl.backends.triton.lora import lora_expand, lora_shrink
from corectl.backends.triton.lora.config import CANDIDATES, DECODE, PREFILL
from corectl.lora.punica import LoRASegments, SlotGroup, grouped_lora, sorted_tiles

SLOTS, RANK, LAYERS = 8, 16, 32
HIDDEN, INTER = 4096, 14336
# (input features, output slices, gated input): llama3-8b's adapted projections.
SHAPES = {"qkv": (HIDDEN, [4096, 1024, 1024], False), "o": (HIDDEN, [HIDDEN], False),
          "gate_up": (HIDDEN, [INTER, INTER], False), "down": (INTER, [HIDDEN], True)}
L2_OVERFLOW_BYTES = 256 << 20
DTYPE = torch.bfloat16
CUDA = torch.device("cuda")


def case_requests(name: str) -> list[tuple[int, int]]:
    """(rows, slot) per request of a case, slots round-robin over the adapters."""
    if name == "decode256":
        sizes = [1] * 256
    elif name == "decode1":
        sizes = [1]
    elif name == "prefill":
        sizes = [512] * 16
    else:
        sizes = [1] * 128 + [538] * 9 + [537] * 6
    return [(size, i % SLOTS) for i, size in enumerate(sizes)]


def layouts(name: str, requests: list[tuple[int, int]]) -> list[tuple[str, LoRASegments | None, list]]:
    """(label, layout, configs) of each form the case is timed in: None configs for the forms
    without knobs."""
    slots = np.array([s for n, s in requests for _ in range(n)], dtype=np.int32)
    if name.startswith("decode"):
        forms = [("gathered", None, [None])]
        if slots.shape[0] > 16:
            forms += [(f"tiles={rows}", _tiles(slots, rows), CANDIDATES["decode"]) for rows in (16, 32)]
        return forms
    starts = np.cumsum([0] + [n for n, _ in requests])[:-1]
    seg = torch.tensor(np.stack([starts, [n for n, _ in requests], [s for _, s in requests]]), dtype=torch.int32,
                       device=CUDA)
    forms = [("segment", LoRASegments(seg[0], seg[1], seg[2], max(n for n, _ in requests)), [None])]
    forms += [(f"tiles={rows}", _tiles(slots, rows), CANDIDATES["prefill"] if rows == 64 else [PREFILL])
              for rows in (32, 64, 128)]
    return forms


def _tiles(slots: np.ndarray, rows: int) -> LoRASegments:
    """The sorted tiles LoRABatch writes, padded as a graph's are (ceil(T / rows) + slots)."""
    order, tiles = sorted_tiles(slots, rows)
    padded = np.zeros((3, -(-slots.shape[0] // rows) + SLOTS), dtype=np.int32)
    padded[:, :tiles.shape[1]] = tiles
    dev = torch.from_numpy(padded).to(CUDA)
    return LoRASegments(dev[0], dev[1], dev[2], rows, torch.from_numpy(order).to(CUDA))


def _weights(k: int, widths: list[int], copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device=CUDA).manual_seed(0)
    a = [(torch.randn(SLOTS, len(widths) * RANK, k, device=CUDA, generator=gen) * k ** -0.5).to(DTYPE)
         for _ in range(copies)]
    b = [(torch.randn(SLOTS, sum(widths), RANK, device=CUDA, generator=gen) * RANK ** -0.5).to(DTYPE)
         for _ in range(copies)]
    return list(zip(a, b))


def _reference(x, a, b, scales, widths, gated, requests) -> torch.Tensor:
    """The fp32 torch path's delta (what the kernels add to the base output)."""
    k = a.shape[2]
    act = torch.nn.functional.silu(x[:, :k].float()) * x[:, k:].float() if gated else x.float()
    slots = torch.tensor([s for n, s in requests for _ in range(n)], device=CUDA)
    groups = [SlotGroup(s, torch.nonzero(slots == s).flatten()) for s in range(SLOTS) if (slots == s).any()]
    out = torch.zeros(x.shape[0], sum(widths), device=CUDA)
    offsets = np.cumsum([0] + widths)[:-1].tolist()
    grouped_lora(act, out, a.float().view(SLOTS, len(widths), RANK, k), b.float(), list(zip(offsets, widths)),
                 groups, [RANK] * SLOTS, scales.tolist(), None)
    return out


def time_shape(shape: str, requests, forms) -> dict[tuple[str, object], tuple[float, float]]:
    """(label, config) -> (us a layer, relative error) for one projection."""
    k, widths, gated = SHAPES[shape]
    tokens = sum(n for n, _ in requests)
    slots = torch.tensor([s for n, s in requests for _ in range(n)], dtype=torch.int32, device=CUDA)
    x = torch.randn(tokens, 2 * k if gated else k, device=CUDA).to(DTYPE)
    scales = torch.linspace(0.5, 2.0, SLOTS, device=CUDA)
    # A call's bytes: the adapters, the input, the output read and written (a prefill call's pass L2 alone).
    moved = 2 * (SLOTS * RANK * (len(widths) * k + sum(widths)) + x.shape[0] * (x.shape[1] + 2 * sum(widths)))
    copies = max(2, math.ceil(L2_OVERFLOW_BYTES / moved))
    weights = _weights(k, widths, copies)
    out = torch.zeros(tokens, sum(widths), device=CUDA, dtype=DTYPE)
    expected = _reference(x, *weights[0], scales, widths, gated, requests)

    def layer(a, b, layout, config):
        xa = lora_shrink(x, a, slots, layout, gated=gated, config=config)
        lora_expand(xa, b, scales, slots, layout, out, widths, config=config)

    found = {}
    for label, layout, configs in forms:
        for config in configs:
            out.zero_()
            layer(*weights[0], layout, config)
            error = ((out.float() - expected).norm() / expected.norm()).item()
            us = graph_us([lambda a=a, b=b: layer(a, b, layout, config) for a, b in weights])
            found[label, config] = (us, error)
    return found


def base_us(tokens: int) -> dict[str, float]:
    """F.linear of each projection's base weight at `tokens` rows (the step's base GEMMs)."""
    found = {}
    for shape, (k, widths, _) in SHAPES.items():
        n = sum(widths)
        copies = max(2, math.ceil(L2_OVERFLOW_BYTES / (2 * n * k)))
        weights = [torch.randn(n, k, device=CUDA).to(DTYPE) for _ in range(copies)]
        x = torch.randn(tokens, k, device=CUDA).to(DTYPE)
        found[shape] = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in weights])
        del weights
    return found


def _default(name: str, label: str, config) -> bool:
    """Whether the engine runs this form and config in this case by default: the gathered form at
    batch 1, tiles of 16 rows in decode steps of over 16 tokens, 64 in prefill and mixed steps."""
    if name == "decode1":
        return label == "gathered"
    return (label, config) == (("tiles=16", DECODE) if name.startswith("decode") else ("tiles=64", PREFILL))


def report(name: str, requests) -> None:
    tokens = sum(n for n, _ in requests)
    base = base_us(tokens)
    print(f"\n## {name}: {tokens} rows, {len(requests)} requests; base F.linear us: " +
          ", ".join(f"{s} {us:.1f}" for s, us in base.items()) + f" (sum {sum(base.values()):.1f})", flush=True)
    forms = layouts(name, requests)
    per_shape = {}
    for shape in SHAPES:
        per_shape[shape] = time_shape(shape, requests, forms)
        torch.cuda.empty_cache()
    print(f"{'form':10} {'config (shrink programs, splits, expand programs, block_n)':44} " +
          " ".join(f"{s:>8}" for s in SHAPES) + f" {'sum us':>8} {'ms/step':>8} {'rel err':>8}")
    for label, _, configs in forms:
        for config in configs:
            cells = [per_shape[s][label, config] for s in SHAPES]
            total = sum(us for us, _ in cells)
            mark = "*" if _default(name, label, config) else " "
            text = "-" if config is None else str(tuple(config.__dict__.values()))
            print(f"{mark}{label:9} {text:44} " + " ".join(f"{us:8.1f}" for us, _ in cells) +
                  f" {total:8.1f} {total * LAYERS / 1e3:8.3f} {max(err for _, err in cells):8.1e}", flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no GPU visible: the benchmark times CUDA kernels")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: llama3-8b projections, {SLOTS} adapters of rank {RANK}, bf16; "
          "us a layer (shrink + expand) from CUDA graphs")
    start = time.perf_counter()
    for name in ("decode256", "decode1", "prefill", "mixed"):
        report(name, case_requests(name))
    print(f"# {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
