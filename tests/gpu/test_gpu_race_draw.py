"""The sampler's one-pass exponential race compiled for the GPU: its draws follow softmax(logits)
at a real vocabulary's width and in many splits, and a CUDA graph replays it with fresh noise."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl.backends.triton.race_draw import race_draw  # noqa: E402

# Chi-square critical value at p = 0.001 for 5 degrees of freedom (six categories).
CHI2_DF5_P001 = 20.515
VOCAB = 151_936


def _peaked_logits(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows over Qwen3's vocabulary with five likely ids spread over its splits and the rest of the
    mass (~8%) on the other 151,931: (logits, the five ids, the six categories' probabilities)."""
    torch.manual_seed(0)
    logits = torch.randn(VOCAB, device="cuda") - 14.0
    ids = torch.tensor([3, 40_000, 77_777, 120_001, VOCAB - 1], device="cuda")
    logits[ids] = torch.tensor([1.0, 0.5, 0.0, -0.5, 1.5], device="cuda")
    probs = logits.softmax(0)
    categories = torch.cat([probs[ids], (1 - probs[ids].sum()).reshape(1)]).double()
    return logits.expand(rows, -1).contiguous(), ids, categories


def _chi2(tokens: torch.Tensor, ids: torch.Tensor, categories: torch.Tensor) -> float:
    counts = torch.stack([(tokens == i).sum() for i in ids] + [(~torch.isin(tokens, ids)).sum()]).double()
    expected = categories * tokens.numel()
    return ((counts - expected) ** 2 / expected).sum().item()


def test_draws_follow_the_softmax_over_a_real_vocabulary():
    logits, ids, categories = _peaked_logits(256)
    tokens = torch.cat([race_draw(logits) for _ in range(200)])
    assert _chi2(tokens, ids, categories) < CHI2_DF5_P001
    assert int(tokens.min()) >= 0 and int(tokens.max()) < VOCAB


def test_graph_replays_draw_fresh_noise():
    logits, ids, categories = _peaked_logits(64)
    race_draw(logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = race_draw(logits)
    draws = []
    for _ in range(400):
        graph.replay()
        draws.append(out.clone())
    tokens = torch.cat(draws)
    assert len({tuple(d.tolist()) for d in draws[:10]}) == 10
    assert _chi2(tokens, ids, categories) < CHI2_DF5_P001
