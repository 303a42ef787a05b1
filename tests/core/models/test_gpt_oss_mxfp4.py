"""gpt-oss's MXFP4 experts served packed: a platform listing the `mxfp4_moe` kernel (the CPU
platform here, given the Triton kernel under the interpreter, as CUDA is) keeps the blocks and
scales and runs the kernel; greedy tokens equal those of the dequantized torch path."""
from __future__ import annotations

import dataclasses

import torch
from corectl import LLM, SamplingParams
from corectl.backends.cpu.platform import CPUPlatform
from corectl.backends.cpu.worker import CPUWorker
from corectl.backends.triton.moe.mxfp4_moe import routed_mxfp4_moe
from support.gpt_oss_checkpoints import mxfp4_checkpoint


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, ignore_eos=True)
    return [(out.outputs[0].token_ids, [next(iter(pos.values())).logprob for pos in out.outputs[0].logprobs])
            for out in llm.generate(prompts, params, use_tqdm=False)]


def test_packed_experts_give_the_dequantized_tokens(tmp_path, default_model_dir, monkeypatch):
    folder = tmp_path / "oss4"
    # Two layers, one sliding and one full: the kernels run interpreted, each launch costs seconds.
    mxfp4_checkpoint(folder, default_model_dir, num_hidden_layers=2)
    engine = dict(dtype="float32", kv_cache_memory_gib=0.01, max_model_len=64, enable_prefix_caching=False)
    # Two prompts (prefill and decode steps of several pairs an expert: the sorted path), then one
    # alone (decode steps of 2 pairs over 4 experts: the pairs path).
    batches = [[[5, 9, 33, 7, 81], [11, 4, 60, 2, 19, 27, 8]], [[40, 3, 17, 90]]]
    dequantized = LLM(str(folder), **engine)
    assert dequantized.engine.info.quantization == "mxfp4 (dequantized)"
    expected = [_generate(dequantized, prompts) for prompts in batches]
    del dequantized

    caps = CPUPlatform().capabilities()
    monkeypatch.setattr(CPUPlatform, "capabilities",
                        lambda self: dataclasses.replace(caps, quantization_kernels=("mxfp4_moe",)))
    calls = []

    def counted(hidden, *args):
        calls.append(hidden.shape[0])
        return routed_mxfp4_moe(hidden, *args)

    monkeypatch.setattr(CPUWorker, "quantization_kernels", lambda self: {"mxfp4_moe": counted})
    packed = LLM(str(folder), **engine)
    assert packed.engine.info.quantization == "mxfp4 (mxfp4_moe)"
    model = packed.engine.executor.worker.runner.model
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks.dtype == torch.uint8 and not hasattr(experts, "gate_up_proj")
    assert model.supports_graph_capture
    calls.clear()
    for prompts, reference in zip(batches, expected):
        got = _generate(packed, prompts)
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, reference):
            assert tokens == ref_tokens
            assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
    assert 1 in calls and max(calls) > 2


def test_the_gpt_oss_20b_preset_plans_packed_experts_on_an_h100(isolated_env):
    """`corectl plan` of the preset: an H100 (which lists `mxfp4_moe`) holds the experts packed,
    17/32 byte a weight; the CPU dequantizes them to bf16; everything else is the same bytes."""
    from corectl.config import EngineConfig
    from corectl.planning import plan_deployment

    config = EngineConfig(model="gpt-oss-20b", load_format="dummy", dtype="bfloat16", max_model_len=4096)
    gpu = plan_deployment(config, device_memory=80 << 30, device_capability=(9, 0))
    cpu = plan_deployment(config, device="cpu")
    assert (gpu.quantization, cpu.quantization) == ("mxfp4 (mxfp4_moe)", "mxfp4 (dequantized)")
    expert_weights = 24 * 32 * 3 * 2880 * 2880
    assert gpu.weight_bytes - expert_weights * 17 // 32 == cpu.weight_bytes - expert_weights * 2
    assert 12.5 < gpu.weight_bytes / 2**30 < 13.0  # gpt-oss-20b's published checkpoint: 12.8 GiB
