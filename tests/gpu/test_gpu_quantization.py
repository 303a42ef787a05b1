"""Quantized GEMMs at llama3-8b sizes on the GPU against their torch references, and quantized
models served end to end: FP8 W8A8 (`torch._scaled_mm`, Hopper/Ada), the Triton FP8 decode kernel
(W8A16) and the Triton 4-bit GEMM for AWQ/GPTQ and GGUF's 4-bit blocks (run it as
`python -m pytest tests/gpu`, see conftest.py)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl import SamplingParams  # noqa: E402
from corectl.quantization.fp8 import (fp8_gemm_reference, fp8_gemm_scaled_mm, fp8_linear_reference,  # noqa: E402
                                      fp8_w8a16_reference, quantize_rows)
from corectl.quantization.gguf_int8 import w8a16_reference  # noqa: E402
from corectl.quantization.int4 import pack_int32, tile_words, w4a16_reference  # noqa: E402
from support.close import relative_error  # noqa: E402
from support.gpu import build_checkpoint, generate, random_prompts  # noqa: E402

FP8 = torch.cuda.get_device_capability(0) >= (8, 9)
# (N, K) of llama3-8b's qkv, o, gate_up and down projections
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
REL_TOL = 1e-2


@pytest.mark.skipif(not FP8, reason="FP8 tensor cores need compute capability 8.9 or newer")
@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("n,k", LLAMA3_8B)
@pytest.mark.parametrize("fast_accum", ["1", "0"])
def test_fp8_activation_quantizer_and_scaled_mm_match_references(m, n, k, fast_accum, monkeypatch):
    monkeypatch.setenv("CORECTL_FP8_FAST_ACCUM", fast_accum)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight, scale = quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    from corectl.backends.triton.gemm.fp8_quant import quantize_rows_fp8

    xq, x_scale = quantize_rows_fp8(x)
    expected_q, expected_scale = quantize_rows(x)
    torch.testing.assert_close(x_scale, expected_scale)
    # Bit-exact on the CPU interpreter; here a division may differ by an fp32 ulp: one e4m3 step at most.
    diff = (xq.float() - expected_q.float()).abs()
    assert (diff <= expected_q.float().abs() * 2 ** -3 + 2 ** -9).all()
    error = relative_error(fp8_gemm_scaled_mm(xq, x_scale, weight, scale.view(-1), bias, x.dtype),
                       fp8_gemm_reference(xq, x_scale, weight, scale.view(-1), bias, x.dtype))
    assert error < REL_TOL, error


@pytest.mark.skipif(not FP8, reason="e4m3 conversions need compute capability 8.9 or newer")
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", LLAMA3_8B)
def test_fp8_w8a16_gemv_matches_reference_and_beats_w8a8(m, n, k):
    """The decode kernel (table or heuristic config) against its fp32 reference to bf16 rounding,
    and closer to the dense product than W8A8 (its activations are not rounded to e4m3)."""
    from corectl.backends.triton.gemm.fp8_gemv import fp8_w8a16_gemv

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight, scale = quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    scale, bias = scale.view(-1), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = fp8_w8a16_gemv(x, weight, scale, bias)
    assert relative_error(out, fp8_w8a16_reference(x, weight, scale, bias)) < 2 ** -8
    dense = x.float() @ (weight.float() * scale.view(-1, 1)).t() + bias.float()
    assert relative_error(out, dense) < relative_error(fp8_linear_reference(x, weight, scale, bias), dense)


@pytest.mark.skipif(not FP8, reason="e4m3 conversions need compute capability 8.9 or newer")
@pytest.mark.parametrize("m,config", [(1, (1, 8, 512, 2, 4, 1)), (1, (1, 16, 1024, 1, 8, 3)),
                                      (1, (16, 32, 256, 2, 4, 3)), (8, (16, 64, 256, 4, 8, 3)),
                                      (7, (16, 16, 128, 2, 4, 1))])
def test_fp8_w8a16_gemv_replays_from_a_cuda_graph(m, config):
    """Captured once, replayed on new inputs: the same bits as eager calls (split-K is reduced in
    a fixed order, no atomics)."""
    from corectl.backends.triton.gemm.fp8_gemv import GemvConfig, fp8_w8a16_gemv

    n, k = LLAMA3_8B[3]
    cfg = GemvConfig(*config)
    weight, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    fp8_w8a16_gemv(x, weight, scale.view(-1), None, cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_w8a16_gemv(x, weight, scale.view(-1), None, cfg)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, fp8_w8a16_gemv(x, weight, scale.view(-1), None, cfg))



def _w4_layer(n: int, k: int, act_order: bool, group: int = 128):
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(k // group, n, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.int32, device="cuda")
    g_idx = torch.arange(k, dtype=torch.int32, device="cuda") // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, device="cuda")]
    return pack_int32(codes.t(), 0), scales, zeros, g_idx, 0 if act_order else group


@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("n,k", LLAMA3_8B)
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_gemm_matches_reference(m, n, k, act_order):
    from corectl.backends.triton.gemm.w4a16 import w4a16_gemm

    qweight, scales, zeros, g_idx, group_size = _w4_layer(n, k, act_order)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    error = relative_error(w4a16_gemm(x, qweight, scales, zeros, g_idx, group_size),
                       w4a16_reference(x, qweight, scales, zeros, g_idx))
    assert error < REL_TOL, error


@pytest.mark.parametrize("n,k", LLAMA3_8B)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tiled", [False, True])
def test_w4a16_decode_path_matches_reference_and_replays_in_graphs(n, k, dtype, tiled):
    """Every decode batch size the graphs use (GEMV at 1, split-K dots above) at real sizes, words
    plain or in the column tiles the model serves, then one captured call replayed on new inputs:
    the split-K buffers and sums are graph-safe."""
    from corectl.backends.triton.gemm.w4a16 import w4a16_gemm_trusted

    qweight, scales, zeros, g_idx, group_size = _w4_layer(n, k, False)
    qweight = tile_words(qweight) if tiled else qweight
    scales = scales.to(dtype)
    tol = 1e-5 if dtype == torch.float32 else REL_TOL
    for m in (1, 2, 3, 4, 8, 16):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        error = relative_error(w4a16_gemm_trusted(x, qweight, scales, zeros, g_idx, group_size),
                           w4a16_reference(x, qweight, scales, zeros, g_idx))
        assert error < tol, (m, error)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    w4a16_gemm_trusted(x, qweight, scales, zeros, g_idx, group_size)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_gemm_trusted(x, qweight, scales, zeros, g_idx, group_size)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, w4a16_gemm_trusted(x, qweight, scales, zeros, g_idx, group_size))


@pytest.mark.parametrize("n,k", LLAMA3_8B)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,offsets", [(32, False), (16, False), (16, True)])
def test_w8a16_gemm_matches_reference_and_replays_in_graphs(n, k, dtype, group, offsets):
    """GGUF's int8 groups (Q8_0: 32, symmetric; Q6_K: 16; mixed with Q4_K: 16 with offsets) at
    every decode batch size and a prefill chunk, then a captured decode call replayed."""
    from corectl.backends.triton.gemm.w8a16 import w8a16_gemm

    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda")
    scales = (torch.rand(n, k // group, device="cuda") * 1e-3).to(torch.float16)
    mins = (torch.randn(n, k // group, device="cuda") * 1e-3).to(torch.float16) if offsets else None
    for m in (1, 2, 4, 8, 16, 300):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        error = relative_error(w8a16_gemm(x, codes, scales, mins, group), w8a16_reference(x, codes, scales, mins, group))
        assert error < REL_TOL, (m, error)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    w8a16_gemm(x, codes, scales, mins, group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8a16_gemm(x, codes, scales, mins, group)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, w8a16_gemm(x, codes, scales, mins, group))


@pytest.mark.skipif(not FP8, reason="FP8 tensor cores need compute capability 8.9 or newer")
def test_fp8_on_the_fly_serves_with_cuda_graphs(tmp_path):
    folder = build_checkpoint("llama", tmp_path / "llama")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts([5, 40, 130])
    ours = generate(folder, prompts, params, quantization="fp8")
    assert all(len(o.outputs[0].token_ids) == 16 for o in ours)


# The AWQ model against its dequantized weights (fp16 scales times small integers: exact in fp32).
# Served in fp32 both hold those weights exactly and differ only in summation order (~1e-5 nat).
# Served in bf16 (the usual case) the 4-bit model rounds its scales, then each weight, to bf16;
# the dense one rounds each weight once: about sqrt(2) times the weight error, with the same
# activation and logit rounding. So its logprob error against the fp32 truth is bounded by twice
# what bf16 serving costs the dense model itself, measured in the same run.
FP32_LOGPROB_ERROR = 1e-3
BF16_ERROR_FACTOR = 2.0


def _logprob_errors(got, truth) -> list[float]:
    """|logprob difference| of every token both ranked, at every position up to and including the
    first divergence (the same context on both sides); a divergence must be to a token the truth
    ranked, so the flip is measured rather than assumed."""
    errors = []
    for ours, want in zip(got, truth):
        a, b = ours.outputs[0], want.outputs[0]
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            common = a.logprobs[pos].keys() & b.logprobs[pos].keys()
            assert ta in b.logprobs[pos], f"token {ta} at {pos} is outside the reference's top {len(b.logprobs[pos])}"
            errors += [abs(a.logprobs[pos][t].logprob - b.logprobs[pos][t].logprob) for t in common]
            if ta != tb:
                break
    return errors


def _rms(values: list[float]) -> float:
    return (sum(v * v for v in values) / len(values)) ** 0.5


def test_awq_checkpoint_matches_its_dequantized_model(tmp_path):
    """The AWQ checkpoint (real packing, tests/quant_checkpoints.py) against the fp32 model of its
    dequantized weights, served in fp32 (same weights: near-exact) and in bf16 (within the error
    bf16 serving adds to the dense model; every divergence is a flip that error explains)."""
    from support.quant_checkpoints import write_w4_checkpoints

    dense = build_checkpoint("llama", tmp_path / "llama")
    quantized, reference = write_w4_checkpoints(dense, tmp_path, "awq", group=128)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    prompts = random_prompts([5, 40, 130, 7, 64, 300, 12, 90])
    truth = generate(reference, prompts, params, dtype="float32")
    fp32_errors = _logprob_errors(generate(quantized, prompts, params, dtype="float32"), truth)
    assert max(fp32_errors) < FP32_LOGPROB_ERROR, max(fp32_errors)
    dense_bf16 = _rms(_logprob_errors(generate(reference, prompts, params), truth))
    ours_bf16 = _logprob_errors(generate(quantized, prompts, params), truth)
    print(f"logprob error vs fp32: 4-bit fp32 max {max(fp32_errors):.1e}; rms in bf16: dense "
          f"{dense_bf16:.4f}, 4-bit {_rms(ours_bf16):.4f} (max {max(ours_bf16):.4f})")
    assert _rms(ours_bf16) <= BF16_ERROR_FACTOR * dense_bf16


def _assert_gguf_matches_its_dequantized_model(tmp_path, types: dict[str, str], described: str) -> None:
    """A GGUF file of `types` (projection kind -> block type) served kept quantized (the engine
    describes it as `described`) against the fp32 model of the file's dequantized weights: in fp32
    the same weights (fp32 scales and offsets: near-exact); in bf16 (fp16 scales and offsets, the
    file's precision) within the AWQ test's bound."""
    from gguf import GGMLQuantizationType as Q
    from support.gguf_files import write_gguf

    dense = build_checkpoint("llama", tmp_path / "dense")
    path = write_gguf(dense, tmp_path / "llama.gguf", {kind: Q[name] for kind, name in types.items()})

    def served_quantized(llm):
        assert llm.engine.info.quantization == described

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    prompts = random_prompts([5, 40, 130, 7, 64, 300, 12, 90])
    truth = generate(path, prompts, params, quantization="none", dtype="float32")
    fp32 = generate(path, prompts, params, served_quantized, quantization="gguf", dtype="float32")
    fp32_errors = _logprob_errors(fp32, truth)
    assert max(fp32_errors) < FP32_LOGPROB_ERROR, max(fp32_errors)
    dense_bf16 = _rms(_logprob_errors(generate(path, prompts, params, quantization="none"), truth))
    ours_bf16 = _logprob_errors(generate(path, prompts, params, served_quantized, quantization="gguf"), truth)
    print(f"{described}: logprob error vs fp32: fp32 max {max(fp32_errors):.1e}; rms in bf16: dense "
          f"{dense_bf16:.4f}, quantized {_rms(ours_bf16):.4f} (max {max(ours_bf16):.4f})")
    assert _rms(ours_bf16) <= BF16_ERROR_FACTOR * dense_bf16


def test_gguf_4bit_blocks_match_their_dequantized_model(tmp_path):
    """Q4_0/Q4_1/Q4_K layers kept 4-bit (w4a16, float offsets)."""
    types = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_K", "ffn_gate": "Q4_1",
             "ffn_up": "Q4_1", "ffn_down": "Q4_K"}
    _assert_gguf_matches_its_dequantized_model(tmp_path, types, "gguf (Q4_0/Q4_1/Q4_K int4 layers via w4a16)")


def test_gguf_int8_blocks_match_their_dequantized_model(tmp_path):
    """A Q4_K_M-style mix with Q8_0: Q8_0 and Q6_K layers, and the qkv layer mixing Q4_K with Q6_K,
    kept as int8 groups (w8a16) beside Q4_K's int4 gate_up."""
    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0", "ffn_gate": "Q4_K",
             "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
    _assert_gguf_matches_its_dequantized_model(
        tmp_path, types, "gguf (Q4_K int4 layers via w4a16; Q4_K/Q6_K/Q8_0 int8 layers via w8a16)")
