"""EAGLE and EAGLE-3 heads over a tiny random Llama (transformers config, fp32), saved in the published
checkpoint layouts: greedy output token-exact against the engine without speculation (alone, in a
mixed batch, from the prefix cache, through preemption under synchronous and async scheduling,
at tensor-parallel size 2),
the sampling distribution of a verify step's tokens against the target's exact one (chi-square
over seeded and n > 1 requests), the head's drafts against a plain torch reading of the published
forward, a head made for another target refused naming both sides, and `corectl serve
--speculative-config` reporting the counters.

The EAGLE head is built to agree with the target: the target's embedding rows have unit RMS (so
its first input norm is nearly the identity, which EAGLE's layer skips) and its layers after the
first are small, and the head's layer is the target's first with fc passing the embedding on; it
drafts the target's next tokens most of the time, so verify steps accept whole and partial drafts.
"""
from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.errors import ConfigError
from corectl.spec_decode.draft_model import DraftRequest
from corectl.step_messages import CachedRequestData, NewRequestData, SchedulerOutput
from safetensors.torch import save_file
from support.spec_decode import chi_square_p_value, eagle3_drafts, eagle_drafts, tokens_and_stats

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 256, 64, 3, 96
SHAPE = dict(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6)


def _target(folder):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, num_hidden_layers=LAYERS, initializer_range=0.3,
                                         tie_word_embeddings=False, **SHAPE)).float()
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(folder)
    return model


def _head_config(folder, **extra):
    from transformers import LlamaConfig
    config = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=1, tie_word_embeddings=False, **SHAPE, **extra)
    config.save_pretrained(folder)


def _eagle_head(folder, target):
    """EAGLE's layout: fc over concat(embedding, hidden) passing the embedding on, layers.0 the
    target's first layer (its input norm included, which EAGLE skips), no embedding or LM head."""
    _head_config(folder, architectures=["LlamaForCausalLM"])
    state = {name.removeprefix("model."): t.clone() for name, t in target.state_dict().items()
             if name.startswith("model.layers.0.")}
    state["fc.weight"] = torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1)
    save_file(state, folder / "model.safetensors")


def _random(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=gen) * 0.3


def _layer_tensors(prefix: str, rand, attn_input: int) -> dict[str, torch.Tensor]:
    """A random Llama layer's checkpoint tensors whose q/k/v projections read `attn_input` features."""
    kv = 2 * HIDDEN // 4
    state = {f"{prefix}self_attn.{name}_proj.weight": rand(rows, attn_input)
             for name, rows in (("q", HIDDEN), ("k", kv), ("v", kv))}
    state |= {f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, HIDDEN),
              f"{prefix}mlp.down_proj.weight": rand(HIDDEN, 128),
              f"{prefix}mlp.gate_proj.weight": rand(128, HIDDEN), f"{prefix}mlp.up_proj.weight": rand(128, HIDDEN)}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        state[f"{prefix}{norm}.weight"] = 1 + rand(HIDDEN)
    return state


def _random_eagle_head(folder):
    """EAGLE's layout with random weights, fc and q/k/v biases (a Qwen2 head's), an input norm that
    EAGLE's layer skips, and the copy of the target's embedding some repos ship."""
    _head_config(folder, architectures=["LlamaForCausalLM"])
    rand = _random(2)
    state = {"fc.weight": rand(HIDDEN, 2 * HIDDEN), "fc.bias": rand(HIDDEN), "embed_tokens.weight": rand(VOCAB, HIDDEN),
             **_layer_tensors("layers.0.", rand, HIDDEN)}
    for name, rows in (("q", HIDDEN), ("k", HIDDEN // 2), ("v", HIDDEN // 2)):
        state[f"layers.0.self_attn.{name}_proj.bias"] = rand(rows)
    save_file(state, folder / "model.safetensors")


def _eagle3_head(folder, target_layers=(0, 1, 2)):
    """EAGLE-3's layout: midlayer.* with a 2h-wide attention input, fc over three layers, its own
    norm and LM head over a smaller draft vocabulary, d2t and t2d; random weights."""
    _head_config(folder, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB,
                 eagle_aux_hidden_state_layer_ids=list(target_layers))
    rand = _random(1)
    state = {"fc.weight": rand(HIDDEN, 3 * HIDDEN), "norm.weight": 1 + rand(HIDDEN),
             "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN), "midlayer.hidden_norm.weight": 1 + rand(HIDDEN),
             **_layer_tensors("midlayer.", rand, 2 * HIDDEN)}
    targets = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].sort().values
    state["d2t"] = targets - torch.arange(DRAFT_VOCAB)
    state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, targets, True)
    save_file(state, folder / "model.safetensors")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    paths = {name: root / name for name in ("target", "eagle", "eagle_random", "eagle3")}
    target = _target(paths["target"])
    _eagle_head(paths["eagle"], target)
    _random_eagle_head(paths["eagle_random"])
    _eagle3_head(paths["eagle3"])
    return paths


def _llm(folders, method=None, head=None, k=3, **kwargs):
    spec = None if method is None else {"method": method, "model": str(folders[head or method]),
                                        "num_speculative_tokens": k}
    settings = {"kv_cache_memory_gib": 0.01, "max_model_len": 256, "num_threads": 1, **kwargs}
    return LLM(model=str(folders["target"]), dtype="float32", platform="cpu", skip_tokenizer_init=True,
               speculative_config=spec, **settings)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The engines here run one CPU thread (tiny GEMMs; `num_threads` sets torch's process-wide
    count, given back afterwards)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engines(isolated_env, folders):
    return {method: _llm(folders, method) for method in (None, "eagle", "eagle3")}


def _requests(seed: int, count: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(count)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 40), ignore_eos=True) for _ in range(count)]
    return prompts, params


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_is_token_exact_alone_batched_and_from_the_prefix_cache(engines, method):
    prompts, params = _requests(0, 8)
    # Two blocks of its prompt come from the prefix cache the second time: the head starts later.
    prompts[0] += list(range(40))
    expected = _tokens(engines[None], prompts, params)
    llm = engines[method]
    assert _tokens(llm, prompts[:1], params[:1]) == expected[:1]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected and outputs[0].num_cached_tokens >= 32
    stats = llm.engine.scheduler.make_stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_drafts
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    assert stats.kv_cache_usage == 0.0
    if method == "eagle":
        # The head agrees with the target where it sees the whole context (not after a prefix
        # hit): many drafts, at every position, are accepted.
        assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens / 4
        assert min(stats.spec_decode_num_accepted_tokens_per_pos) > 0


@pytest.mark.parametrize(("method", "draft_tp"), [("eagle", 2), ("eagle3", 1), ("eagle3", 2)])
def test_heads_at_two_ranks_are_token_exact(isolated_env, folders, method, draft_tp):
    """At tensor-parallel size 2 (gloo) a head is split as the target is (EAGLE-3's own LM head over
    its draft vocabulary too), or whole on every rank (draft_tensor_parallel_size 1); either way it
    reads the target's split embedding and head."""
    prompts, params = _requests(1, 4)
    two_ranks = {"tensor_parallel_size": 2, "kv_cache_memory_gib": 0.004}
    expected, _ = tokens_and_stats(_llm(folders, **two_ranks), prompts, params)
    spec = {"method": method, "model": str(folders[method]), "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": draft_tp}
    llm = LLM(model=str(folders["target"]), dtype="float32", platform="cpu", skip_tokenizer_init=True,
              max_model_len=256, speculative_config=spec, **two_ranks)
    tokens, stats = tokens_and_stats(llm, prompts, params)
    assert tokens == expected
    assert stats.spec_decode_num_draft_tokens > 0
    if method == "eagle":
        assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens / 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_requests_resume_token_exact(engines, folders, async_scheduling):
    prompts, params = _requests(1, 8)
    expected = _tokens(engines[None], prompts, params)
    # 9 blocks of 16 tokens (fp32, 3 layers) for 8 requests of up to 70 tokens: requests are preempted.
    small = _llm(folders, "eagle", kv_cache_memory_gib=0.00015, max_model_len=128,
                 async_scheduling=async_scheduling)
    assert _tokens(small, prompts, params) == expected
    stats = small.engine.scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0 and stats.kv_cache_usage == 0.0


def _drafts_after_prefill(llm, prompt: list[int], k: int, cached: int) -> list[int]:
    """The proposer's drafts after the target's prefill of `prompt` and its greedy token, driven
    through the engine's runner while the engine is idle (its blocks are all free). `cached`: the
    prompt's first tokens already have K/V (written by a first request), as after a prefix hit."""
    runner = llm.engine.executor.worker.runner
    params = SamplingParams(temperature=0.0, max_tokens=k + 1)

    def prefill(req_id: str, start: int, finished: list[str]):
        new = NewRequestData(req_id=req_id, token_ids=prompt, num_prompt_tokens=len(prompt), sampling_params=params,
                             block_ids=list(range(1, 4)), num_computed_tokens=start)
        count = len(prompt) - start
        return runner.execute_model(SchedulerOutput([new], CachedRequestData(), {req_id: count}, count, finished))
    try:
        if cached:
            prefill("first", 0, [])
        out = prefill("probe", cached, ["first"] if cached else [])
        tokens = [*prompt, out.sampled_token_ids[0]]
        return runner.drafter.propose([DraftRequest("probe", tokens, len(prompt), k)])["probe"]
    finally:
        runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, ["probe"]))
        # The probe wrote K/V into blocks the engine may hold cached prefixes in.
        llm.engine.scheduler.kv.reset_prefix_cache()


@pytest.mark.parametrize(("method", "head"), [("eagle", "eagle_random"), ("eagle3", "eagle3")])
def test_drafts_match_a_torch_reading_of_the_published_forward(engines, folders, method, head):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float32)
    weights = load_file(folders[head] / "model.safetensors")
    config = json.loads((folders[head] / "config.json").read_text())
    llm = engines[method] if head == method else _llm(folders, method, head)
    reference = eagle_drafts if method == "eagle" else eagle3_drafts
    rng = random.Random(2)
    for length, cached in ((5, 0), (23, 0), (23, 16)):
        prompt = [rng.randrange(VOCAB) for _ in range(length)]
        ours = _drafts_after_prefill(llm, prompt, 3, cached)
        assert ours == reference(target, weights, config, prompt, 3, start=cached)


def test_sampled_tokens_keep_the_target_distribution(engines, folders):
    """Requests of 3 tokens at temperature 1.5, top-k 2: the second and third come from a verify
    step (one draft). Their joint law with the first, over 1,000 samples against the target's
    exact one: 500 seeded requests, and 20 with n = 25 (sharing their prompt through the prefix
    cache; unseeded, as a seeded request's n samples are seeded seed + i, like vLLM's, and so
    overlap other seeds' streams), from a seeded global generator."""
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float32)
    prompt, temperature, top_k = [5, 17, 99, 3, 42, 7], 1.5, 2
    exact = _exact_joint(target, prompt, temperature, top_k, depth=3)
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=seed, max_tokens=3, ignore_eos=True)
              for seed in range(500)]
    params += [SamplingParams(n=25, temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True)] * 20
    llm = engines["eagle"]
    before = llm.engine.scheduler.make_stats()
    torch.manual_seed(0)
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    samples = [tuple(o.token_ids) for out in outputs for o in out.outputs]
    assert len(samples) == 1000
    stats = llm.engine.scheduler.make_stats()
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert 0 < accepted < drafted, "the verify steps must both accept and reject drafts"
    cells = sorted(exact)
    index = {cell: i for i, cell in enumerate(cells)}
    assert all(sample in index for sample in samples)
    probs = torch.tensor([exact[cell] for cell in cells])
    assert (probs * len(samples)).min() > 5, "every cell needs an expected count for the chi-square test"
    p = chi_square_p_value(torch.tensor([index[s] for s in samples]), probs)
    assert p > 1e-3, f"chi-square p-value {p:.2e}"


def _exact_joint(model, prompt, temperature, top_k, depth) -> dict[tuple[int, ...], float]:
    """P(t_0..t_{depth-1}) under temperature then top-k, from the transformers model's logits."""
    joint = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for prefix, mass in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([[*prompt, *prefix]])).logits[0, -1] / temperature
            top = logits.topk(top_k)
            for token, p in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
                grown[(*prefix, token)] = mass * p
        joint = grown
    return joint


@pytest.mark.parametrize(("method", "field", "message"), [
    ("eagle", "hidden_size", r"the eagle head '.*' has hidden size 32 but the target '.*' has 64"),
    ("eagle3", "vocab_size", r"the eagle3 head '.*' has a vocabulary of 512 but the target '.*' has 256"),
])
def test_a_head_for_another_target_is_refused_naming_both(isolated_env, folders, tmp_path, method, field, message):
    head = tmp_path / method
    head.mkdir()
    config = json.loads((folders[method] / "config.json").read_text())
    config[field] = {"hidden_size": 32, "vocab_size": 512}[field]
    (head / "config.json").write_text(json.dumps(config))
    (head / "model.safetensors").write_bytes((folders[method] / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match=message):
        _llm({**folders, method: head}, method)


@pytest.mark.parametrize("method, head", [("eagle", "eagle3"), ("eagle3", "eagle")])
def test_a_head_of_the_other_layout_is_refused_naming_its_method(isolated_env, folders, method, head):
    with pytest.raises(ConfigError, match=rf"is an {'EAGLE-3' if head == 'eagle3' else 'EAGLE'} head .* but the "
                                          rf"method is '{method}': set \"method\": \"{head}\""):
        _llm({**folders, method: folders[head]}, method)


def test_serve_with_an_eagle3_head_reports_the_speculative_counters(folders):
    import openai
    from support.server import ServerProcess
    spec = json.dumps({"method": "eagle3", "model": str(folders["eagle3"]), "num_speculative_tokens": 3})
    server = ServerProcess(str(folders["target"]), "--skip-tokenizer-init", "--engine-in-process", "--dtype", "float32",
                           "--num-threads", "1", "--max-model-len", "256", "--kv-cache-memory", "0.01",
                           "--speculative-config", spec).wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        prompt, max_tokens = [5, 17, 99, 3, 42, 7], 12
        out = client.completions.create(model=str(folders["target"]), prompt=prompt, max_tokens=max_tokens,
                                        temperature=0.0)
        assert out.usage.completion_tokens == max_tokens
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith("vllm:spec_decode")}
        assert metrics["vllm:spec_decode_num_drafts_total"] > 0
        assert metrics["vllm:spec_decode_num_draft_tokens_total"] >= metrics["vllm:spec_decode_num_drafts_total"]
        assert "vllm:spec_decode_num_accepted_tokens_total" in metrics
    finally:
        server.stop()


def test_a_split_eagle3_head_drafts_from_its_whole_draft_vocabulary(monkeypatch):
    """Each of two ranks holds half of an EAGLE-3 head's draft vocabulary: its draft is the argmax
    over the gathered logits, the whole head's, not over its own half (all_gather stood in for by
    the two ranks' slices, computed here in one process)."""
    from corectl.distributed import TensorParallel, parallel_state
    from corectl.models import parallel
    from corectl.spec_decode.eagle_heads import Eagle3Head
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=1, draft_vocab_size=DRAFT_VOCAB, **SHAPE)
    weight = torch.randn(DRAFT_VOCAB, HIDDEN, generator=torch.Generator().manual_seed(6))
    rows = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(7))

    def head(rank: int, world_size: int) -> Eagle3Head:
        monkeypatch.setattr(parallel_state, "_state", TensorParallel(rank, world_size))
        built = Eagle3Head(config, 64, torch.float32)
        built.lm_head.weight.weight_loader(built.lm_head.weight, weight)
        built.d2t.copy_(torch.arange(DRAFT_VOCAB) * 2)
        return built

    whole = head(0, 1).draft_tokens(rows, None)
    halves = [head(rank, 2) for rank in range(2)]
    local = [h.lm_head(rows) for h in halves]
    monkeypatch.setattr(parallel, "all_gather", lambda x: torch.cat(local, dim=-1))
    assert torch.equal(halves[0].draft_tokens(rows, None), whole)
    # Several rows' argmaxes lie in the second rank's half: the first's slice alone would miss them.
    assert (whole >= 2 * (DRAFT_VOCAB // 2)).any()
