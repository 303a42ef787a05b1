"""The MXFP4 MoE kernel on the GPU: at gpt-oss-20b's expert sizes (bf16 activations) against
dequantize-then-torch in fp32, inside a CUDA graph without host syncs, and a random-weight gpt-oss
checkpoint with MXFP4 experts served packed: decode in CUDA graphs gives the eager tokens."""
import functools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from corectl import LLM, SamplingParams  # noqa: E402
from corectl.backends.triton.moe.mxfp4_moe import Mxfp4Stack, PairConfig, mxfp4_moe, routed_mxfp4_moe  # noqa: E402
from corectl.models.gpt_oss import clamped_swiglu  # noqa: E402
from corectl.models.moe import fused_moe_torch, select_experts  # noqa: E402
from corectl.quantization.mxfp4 import mxfp4_dequantize  # noqa: E402
from support.close import relative_error  # noqa: E402
from support.gpt_oss_checkpoints import mxfp4_checkpoint  # noqa: E402
from support.gpu import write_tokenizer  # noqa: E402
from support.new_arch_configs import VOCAB  # noqa: E402

# gpt-oss-20b: hidden 2880, 32 experts of width 2880, top 4, SwiGLU clamped at 7.
HIDDEN, EXPERTS, INTER, TOP_K = 2880, 32, 2880, 4
ALPHA, LIMIT = 1.702, 7.0
# Relative L2 error of bf16 activations and outputs against fp32 on the same weights: a few roundings.
REL_TOL = 1e-2


def packed_stack(rows: int, k: int) -> Mxfp4Stack:
    """Random codes and scales around a trained model's magnitudes (2^-9 to 2^-4 per group)."""
    blocks = torch.randint(0, 256, (EXPERTS, rows, k // 32, 16), dtype=torch.uint8, device="cuda")
    scales = torch.randint(118, 124, (EXPERTS, rows, k // 32), dtype=torch.uint8, device="cuda")
    return Mxfp4Stack(blocks, scales, (torch.randn(EXPERTS, rows, device="cuda") / 8).to(torch.bfloat16))


@functools.lru_cache(maxsize=1)
def layer():
    torch.manual_seed(0)
    gate_up, down = packed_stack(2 * INTER, HIDDEN), packed_stack(HIDDEN, INTER)
    dense = tuple(mxfp4_dequantize(stack.blocks, stack.scales, torch.float32) for stack in (gate_up, down))
    return gate_up, down, dense


def reference(hidden, weights, ids) -> torch.Tensor:
    """fp32 computation on the kernel's bf16 inputs: its error is its own roundings."""
    gate_up, down, dense = layer()
    return fused_moe_torch(hidden.float(), *dense, weights, ids, gate_up_bias=gate_up.bias.float(),
                           down_bias=down.bias.float(), activation=functools.partial(clamped_swiglu, alpha=ALPHA,
                                                                                     limit=LIMIT))


@pytest.mark.parametrize(("num_tokens", "path"), [(1, "pairs"), (2, "pairs"), (4, "pairs"), (1, "sorted"),
                                                  (64, "sorted"), (1000, "sorted")])
def test_kernel_matches_dequantize_then_torch_at_gpt_oss_20b_sizes(num_tokens, path):
    gate_up, down, _ = layer()
    torch.manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(num_tokens, EXPERTS, device="cuda"), TOP_K, renormalize=True)
    out = mxfp4_moe(hidden, gate_up, down, weights, ids, ALPHA, LIMIT, path=path)
    ref = reference(hidden, weights, ids)
    error = relative_error(out, ref)
    print(f"{num_tokens} tokens, {path} path: bf16 relative error {error:.2e}")
    assert out.dtype == torch.bfloat16 and error < REL_TOL


@pytest.mark.parametrize("launch", [(4, 32, 4, 8), (8, 32, 4, 3), (16, 8, 4, 5), (32, 4, 4, 3), (4, 8, 1, 5),
                                    (8, 4, 1, 8), (4, 32, 1, 4), (8, 32, 2, 3)])
def test_every_kind_of_pairs_launch_of_the_sweep(launch):
    """The pairs kernels on each kind of launch the benchmark's sweep tries (column blocks of 4-32
    rows, one to four 16-byte vectors a thread, 4 warps, 2 or 1, 3-8 stages), both on the same
    launch, against the reference at 1 token."""
    gate_up, down, _ = layer()
    torch.manual_seed(5)
    hidden = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(1, EXPERTS, device="cuda"), TOP_K, renormalize=True)
    cfg = PairConfig(*launch)
    out = mxfp4_moe(hidden, gate_up, down, weights, ids, ALPHA, LIMIT, path="pairs", pair_configs=(cfg, cfg))
    assert relative_error(out, reference(hidden, weights, ids)) < REL_TOL


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_routed_kernel_replays_in_a_cuda_graph_without_host_syncs(num_tokens):
    """The kernel the CUDA worker provides (routing, then the experts), captured once, serves new
    hidden rows and router logits through the same tensors (1 token: pairs path; 8: sorted)."""
    gate_up, down, _ = layer()
    torch.manual_seed(1)
    hidden = torch.randn(num_tokens, HIDDEN, device="cuda").to(torch.bfloat16)
    logits = torch.randn(num_tokens, EXPERTS, device="cuda")

    def run():
        return routed_mxfp4_moe(hidden, logits, tuple(gate_up), tuple(down), TOP_K, True, ALPHA, LIMIT)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in (2, 3):
        torch.manual_seed(seed)
        hidden.copy_(torch.randn_like(hidden, dtype=torch.float32).to(torch.bfloat16))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        weights, ids = select_experts(logits, TOP_K, renormalize=True)
        assert relative_error(out, reference(hidden, weights, ids)) < REL_TOL
        torch.testing.assert_close(out, run(), rtol=0, atol=0)


def test_packed_gpt_oss_decodes_in_cuda_graphs(tmp_path):
    """A tiny gpt-oss checkpoint with MXFP4 experts: served packed (the platform's mxfp4_moe), its
    decode steps captured, and greedy tokens equal to the eager engine's. The tokenizer is the GPU
    suite's word-level one (the device has no embedded SmolLM2 package)."""
    tokenizer_dir, folder = tmp_path / "tokenizer", tmp_path / "oss4"
    tokenizer_dir.mkdir()
    write_tokenizer(tokenizer_dir, VOCAB)
    mxfp4_checkpoint(folder, tokenizer_dir)
    prompts = [[5, 9, 33, 7, 81], [11, 4, 60, 2, 19, 27, 8, 14]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        llm = LLM(str(folder), dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.2, enforce_eager=eager)
        assert llm.engine.info.quantization == "mxfp4 (mxfp4_moe)"
        model = llm.engine.executor.worker.runner.model
        assert model.model.layers[0].mlp.experts.gate_up_proj_blocks.dtype == torch.uint8
        assert model.supports_graph_capture
        tokens[eager] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]
