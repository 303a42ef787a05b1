"""Multi-LoRA generation end to end on CPU: token-exact against transformers + peft in fp32, mixed
batches, the max_loras bound with host/device eviction, and the prefix cache kept per adapter."""
from __future__ import annotations

import pytest
from corectl import LLM, LoRARequest, SamplingParams
from support.models import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 77, 300, 1234, 999, 42, 17], [11, 2024, 380, 7, 7, 901, 3000, 44, 12], [600, 601, 602]]
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_gib=0.05, block_size=16)
IDS = {"r8": 1, "r64": 2, "r16": 3, "attn": 4}


def lora(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, IDS[name], str(adapters[name][0]))


@pytest.fixture(scope="module")
def llm(lora_base):
    """Four device slots, ranks up to 64."""
    return LLM(str(lora_base), enable_lora=True, max_loras=4, max_lora_rank=64, **ENGINE)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", ["r8", "r64"])
def test_greedy_matches_peft(llm, adapters, name):
    """All seven projections adapted (rank 64 scaled by rsLoRA): the tokens PEFT's model picks."""
    reference = [hf_greedy(adapters[name][1], prompt, GREEDY.max_tokens)[0] for prompt in PROMPTS]
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora(adapters, name), use_tqdm=False)) == reference


def test_mixed_batch_equals_each_alone(llm, adapters):
    """The base and three adapters in one batch (one step mixes them) give each request's own tokens,
    and every adapter changes the base's output."""
    names = [None, "r8", "r16", "attn"]
    prompt = PROMPTS[1]
    loras = [None if n is None else lora(adapters, n) for n in names]
    mixed = tokens(llm.generate([prompt] * 4, GREEDY, lora_request=loras, use_tqdm=False))
    alone = [tokens(llm.generate(prompt, GREEDY, lora_request=one, use_tqdm=False))[0] for one in loras]
    assert mixed == alone
    assert all(out != mixed[0] for out in mixed[1:])


def test_prefix_cache_is_per_adapter(llm, adapters):
    """The same 40-token prompt under two adapters and the base: no request reads another's K/V
    (each first run hits nothing), and a repeat under the same adapter hits its own blocks."""
    prompt = [(13 * j) % 40000 + 50 for j in range(40)]
    first = {}
    for name in ["r8", "r16", None]:
        one = None if name is None else lora(adapters, name)
        out = llm.generate(prompt, GREEDY, lora_request=one, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0, name
        first[name] = list(out.outputs[0].token_ids)
    again = llm.generate(prompt, GREEDY, lora_request=lora(adapters, "r16"), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    assert list(again.outputs[0].token_ids) == first["r16"]
    reference = hf_greedy(adapters["r16"][1], prompt, GREEDY.max_tokens)[0]
    assert first["r16"] == reference


def test_one_slot_serves_adapters_in_turn(lora_base, adapters):
    """max_loras=1 and a host cache of 1: three adapters in one call run one at a time (each load
    evicts the last) and still give their own tokens."""
    one_slot = LLM(str(lora_base), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16, **ENGINE)
    names = ["r8", "r16", "attn", "r8"]
    loras = [lora(adapters, n) for n in names]
    outputs = tokens(one_slot.generate([PROMPTS[0]] * 4, GREEDY, lora_request=loras, use_tqdm=False))
    expected = {n: hf_greedy(adapters[n][1], PROMPTS[0], GREEDY.max_tokens)[0] for n in set(names)}
    assert outputs == [expected[n] for n in names]


def test_a_step_without_adapters_clears_the_slots(llm, adapters):
    """Decode graphs read the slot buffer whatever the step: after a step with adapters, a base-only
    step leaves every row at -1 (no adapter), and the device slots stay resident (LRU)."""
    manager = llm.engine.executor.worker.runner.lora
    llm.generate(PROMPTS[0], GREEDY, lora_request=lora(adapters, "r8"), use_tqdm=False)
    assert (manager.batch.token_slots >= 0).any()
    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert (manager.batch.token_slots == -1).all()
    assert IDS["r8"] in manager.resident


def test_preemption_and_async_scheduling_keep_each_adapters_tokens(lora_base, adapters, llm):
    """A KV cache of 10 blocks for four 64-token requests (two adapters, the base, one adapter
    twice) under async scheduling: requests are preempted and recomputed, and each still gets the
    tokens it gets alone in a roomy engine."""
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block tokens x KV heads x head dim x fp32
    tight = LLM(str(lora_base), enable_lora=True, max_loras=2, max_lora_rank=64, dtype="float32", max_model_len=96,
                block_size=16, max_num_batched_tokens=32, async_scheduling=True,
                kv_cache_memory_gib=10.5 * block_bytes / 2**30)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[(31 * i + 7 * j) % 40000 + 100 for j in range(40)] for i in range(4)]
    loras = [lora(adapters, "r8"), None, lora(adapters, "r64"), lora(adapters, "r8")]
    got = tokens(tight.generate(prompts, params, lora_request=loras, use_tqdm=False))
    assert tight.engine.scheduler.make_stats().num_preemptions > 0
    alone = [tokens(llm.generate(p, params, lora_request=one, use_tqdm=False))[0] for p, one in zip(prompts, loras)]
    assert got == alone


def test_triton_kernels_in_the_engine_match_the_torch_path(llm, adapters, monkeypatch):
    """The engine's steps through the Triton LoRA kernels (interpreted on CPU): 17 requests of three
    adapters and the base, so the prefill step takes the segment form and the decode step of 17
    rows the sorted tiles the manager writes; tokens and logprobs match the torch path's."""
    from corectl.backends.triton.layer_kernels import triton_layer_kernels
    from corectl.models.kernels import install_layer_kernels

    names = [None, "r8", "r16", "attn"]
    loras = [None if names[i % 4] is None else lora(adapters, names[i % 4]) for i in range(17)]
    prompts = [[(37 * i + 11 * j) % 40000 + 100 for j in range(3 + i % 5)] for i in range(17)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0)

    def run():
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return tokens(outs), [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs] for o in outs]

    reference_tokens, reference_logprobs = run()
    model = llm.engine.executor.worker.runner.model
    batch, layouts = llm.engine.executor.worker.runner.lora.batch, []
    kernel_layout = batch.kernel_layout
    monkeypatch.setattr(batch, "kernel_layout", lambda rows: layouts.append(kernel_layout(rows)) or layouts[-1])
    assert install_layer_kernels(model, triton_layer_kernels()) > 0
    try:
        got_tokens, got_logprobs = run()
    finally:
        install_layer_kernels(model, None)
    assert any(layout is not None and layout.order is not None for layout in layouts)
    assert got_tokens == reference_tokens
    worst = max(abs(a - b) for row, ref in zip(got_logprobs, reference_logprobs) for a, b in zip(row, ref))
    assert worst < 1e-4
