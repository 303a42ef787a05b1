"""Block-scaled FP8 checkpoints (DeepSeek V3's `weight_block_size` [128, 128]) end to end on a
random 2-layer DeepseekV3 (hidden 256: two blocks along K; a dense first layer, then routed and
shared experts). The test quantizes every linear, the experts included, as DeepSeek ships them
(e4m3 `weight`, fp32 `weight_scale_inv` per block, partial blocks where a size is not a multiple
of 128) and serves it on CPU (the torch path); it must give the greedy tokens and logprobs of the
same engine on the dequantized weights saved dense, and transformers' on those."""
from __future__ import annotations

import json

import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.backends.triton.gemm.fp8_block import fp8_block_w8a16
from corectl.distributed import TensorParallel, parallel_state
from corectl.errors import ConfigError
from corectl.models.moe import FusedMoE, fused_moe_torch, load_moe_weights, select_experts
from corectl.models.parallel import PackedLinear, RowParallelLinear
from corectl.quantization import bind_linear_methods, process_loaded_weights, quantization_scope
from corectl.quantization.fp8 import Fp8Config
from corectl.quantization.fp8_block import BLOCK_KERNEL, TORCH_PATH
from safetensors.torch import load_file, save_file
from support.arch_parity import parity_prompts, save_random_model
from support.close import assert_close
from support.models import hf_greedy_choices
from support.quant_checkpoints import block_quantize, write_block_fp8_checkpoints
from support.quantized_layers import assert_row_parallel_sums, build_quantized_layer, finish_loading

VOCAB = 49152
BLOCK = (128, 128)
PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj")
ENGINE = dict(dtype="float32", kv_cache_memory_gib=0.01, block_size=8, max_model_len=64)
NEW_TOKENS = 8


def deepseek_v3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
                            q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=4,
                            topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=512,
                            initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            tie_word_embeddings=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model_dir):
    """(block-FP8 folder, dequantized dense folder); kv_b_proj stays dense (modules_to_not_convert)."""
    root = tmp_path_factory.mktemp("block_fp8")
    save_random_model(deepseek_v3_config(), root / "dense", default_model_dir, seed=5)
    return write_block_fp8_checkpoints(root / "dense", root, BLOCK, PROJECTIONS, ignore=("kv_b_proj",))


def _greedy(llm: LLM, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs] for o in outs])


def test_block_fp8_deepseek_serves_the_tokens_of_its_dequantized_weights(checkpoints):
    quantized, reference = checkpoints
    prompts, _ = parity_prompts(VOCAB)
    llm = LLM(str(quantized), **ENGINE)
    assert llm.engine.info.quantization == "fp8 (fp8_block_torch)"
    layers = llm.engine.executor.worker.runner.model.model.layers
    attn, experts = layers[1].self_attn, layers[1].mlp.experts
    # Kept as loaded: one byte a weight and a scale per block (48 rows: one partial block).
    assert attn.q_a_proj.weight.dtype == torch.float8_e4m3fn and attn.q_a_proj.weight_scale_inv.shape == (1, 2)
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale.shape == (8, 2, 2)
    # modules_to_not_convert stays dense (the CPU swaps a dense linear for its prepacked GEMM).
    assert getattr(attn.kv_b_proj, "quant_method", None) is None
    tokens, logprobs = _greedy(llm, prompts)
    del llm
    dense_tokens, dense_logprobs = _greedy(LLM(str(reference), **ENGINE), prompts)
    assert tokens == dense_tokens
    assert max(abs(a - b) for got, exp in zip(logprobs, dense_logprobs) for a, b in zip(got, exp)) < 1e-3
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    for prompt, generated, generated_lp in zip(prompts, tokens, logprobs):
        choices, choice_lp = hf_greedy_choices(hf_model, prompt, generated)
        assert choices == generated
        assert max(abs(a - b) for a, b in zip(choice_lp, generated_lp)) < 1e-3


@pytest.mark.slow
def test_block_fp8_deepseek_at_two_ranks_serves_the_tokens_of_one(tmp_path, default_model_dir):
    """Every projection quantized, kv_b_proj included, in 8 x 8 blocks, so each rank's heads (two of
    four: 48 rows of q_b, 56 of kv_b) and each rank's half of o_proj's and the MLPs' inputs are whole
    blocks. Each rank loads its heads' rows of the split projections and their block scales (a
    one-shard packed layer's loaders), the low-rank q and the latent kv whole; two ranks give the
    greedy tokens of one, and logprobs within float32's reach of it."""
    save_random_model(deepseek_v3_config(), tmp_path / "dense", default_model_dir, seed=5)
    quantized, _ = write_block_fp8_checkpoints(tmp_path / "dense", tmp_path, (8, 8), PROJECTIONS)
    prompts, _ = parity_prompts(VOCAB)
    one = LLM(str(quantized), **ENGINE)
    attn = one.engine.executor.worker.runner.model.model.layers[1].self_attn
    assert attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn and attn.kv_b_proj.weight_scale_inv.shape == (14, 4)
    tokens, logprobs = _greedy(one, prompts)
    del one
    two = LLM(str(quantized), tensor_parallel_size=2, **ENGINE)
    try:
        split_tokens, split_logprobs = _greedy(two, prompts)
    finally:
        two.engine.executor.shutdown()
    assert split_tokens == tokens
    assert max(abs(a - b) for got, exp in zip(split_logprobs, logprobs) for a, b in zip(got, exp)) < 1e-3


@pytest.mark.parametrize("block", [[128], [128, 0], "128", [128.0, 128], [True, 128], [128, 128, 1]])
def test_malformed_block_size_is_a_config_error(block):
    with pytest.raises(ConfigError, match="weight_block_size must be two positive integers"):
        Fp8Config.from_checkpoint({"quant_method": "fp8", "weight_block_size": block}, None)


def test_scale_of_the_wrong_shape_is_a_config_error(checkpoints, tmp_path):
    quantized, _ = checkpoints
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in quantized.iterdir():
        if item.suffix != ".safetensors":
            (broken / item.name).write_bytes(item.read_bytes())
    tensors = load_file(quantized / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(broken / "model.safetensors"))
    assert json.loads((broken / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    with pytest.raises(ConfigError, match=r"weight_scale_inv has shape \(2, 1\).*needs \(2, 2\)"):
        LLM(str(broken), **ENGINE)


# Layers rank by rank (nothing collective runs), on the torch path and on the Triton GEMM under the
# interpreter (the worker's kernel reached through the quantization scope).
LAYER_BLOCK = (16, 32)
KERNELS = {TORCH_PATH: {}, BLOCK_KERNEL: {BLOCK_KERNEL: fp8_block_w8a16}}


def _layer(kernel: str, make, prefix: str, rank: int, world_size: int):
    config = Fp8Config(serialized=True, weight_block=LAYER_BLOCK, kernel=kernel)
    return build_quantized_layer(config, KERNELS[kernel], make, prefix, torch.float32, rank, world_size)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_packed_qkv_ranks_keep_their_shards_blocks(kernel):
    """q, k, v of 64, 32 and 32 rows (heads of 16) at TP 2: each rank's rows are whole 16-row blocks."""
    shards, prefix = {"q": 64, "k": 32, "v": 32}, "model.layers.0.self_attn.qkv_proj"
    full = {name: block_quantize(torch.randn(rows, 128) * 0.1, LAYER_BLOCK) for name, rows in shards.items()}
    x = torch.randn(3, 128)
    for rank in range(2):
        layer = _layer(kernel, lambda: PackedLinear(128, shards, bias=False, unit=16), prefix, rank, 2)
        for shard, (q, scale, _) in full.items():
            layer.weight.weight_loader(layer.weight, q, shard)
            layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, shard)
        finish_loading(layer, prefix)
        expected = torch.cat([x @ full[s][2][first:first + size].t() for s, (_, size, first) in layer.shards.items()],
                             1)
        assert_close(layer.quant_method.apply(layer, x), expected, 1e-4, norm="max")


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_row_parallel_partial_sums_rebuild_the_output(kernel):
    """72 output rows (a partial last block), 128 inputs split over 2 ranks on block boundaries."""
    q, scale, dense = block_quantize(torch.randn(72, 128) * 0.1, LAYER_BLOCK)
    prefix = "model.layers.0.mlp.down_proj"

    def loaded(rank: int):
        layer = _layer(kernel, lambda: RowParallelLinear(128, 72, bias=False), prefix, rank, 2)
        layer.weight.weight_loader(layer.weight, q)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale)
        finish_loading(layer, prefix)
        return layer

    assert_row_parallel_sums(loaded, torch.randn(3, 128), dense, 2, 1e-4, norm="max")


def test_slices_off_the_scale_blocks_are_refused():
    """At TP 4 each rank holds 8 rows of k: half a 16-row block."""
    with pytest.raises(ConfigError, match="do not fall on the checkpoint's scale blocks of 16"):
        _layer(TORCH_PATH, lambda: PackedLinear(128, {"q": 64, "k": 32, "v": 32}, bias=False, unit=8),
               "model.layers.0.self_attn.qkv_proj", 1, 4)


@pytest.mark.parametrize("block,provided,bound", [((128, 128), ("w4a16", BLOCK_KERNEL), BLOCK_KERNEL),
                                                  ((128, 128), ("cpu_int4pack",), TORCH_PATH),
                                                  ((128, 8), (BLOCK_KERNEL,), TORCH_PATH)])
def test_binds_the_platform_gemm_where_it_takes_the_block(block, provided, bound):
    """No FP8 hardware needed: without the GEMM (or for blocks of fewer than 16 columns) torch serves."""
    config = Fp8Config.from_checkpoint({"quant_method": "fp8", "weight_block_size": list(block)}, None)
    assert config.bind(provided, "cuda").kernel == bound


def test_block_fp8_experts_keep_a_capturable_model_out_of_cuda_graphs():
    """Qwen3-MoE runs in CUDA graphs, but its block-FP8 experts take the torch MoE path (built on
    the meta device, as `corectl plan` builds it)."""
    from corectl.models.registry import resolve_model_class
    from corectl.worker.worker import build_model
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        num_experts=4, num_experts_per_tok=2, architectures=["Qwen3MoeForCausalLM"])
    model_cls = resolve_model_class(hf)
    assert model_cls.supports_graph_capture
    config = Fp8Config.from_checkpoint({"quant_method": "fp8", "weight_block_size": [32, 32]}, None).bind((), "cuda")
    model = build_model(model_cls, hf, torch.bfloat16, "meta", 64, config)
    assert not model.supports_graph_capture and "torch MoE path" in model.graph_capture_blocker


def _block_experts(config, rank: int, world_size: int) -> torch.nn.Module:
    """Rank `rank`'s `mlp.experts` (4 experts, hidden 16, intermediate 16) under `config`."""
    with pytest.MonkeyPatch.context() as mp, quantization_scope(config):
        mp.setattr(parallel_state, "_state", TensorParallel(rank, world_size))
        model = torch.nn.Module()
        model.mlp = torch.nn.Module()
        model.mlp.experts = FusedMoE(4, 16, 16, top_k=2, renormalize=False)
        bind_linear_methods(model, config, torch.float32, torch.device("cpu"))
    return model


def test_block_experts_ranks_sum_to_the_dequantized_layer():
    """8 x 8 blocks at TP 2: each rank keeps whole blocks of every expert's rows; the fused_moe_torch
    partial outputs add up to the dequantized layer's; static input scales are read past."""
    config = Fp8Config.from_checkpoint({"quant_method": "fp8", "weight_block_size": [8, 8]}, None).bind((), "cpu")
    shapes = {"gate_proj": (16, 16), "up_proj": (16, 16), "down_proj": (16, 16)}
    checkpoint, dense = {}, {}
    for e in range(4):
        for proj, shape in shapes.items():
            stem = f"mlp.experts.{e}.{proj}"
            q, scale, dense[stem] = block_quantize(torch.randn(shape), (8, 8))
            checkpoint.update({f"{stem}.weight": q, f"{stem}.weight_scale_inv": scale,
                               f"{stem}.input_scale": torch.tensor(0.1)})
    hidden, logits = torch.randn(5, 16), torch.randn(5, 4)
    total = torch.zeros(5, 16)
    for rank in range(2):
        model = _block_experts(config, rank, 2)
        load_moe_weights(model, checkpoint.items(), lambda name: False)
        process_loaded_weights(model)
        experts = model.mlp.experts
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.down_proj_scale.shape == (4, 2, 1)
        total += experts.quant_method.apply(experts, hidden, logits)
    gate_up = torch.stack([torch.cat([dense[f"mlp.experts.{e}.{p}"] for p in ("gate_proj", "up_proj")])
                           for e in range(4)])
    down = torch.stack([dense[f"mlp.experts.{e}.down_proj"] for e in range(4)])
    expected = fused_moe_torch(hidden, gate_up, down, *select_experts(logits, 2, renormalize=False))
    assert_close(total, expected, 1e-5, norm="max")
