"""cuBLAS GEMMs on zero-padded rows (corectl.backends.triton.gemm.padded_rows) on the GPU: timed only
inside `tuning()` and never inside a graph capture, the real rows' results as F.linear's, and a decided
row count recorded and replayed by a CUDA graph."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl.backends.triton.gemm import padded_rows  # noqa: E402
from torch.nn import functional as F  # noqa: E402

# Llama 3 8B's qkv projection at a verify step's 64 x 5 rows (an H100 pads it: W11).
N, K = 6144, 4096


def _operands(m: int, bias: bool):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K**0.5
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g) if bias else None
    return x, w, b


def _decide(x, w, b) -> int:
    with padded_rows.tuning():
        padded_rows.linear(x, w, b)
    return padded_rows._decisions[(x.shape[0], N, K, x.dtype, b is not None, x.device.index)]


@pytest.mark.parametrize(("m", "bias"), [(320, False), (200, True), (48, False)])
def test_padded_rows_give_the_real_rows_product(m, bias):
    x, w, b = _operands(m, bias)
    rows = _decide(x, w, b)
    assert rows in padded_rows.candidates(m)
    out = padded_rows.linear(x, w, b)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = F.linear(x, w, b) if out is None else out
    assert out is None or (rows > m and out.shape == (m, N))
    # bf16 output of a K = 4096 dot: a few of its last bits.
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_a_capture_never_times_and_replays_the_decision():
    x, w, _ = _operands(320, False)
    rows = _decide(x, w, None)
    undecided, _, _ = _operands(328, False)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with padded_rows.tuning(), torch.cuda.graph(graph):
        out = padded_rows.linear(x, w, None)
        assert padded_rows.linear(undecided, w, None) is None
    assert (328, N, K, torch.bfloat16, False, x.device.index) not in padded_rows._decisions
    assert (out is None) == (rows == 320)
    if out is not None:
        eager = padded_rows.linear(x, w, None)
        x.copy_(_operands(320, False)[0] * 2)
        graph.replay()
        torch.testing.assert_close(out, padded_rows.linear(x, w, None))
        assert not torch.equal(out, eager)
