"""`corectl plan`: sizes from the config alone agree with what the engine measures when it starts,
tensor parallelism splits weights and KV heads, a plan that does not fit names flags that do fit,
and an unknown model is a one-line error."""
from __future__ import annotations

import json

import pytest
import torch
from corectl import LLM
from corectl.backends.cpu import worker as cpu_worker
from corectl.config import EngineConfig
from corectl.loaders.resolve import default_model
from corectl.planning import plan_deployment
from corectl.server.cli.main import main
from support.models import module_bytes
from transformers import Qwen3Config, Qwen3ForCausalLM

LLAMA3_8B_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head_dim, bf16 bytes


def _agrees_with_engine(plan, engine) -> None:
    """On the CPU nothing is estimated: blocks, weights and concurrency are the engine's exactly."""
    info, model = engine.info, engine.executor.worker.model_info  # counted once the weights loaded
    assert plan.dtype == info.dtype and plan.max_model_len == info.max_model_len
    assert plan.num_kv_blocks == info.num_kv_blocks
    itemsize = torch.empty((), dtype=getattr(torch, info.dtype)).element_size()
    assert plan.num_params == model.num_params and plan.weight_bytes == model.num_params * itemsize
    assert plan.max_concurrency == info.kv_capacity_tokens / info.max_model_len


def test_plan_of_the_default_gguf_agrees_with_the_engine(llm_fp32):
    config = llm_fp32.config
    plan = plan_deployment(EngineConfig(dtype="float32", max_model_len=1024, kv_cache_memory_gib=0.25,
                                        max_num_seqs=32), device="cpu")
    assert config.kv_cache_memory_gib == 0.25 and config.max_num_seqs == 32
    _agrees_with_engine(plan, llm_fp32.engine)
    assert plan.fits and plan.model == default_model()
    # Read from the GGUF header: SmolLM2's Q4_1 file keeps some tensors in Q8_0 and the norms in F32.
    assert set(plan.stored_bytes) == {"Q4_1", "Q8_0", "F32"}
    assert sum(plan.stored_bytes.values()) < plan.weight_bytes / 4


def test_plan_of_a_random_weight_preset_agrees_with_the_engine():
    args = {"model": "llama-tiny", "load_format": "dummy", "max_model_len": 256, "kv_cache_memory_gib": 0.01}
    plan = plan_deployment(EngineConfig(**args), device="cpu")
    _agrees_with_engine(plan, LLM(**args).engine)
    assert plan.stored_bytes == {}


def test_a_draft_model_shares_the_plans_kv_budget_as_the_engines(capsys, monkeypatch):
    """A draft's weights and its cache's block beside each of the target's, as the engine holds
    them: the same blocks out of the same budget, a third of the target's alone (its block is twice
    the target's); a draft of another vocabulary is refused as the engine refuses it."""
    spec = {"method": "draft_model", "model": "qwen3-0.6b", "num_speculative_tokens": 3}
    args = {"model": "llama-tiny", "load_format": "dummy", "max_model_len": 256, "kv_cache_memory_gib": 0.01}
    alone = plan_deployment(EngineConfig(**args), device="cpu")
    plan = plan_deployment(EngineConfig(**args, speculative_config={**spec, "model": "llama-tiny"}), device="cpu")
    monkeypatch.setattr(cpu_worker, "prepack_linears", lambda model, dtype: 0)  # packed copies: not module tensors
    llm = LLM(**args, speculative_config={**spec, "model": "llama-tiny"})
    assert plan.num_kv_blocks == llm.engine.info.num_kv_blocks == alone.num_kv_blocks // 2
    assert plan.draft_kv_bytes_per_token == plan.kv_bytes_per_token
    drafter = llm.engine.executor.worker.runner.drafter.runner.model
    assert plan.draft_weight_bytes_per_rank == module_bytes(drafter)
    assert plan.fixed_bytes == alone.fixed_bytes + plan.draft_weight_bytes_per_rank
    assert main(["plan", "llama-tiny", "--device", "cpu", "--speculative-config", json.dumps(spec)]) == 2
    assert "the draft model 'qwen3-0.6b' has a 151936-token vocabulary but the target 'llama-tiny' has 512" \
        in capsys.readouterr().err


def test_plan_of_a_mixture_of_experts_agrees_with_the_engine_and_counts_routed_experts():
    args = {"model": "qwen3-moe-tiny", "load_format": "dummy", "max_model_len": 256, "kv_cache_memory_gib": 0.01}
    plan = plan_deployment(EngineConfig(**args), device="cpu")
    _agrees_with_engine(plan, LLM(**args).engine)
    # Each routed (token, expert) pair has activation rows of its own: 8 experts of width 32 per
    # token outgrow the dense width of 128, 2 of them do not.
    wider = plan_deployment(EngineConfig(**args, hf_overrides={"num_experts_per_tok": 8}), device="cpu")
    assert wider.activation_bytes > plan.activation_bytes


def test_plan_reads_a_safetensors_checkpoint_without_loading_it(tmp_path):
    config = Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                         max_position_embeddings=512)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    plan = plan_deployment(EngineConfig(model=str(tmp_path), dtype="float32"), device="cpu")
    assert plan.architecture == "Qwen3ForCausalLM"
    # The file holds bf16 weights (the tied head once); the engine holds them as fp32.
    assert list(plan.stored_bytes) == ["BF16"] and plan.weight_bytes == 2 * plan.stored_bytes["BF16"]
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4


def _plan(capsys, *args: str) -> tuple[int, str]:
    code = main(["plan", *args])
    return code, capsys.readouterr().out


def test_plan_json_for_a_gpu_of_named_memory(capsys):
    code, out = _plan(capsys, "llama3-8b", "--device-memory", "80GiB", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["fits"] and plan["device"] == "gpu" and plan["dtype"] == "bfloat16"
    assert plan["num_params"] == 8_030_261_248 and plan["weight_bytes"] == 2 * plan["num_params"]
    assert plan["kv_bytes_per_token"] == LLAMA3_8B_KV_PER_TOKEN
    # The KV cache takes what weights, activations and non-torch memory leave of 0.9 x 80 GiB.
    left = 0.9 * 80 * 2**30 - plan["weight_bytes"] - plan["buffer_bytes"] - plan["activation_bytes"] \
        - plan["non_torch_bytes"]
    assert 0 <= left - plan["kv_cache_bytes"] < plan["block_size"] * LLAMA3_8B_KV_PER_TOKEN
    assert plan["max_concurrency"] == pytest.approx(plan["kv_tokens"] / 8192, abs=1e-3)


def test_tensor_parallelism_splits_weights_and_kv_heads(capsys):
    def plan(tp: int) -> dict:
        code, out = _plan(capsys, "llama3-8b", "--device-memory", "80GiB", "--json", "-tp", str(tp))
        assert code == 0
        return json.loads(out)

    one, two, sixteen = plan(1), plan(2), plan(16)
    assert two["kv_bytes_per_token"] == LLAMA3_8B_KV_PER_TOKEN // 2
    assert two["weight_bytes_per_rank"] == pytest.approx(one["weight_bytes"] / 2, rel=0.01)
    # 16 ranks share 8 KV heads: each holds one, so K/V per token stop shrinking past 8 ranks.
    assert sixteen["num_kv_heads_per_rank"] == 1
    assert sixteen["kv_bytes_per_token"] == LLAMA3_8B_KV_PER_TOKEN // 8
    assert two["kv_tokens"] > 2 * one["kv_tokens"]


def test_pipeline_stages_plan_the_stage_with_the_fewest_blocks(capsys):
    def plan(*extra: str) -> dict:
        code, out = _plan(capsys, "llama3-8b", "--device-memory", "80GiB", "--json", *extra)
        assert code == 0
        return json.loads(out)

    one, even, uneven = plan(), plan("-pp", "2"), plan("-pp", "2", "--pipeline-layer-partition", "12,20")
    assert even["kv_bytes_per_token"] == LLAMA3_8B_KV_PER_TOKEN // 2
    assert even["weight_bytes_per_rank"] == pytest.approx(one["weight_bytes"] / 2, rel=0.01)
    assert even["weight_bytes"] == one["weight_bytes"] and even["num_params"] == one["num_params"]
    # 20 of 32 layers and the LM head: the second stage holds fewer blocks, so every stage gets that many.
    assert (uneven["pipeline_stage"], uneven["stage_layers"]) == (1, [12, 20])
    assert uneven["kv_bytes_per_token"] == LLAMA3_8B_KV_PER_TOKEN * 20 // 32
    assert uneven["kv_tokens"] < even["kv_tokens"]
    code, table = _plan(capsys, "llama3-8b", "--device-memory", "80GiB", "-pp", "2")
    assert "per rank at -pp 2 (stage 0, layers 0-15)" in table


@pytest.mark.slow
def test_a_pipeline_plan_agrees_with_the_engine():
    """Two CPU stages of 1 and 3 layers share one KV budget per rank: the engine allocates the
    blocks of the stage with more layers on both, as the plan says."""
    args = {"model": "llama-tiny", "load_format": "dummy", "max_model_len": 256, "kv_cache_memory_gib": 0.01,
            "hf_overrides": {"num_hidden_layers": 4}, "pipeline_parallel_size": 2, "pipeline_layer_partition": "1,3"}
    plan = plan_deployment(EngineConfig(**args), device="cpu")
    llm = LLM(**args)
    try:
        assert (plan.pipeline_stage, plan.stage_layers) == (1, (1, 3))
        assert plan.num_kv_blocks == llm.engine.info.num_kv_blocks
    finally:
        llm.engine.executor.shutdown()


@pytest.mark.parametrize("args", [
    ("llama3-8b", "--device-memory", "18GiB"),
    ("deepseek-v2-lite", "--device-memory", "24GiB"),
    ("qwen3-0.6b", "--device", "cpu", "--kv-cache-memory", "0.01"),
])
def test_a_plan_that_does_not_fit_names_flags_that_make_it_fit(capsys, args):
    code, out = _plan(capsys, *args, "--json")
    plan = json.loads(out)
    assert code == 1 and not plan["fits"] and plan["problem"]
    assert plan["remedies"], out
    for remedy in plan["remedies"]:
        code, out = _plan(capsys, *args, *remedy.split(), "--json")
        assert code == 0, (remedy, out)
    code, table = _plan(capsys, *args)
    assert "fits          no: " in table and "to fit" in table


def test_plan_table_of_the_default_model(capsys):
    code, table = _plan(capsys, "--device", "cpu", "--kv-cache-memory", "0.25", "--max-model-len", "1024")
    rows = dict(line.split(None, 1) for line in table.splitlines() if not line.startswith(("KV ", "to fit")))
    assert code == 0 and rows["fits"] == "yes"
    assert "Q4_1" in rows["checkpoint"] and "LlamaForCausalLM" in rows["model"]


def test_an_unknown_model_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "no-such-preset"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-preset" in err and "shape presets: llama3-8b" in err
    with pytest.raises(SystemExit):
        main(["plan", "llama3-8b", "--device-memory", "80"])
    assert "is not a size with a unit" in capsys.readouterr().err


def test_plan_of_a_bare_backbone_sizes_it_as_its_causal_lm(tmp_path):
    """An embedding checkpoint names only its backbone (`Qwen3Model`, as Qwen3-Embedding does)."""
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    config.architectures = ["Qwen3Model"]
    config.save_pretrained(tmp_path)
    plan = plan_deployment(EngineConfig(model=str(tmp_path), load_format="dummy", kv_cache_memory_gib=0.01),
                           device="cpu")
    assert plan.architecture == "Qwen3ForCausalLM" and plan.fits and plan.num_params > 0


def test_plan_of_a_vision_language_model_reserves_its_encoder_cache(qwen2_5_vl_dir):
    """Built on the meta device like any model (its M-RoPE rows included); on a GPU the encoder cache
    (16,384 rows of the language model's width) comes out of the KV cache's share, as the engine's
    profile takes it; the CPU's fixed KV budget is unchanged."""
    from corectl.multimodal.budget import ENCODER_CACHE_ROWS
    from corectl.planning import read_checkpoint

    config = EngineConfig(model=str(qwen2_5_vl_dir), dtype="float32")
    gpu = plan_deployment(config, device="gpu", device_memory=2**30)
    width = read_checkpoint(config).hf_config.hidden_size
    assert gpu.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert gpu.encoder_cache_bytes == ENCODER_CACHE_ROWS * width * 4
    left = 0.9 * 2**30 - gpu.fixed_bytes
    assert 0 <= left - gpu.kv_cache_bytes < gpu.block_size * gpu.kv_bytes_per_token
    assert plan_deployment(config, device="cpu").encoder_cache_bytes == 0
    # In two stages the first holds the tower and its cache: it has the fewer blocks.
    staged = plan_deployment(config.replace(pipeline_parallel_size=2), device="gpu", device_memory=2**30)
    assert (staged.pipeline_stage, staged.encoder_cache_bytes) == (0, gpu.encoder_cache_bytes)
    assert staged.weight_bytes_per_rank < gpu.weight_bytes_per_rank
