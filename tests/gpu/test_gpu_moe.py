"""The fused MoE kernel on the GPU: at Qwen3-30B-A3B's layer sizes against the torch path, inside a
CUDA graph without host syncs, and in random-weight Qwen3-MoE and Mixtral models against the models'
torch code; its FP8-weight variant likewise (kernel sizes, and `--quantization fp8` models)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl import SamplingParams  # noqa: E402
from corectl.backends.triton.moe.fused_moe import fused_moe  # noqa: E402
from corectl.backends.triton.layer_kernels import triton_layer_kernels  # noqa: E402
from corectl.models.moe import fused_moe_torch, select_experts  # noqa: E402
from corectl.quantization.fp8 import quantize_rows  # noqa: E402
from support.close import relative_error  # noqa: E402
from support.gpu import (  # noqa: E402
    MOE_ARCHITECTURES,
    assert_async_gives_synchronous_tokens,
    assert_launches_never_wait,
    build_checkpoint,
    compare_greedy,
    generate,
    random_prompts,
)

# Qwen3-30B-A3B: hidden 2048, 128 experts of width 768, top 8.
HIDDEN, EXPERTS, INTER, TOP_K = 2048, 128, 768, 8
# Relative L2 error of bf16 against an fp32 computation: a few bf16 roundings (2**-8 each).
REL_TOL = 1e-2
# Triton converts e4m3 (fp8e4nv) on compute capability 8.9 and newer.
FP8 = torch.cuda.get_device_capability(0) >= (8, 9)


def layer_inputs(num_tokens: int, dtype: torch.dtype):
    device = torch.device("cuda")
    hidden = torch.randn(num_tokens, HIDDEN, device=device).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device) / HIDDEN ** 0.5).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device=device) / INTER ** 0.5).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, EXPERTS, device=device), TOP_K, renormalize=True)
    return hidden, gate_up, down, weights, ids


# The pair path reads an expert's weights once per pair: decode batches only.
@pytest.mark.parametrize(("num_tokens", "path"), [(1, "pairs"), (4, "pairs"), (16, "pairs"), (1, "sorted"),
                                                  (16, "sorted"), (300, "sorted"), (4096, "sorted")])
def test_kernel_matches_the_torch_path_at_qwen3_30b_a3b_sizes(num_tokens, path):
    torch.manual_seed(num_tokens)
    hidden, gate_up, down, weights, ids = layer_inputs(num_tokens, torch.bfloat16)
    # The reference in fp32 on the same bf16 values: the kernel's error is its own roundings.
    ref = fused_moe_torch(hidden.float(), gate_up.float(), down.float(), weights, ids)
    error = relative_error(fused_moe(hidden, gate_up, down, weights, ids, path=path), ref)
    print(f"{num_tokens} tokens, {path} path: bf16 relative error {error:.2e}")
    assert error < REL_TOL
    fp32 = fused_moe(hidden.float(), gate_up.float(), down.float(), weights, ids, path=path)
    assert relative_error(fp32, ref) < 1e-5  # IEEE fp32 dots, never TF32


# 8 tokens take the pair path (64 pairs for 128 experts), 16 the sorted one.
@pytest.mark.parametrize("num_tokens", [8, 16])
def test_routed_kernel_replays_in_a_cuda_graph_without_host_syncs(num_tokens):
    """The layer kernel the CUDA worker installs (routing, then the experts), captured once at a
    decode bucket's shape, serves new router logits through the same tensors."""
    routed_moe = triton_layer_kernels().fused_moe
    torch.manual_seed(0)
    hidden, gate_up, down, _, _ = layer_inputs(num_tokens, torch.bfloat16)
    # fp32 logits: bf16 ones tie often among 128 experts, and torch breaks ties its own way.
    logits = torch.randn(num_tokens, EXPERTS, device="cuda")
    routed_moe(hidden, gate_up, down, logits, TOP_K, True)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routed_moe(hidden, gate_up, down, logits, TOP_K, True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = routed_moe(hidden, gate_up, down, logits, TOP_K, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in (1, 2):
        torch.manual_seed(seed)
        hidden.copy_(torch.randn_like(hidden))
        logits.copy_(torch.randn_like(logits))
        logits[1] = logits[0]  # two tokens routed alike: experts with several pairs
        graph.replay()
        weights, ids = select_experts(logits, TOP_K, renormalize=True)
        ref = fused_moe_torch(hidden.float(), gate_up.float(), down.float(), weights, ids)
        assert relative_error(out, ref) < REL_TOL
        torch.testing.assert_close(out, routed_moe(hidden, gate_up, down, logits, TOP_K, True), rtol=0, atol=0)


@pytest.fixture(scope="module", params=sorted(MOE_ARCHITECTURES))
def moe_checkpoint(request, tmp_path_factory):
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe_engine"))


# The graphs module's engine checks, on the MoE model: a launch never waits for the device; async
# scheduling gives the synchronous tokens.
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_launching_a_step_never_waits_for_the_device(enforce_eager, checkpoint):
    assert_launches_never_wait(checkpoint, enforce_eager)


def test_async_scheduling_gives_the_tokens_of_the_synchronous_loop(checkpoint):
    assert_async_gives_synchronous_tokens(checkpoint)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_moe_model_decodes_the_tokens_of_the_torch_path(enforce_eager, moe_checkpoint, monkeypatch):
    prompts = random_prompts([3, 250, 17, 64, 9, 130, 33, 1], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
    # The torch layers read per-expert counts back to the host, so they run eagerly.
    with monkeypatch.context() as torch_layers:
        torch_layers.setenv("CORECTL_FUSED_KERNELS", "0")
        reference = generate(moe_checkpoint, prompts, params, dtype="float32", enforce_eager=True)
    fused = generate(moe_checkpoint, prompts, params, dtype="float32", enforce_eager=enforce_eager)
    for expected, (matched, error) in zip(reference, compare_runs(reference, fused, 0.0)):
        assert matched == len(expected.outputs[0].token_ids) and error < 1e-3


def compare_runs(reference, runs, near_tie: float) -> list[tuple[int, float]]:
    """`compare_greedy` of each output against its reference: (tokens matched, logprob error)."""
    results = []
    for expected, got in zip(reference, runs):
        expected, got = expected.outputs[0], got.outputs[0]
        chosen = [next(iter(position.values())).logprob for position in got.logprobs]

        def expected_logprob(pos, token, expected=expected):
            entry = expected.logprobs[pos].get(token)
            return None if entry is None else entry.logprob

        results.append(compare_greedy(expected.token_ids, got.token_ids, expected_logprob, chosen, near_tie))
    return results


def fp8_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked [E, N, K] weights as the FP8 method serves them: e4m3, fp32 row scales [E, N]."""
    quantized, scale = quantize_rows(weight.reshape(-1, weight.shape[-1]))
    return quantized.view(weight.shape), scale.view(weight.shape[:2])


@pytest.mark.skipif(not FP8, reason="e4m3 conversions need compute capability 8.9 or newer")
@pytest.mark.parametrize(("num_tokens", "path"), [(1, "pairs"), (16, "pairs"), (1, "sorted"), (300, "sorted"),
                                                  (4096, "sorted")])
def test_fp8_kernel_matches_the_torch_path_at_qwen3_30b_a3b_sizes(num_tokens, path):
    """e4m3 experts widened in the kernel, bf16 activations: against the torch path's W8A16 in fp32
    on the same e4m3 values and scales, the kernel's error is its own bf16 roundings."""
    torch.manual_seed(num_tokens)
    hidden, gate_up, down, weights, ids = layer_inputs(num_tokens, torch.bfloat16)
    (gate_up_q, gate_up_scale), (down_q, down_scale) = fp8_experts(gate_up), fp8_experts(down)
    scales = {"gate_up_scale": gate_up_scale, "down_scale": down_scale}
    ref = fused_moe_torch(hidden.float(), gate_up_q, down_q, weights, ids, **scales)
    error = relative_error(fused_moe(hidden, gate_up_q, down_q, weights, ids, path=path, **scales), ref)
    print(f"{num_tokens} tokens, {path} path, FP8 experts: bf16 relative error {error:.2e}")
    assert error < REL_TOL
    fp32 = fused_moe(hidden.float(), gate_up_q, down_q, weights, ids, path=path, **scales)
    assert relative_error(fp32, ref) < 1e-5


@pytest.mark.skipif(not FP8, reason="FP8 needs compute capability 8.9 or newer")
def test_fp8_moe_model_decodes_the_tokens_of_the_torch_path(checkpoint, monkeypatch):
    """`--quantization fp8` on a Qwen3-MoE: the fused kernel's FP8 variant, captured in CUDA graphs,
    against the experts' torch path (eager) on the same e4m3 weights. Steps of at most 8 tokens keep
    every linear layer on the W8A16 GEMV: W8A8's activation quantizer would turn the paths' fp32
    rounding differences into whole e4m3 steps, and the comparison would measure those."""
    prompts = random_prompts([3, 250, 17, 64, 9, 130, 33, 1], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
    options = dict(dtype="float32", quantization="fp8", max_num_seqs=8, max_num_batched_tokens=8)
    with monkeypatch.context() as torch_layers:
        torch_layers.setenv("CORECTL_FUSED_KERNELS", "0")
        reference = generate(checkpoint, prompts, params, enforce_eager=True, **options)
    fused = generate(checkpoint, prompts, params, **options)
    for matched, error in compare_runs(reference, fused, 1e-3):
        assert error < 1e-3, (matched, error)
