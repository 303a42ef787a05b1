"""Decode CUDA graphs give eager execution's tokens across buckets (verify steps of speculative
decoding and vision-language decode steps too, unless CORECTL_GRAPH_VERIFY=0 for the former); async scheduling gives the
synchronous loop's tokens, and launching a step never waits for the device."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl import SamplingParams  # noqa: E402
from corectl.backends.cuda.graph_runner import CUDAGraphModelRunner, _GraphStepInputs  # noqa: E402
from support.gpu import (  # noqa: E402
    MAX_TOKENS,
    PROMPT_LENGTHS,
    assert_async_gives_synchronous_tokens,
    assert_launches_never_wait,
    compare_greedy_outputs,
    generate,
    random_prompts,
)

# Graphs pad GEMMs to the bucket and split decode attention for the model's max length, so bf16
# results may differ from eager by a rounding; fp32 ones by far less than any logit gap.
TIE_TOLERANCE = {"float32": 0.0, "bfloat16": 0.25}
# A graph's decode kernel splits the context as for max_model_len, eager as for the actual length:
# the fp32 partial sums combine in another order, and bf16 rounds the results differently.
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}


@pytest.fixture
def replayed_sizes(monkeypatch) -> list[int]:
    """Batch size of every graph replay from here on."""
    sizes: list[int] = []
    run_model = CUDAGraphModelRunner.run_model

    def watched(self, inputs):
        if isinstance(inputs, _GraphStepInputs):
            sizes.append(inputs.graph.size)
        return run_model(self, inputs)

    monkeypatch.setattr(CUDAGraphModelRunner, "run_model", watched)
    return sizes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_decode_the_tokens_eager_execution_does(dtype, checkpoint, replayed_sizes):
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=5, ignore_eos=True) for n in MAX_TOKENS]
    eager = generate(checkpoint, prompts, params, dtype=dtype, max_num_seqs=16, enforce_eager=True)
    assert not replayed_sizes
    graphs = generate(checkpoint, prompts, params, dtype=dtype, max_num_seqs=16)
    assert {1, 2, 4, 8, 16} <= set(replayed_sizes)
    worst = compare_greedy_outputs(eager, graphs, TIE_TOLERANCE[dtype], exact=dtype == "float32")
    print(f"{checkpoint.name} {dtype}: max logprob difference graphs vs eager {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE[dtype]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_launching_a_step_never_waits_for_the_device(enforce_eager, checkpoint):
    assert_launches_never_wait(checkpoint, enforce_eager)


def test_async_scheduling_gives_the_tokens_of_the_synchronous_loop(checkpoint):
    assert_async_gives_synchronous_tokens(checkpoint)


@pytest.mark.skipif(torch.version.hip is not None or torch.cuda.get_device_capability(0) < (9, 0),
                    reason="programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0+")
def test_programmatic_dependent_launch_changes_no_bit(checkpoint, monkeypatch):
    """The Triton kernels launched with PDL (each waits for its predecessor before touching memory)
    against the same kernels launched plainly (CORECTL_PDL=0): the same tokens and logprobs to the
    bit, with graphs and eager steps (prefill), dense decode layers on the GEMV."""
    from corectl.backends.triton import layer_kernels
    from corectl.backends.triton.gemm.fp8_gemv import MAX_M, GemvConfig

    monkeypatch.setattr(layer_kernels, "dense_decode_config",
                        lambda m, n, k, gated, device: GemvConfig(1, 8, 256, 1, 4, 3) if m == 1 else
                        (GemvConfig(16, 32, 128, 2, 4, 3) if m <= MAX_M else None))
    prompts = random_prompts(PROMPT_LENGTHS)
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True) for n in MAX_TOKENS]
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("CORECTL_PDL", flag)
        outputs = generate(checkpoint, prompts, params)
        runs[flag] = [(o.outputs[0].token_ids, [next(iter(p.values())).logprob for p in o.outputs[0].logprobs])
                      for o in outputs]
    assert runs["0"] == runs["1"]


def test_verify_steps_replayed_in_graphs_give_eager_verification_tokens(checkpoint, replayed_sizes, monkeypatch):
    """A verify step (k + 1 rows a request) replays a verify graph of k + 1 rows a request; fp32, so
    token-exact against verify steps run eagerly (CORECTL_GRAPH_VERIFY=0)."""
    # The checkpoint drafts for itself: every step proposes k tokens, so every verify step has k + 1
    # rows a request. (N-gram lookup over a random model's output proposed almost nothing, and the
    # steps stayed plain decodes.)
    spec = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 4}
    prompts = random_prompts([5, 12, 20, 7], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    monkeypatch.setenv("CORECTL_GRAPH_VERIFY", "0")
    eager = generate(checkpoint, prompts, params, dtype="float32", max_num_seqs=4, speculative_config=spec)
    assert max(replayed_sizes, default=0) <= 4
    monkeypatch.delenv("CORECTL_GRAPH_VERIFY")
    graphs = generate(checkpoint, prompts, params, dtype="float32", max_num_seqs=4, speculative_config=spec)
    assert max(replayed_sizes) > 4, "verify steps of 4 requests x 5 rows must have replayed graphs"
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]


def test_vision_language_decode_replays_graphs_with_the_eager_tokens(tmp_path, replayed_sizes):
    """Qwen2.5-VL (M-RoPE): image requests decode in graphs at index + offset positions, one row,
    token-exact in fp32 against eager steps, batched with a text-only request."""
    import gc

    from corectl import LLM
    from support.gpu import write_tokenizer
    from support.vision_models import build_qwen2_5_vl, random_image

    (tmp_path / "tokenizer").mkdir()
    write_tokenizer(tmp_path / "tokenizer", 512)
    folder = build_qwen2_5_vl(tmp_path / "qwen2_5_vl", tmp_path / "tokenizer")

    def user(*parts):
        return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else
                                             {"type": "image_pil", "image_pil": p} for p in parts]}]

    conversations = [user(random_image(100, 70, 1), "t5 t6 t7"), user(random_image(60, 90, 2), "t8"),
                     [{"role": "user", "content": "t9 t10 t11 t12"}]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(str(folder), platform="cuda", dtype="float32", max_model_len=512, gpu_memory_utilization=0.2,
                  max_num_seqs=8, enforce_eager=eager)
        tokens[eager] = [list(o.outputs[0].token_ids) for o in llm.chat(conversations, params, use_tqdm=False)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert replayed_sizes, "the image requests' decode steps must have replayed graphs"
    assert tokens[False] == tokens[True]
