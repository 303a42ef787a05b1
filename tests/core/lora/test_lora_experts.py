"""LoRA on mixture-of-experts experts, on CPU in fp32: tiny random Qwen3-MoE and Mixtral (4 experts,
top 2), adapters made by peft on transformers 5's fused experts (`target_parameters`), token-exact
against transformers + peft; the per-expert module layout of older checkpoints gives the same
tokens; a mixed batch equals each request alone; bad expert adapters are refused by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from corectl import LLM, LoRARequest, SamplingParams
from corectl.lora.checkpoint import load_adapter
from corectl.lora.errors import LoRAAdapterError
from corectl.lora.shapes import BaseModelShape
from safetensors.torch import load_file, save_file
from support.adapters import save_adapter
from support.models import build_random_checkpoint, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 77, 300, 1234, 999, 42, 17], [600, 601, 602]]
ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory_gib=0.02, block_size=16, max_lora_rank=16)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Older checkpoints' per-expert module names: Qwen3-MoE's, and Mixtral's (w1 gate, w3 up, w2 down).
QWEN_NAMES = {"gate": "mlp.experts.{e}.gate_proj", "up": "mlp.experts.{e}.up_proj", "down": "mlp.experts.{e}.down_proj"}
MIXTRAL_NAMES = {"gate": "block_sparse_moe.experts.{e}.w1", "up": "block_sparse_moe.experts.{e}.w3",
                 "down": "block_sparse_moe.experts.{e}.w2"}


def per_expert_layout(fused: Path, folder: Path, num_experts: int, hidden: int, names: dict[str, str]) -> Path:
    """`fused` (PEFT parameter LoRA over the stacked experts) rewritten as per-expert modules, as
    transformers 4 models' adapters store them: expert e's A is rows [e r, (e + 1) r) of the
    stack's A, its B the columns e, e + E, ... of the stack's B (peft's ParamWrapper)."""
    folder.mkdir(parents=True)
    config = json.loads((fused / "adapter_config.json").read_text())
    out = {}
    tensors = load_file(str(fused / "adapter_model.safetensors"))
    for key, a in tensors.items():
        if ".mlp.experts." not in key:
            out[key] = a
        if ".mlp.experts." not in key or ".lora_B." in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        layer = key[:key.index(".mlp.experts")]
        rank = a.shape[0] // num_experts
        a_e, b_e = a.view(num_experts, rank, -1), b.view(b.shape[0], rank, num_experts)
        half = b.shape[0] // 2
        parts = {"gate": slice(0, half), "up": slice(half, None)} if a.shape[1] == hidden else {"down": slice(None)}
        for e in range(num_experts):
            for proj, rows in parts.items():
                stem = f"{layer}.{names[proj].format(e=e)}"
                out[f"{stem}.lora_A.weight"] = a_e[e].clone()
                out[f"{stem}.lora_B.weight"] = b_e[rows, :, e].contiguous()
    save_file(out, str(folder / "adapter_model.safetensors"))
    modules = {names[p].rsplit(".", 1)[-1] for p in names}
    config.update(target_parameters=None, target_modules=sorted(set(config["target_modules"]) | modules))
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def transposed_layout(fused: Path, folder: Path, num_experts: int) -> Path:
    """`fused` as PEFT before 0.19.1 saved it, reading each stack [E, out, in] as [E, in, out]:
    expert e's A is the current B_e.T and its B the current A_e.T (the same delta)."""
    shutil.copytree(fused, folder)
    tensors = load_file(str(fused / "adapter_model.safetensors"))
    for key in [k for k in tensors if ".mlp.experts." in k and ".lora_A." in k]:
        a, b = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0] // num_experts
        tensors[key] = b.view(b.shape[0], rank, num_experts).permute(2, 1, 0).reshape(-1, b.shape[0])
        tensors[key.replace(".lora_A.", ".lora_B.")] = a.view(num_experts, rank, -1).permute(2, 1, 0).reshape(
            a.shape[1], -1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, default_model_dir):
    """The base, two peft adapters (attention and both expert stacks at rank 8; gate_up alone at
    rank 16 with rsLoRA) and the first one in the per-expert layout, in one engine of 3 slots."""
    root = tmp_path_factory.mktemp("qwen3-moe-lora")
    base = build_random_checkpoint("qwen3_moe", root / "base", default_model_dir, num_experts=4)
    peft = {
        "both": save_adapter(base, root / "both", rank=8, seed=1, targets=["q_proj", "v_proj"],
                             target_parameters=EXPERTS),
        "gate_up": save_adapter(base, root / "gate_up", rank=16, seed=2, targets=[], use_rslora=True, lora_alpha=64,
                                target_parameters=EXPERTS[:1]),
    }
    per_expert_layout(root / "both", root / "per_expert", 4, 64, QWEN_NAMES)
    names = ["both", "gate_up", "per_expert"]
    loras = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(names)}
    llm = LLM(str(base), enable_lora=True, max_loras=3, **ENGINE)
    return llm, loras, peft


@pytest.mark.parametrize("name", ["both", "gate_up"])
def test_qwen3_moe_greedy_matches_peft(qwen3_moe, name):
    llm, loras, peft = qwen3_moe
    expected = [hf_greedy(peft[name], prompt, GREEDY.max_tokens)[0] for prompt in PROMPTS]
    assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras[name], use_tqdm=False)) == expected


def test_mixed_batch_equals_each_alone_and_layouts_agree(qwen3_moe):
    """Two adapters, the base and the per-expert copy of the first adapter in one batch: each gets
    its own tokens, both layouts of one adapter the same ones, and each adapter moves the base."""
    llm, loras, _ = qwen3_moe
    order = [loras["both"], loras["gate_up"], None, loras["per_expert"]]
    mixed = tokens(llm.generate([PROMPTS[0]] * 4, GREEDY, lora_request=order, use_tqdm=False))
    alone = [tokens(llm.generate(PROMPTS[0], GREEDY, lora_request=one, use_tqdm=False))[0] for one in order[:3]]
    assert mixed == alone + [alone[0]]
    assert alone[0] != alone[2] and alone[1] != alone[2]


def test_mixtral_fused_per_expert_and_old_peft_layouts_match_peft(tmp_path, default_model_dir):
    """Mixtral's widths (hidden 64, experts 128) tell the pre-0.19.1 PEFT layout apart."""
    base = build_random_checkpoint("mixtral", tmp_path / "base", default_model_dir, num_local_experts=4)
    model = save_adapter(base, tmp_path / "fused", rank=8, seed=3, targets=["k_proj", "o_proj"],
                         target_parameters=EXPERTS)
    per_expert_layout(tmp_path / "fused", tmp_path / "w123", 4, 64, MIXTRAL_NAMES)
    transposed_layout(tmp_path / "fused", tmp_path / "old_peft", 4)
    llm = LLM(str(base), enable_lora=True, max_loras=3, **ENGINE)
    expected = hf_greedy(model, PROMPTS[0], GREEDY.max_tokens)[0]
    with model.disable_adapter():
        assert hf_greedy(model, PROMPTS[0], GREEDY.max_tokens)[0] != expected
    loras = [LoRARequest(name, i + 1, str(tmp_path / name)) for i, name in enumerate(["fused", "w123", "old_peft"])]
    assert tokens(llm.generate([PROMPTS[0]] * 3, GREEDY, lora_request=loras, use_tqdm=False)) == [expected] * 3


@pytest.fixture(scope="module")
def moe_shape():
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return config


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], rank: int = 4, **config) -> LoRARequest:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8,
                                                            "target_modules": [], **config}))
    return LoRARequest(folder.name, 1, str(folder))


STEM = "base_model.model.model.layers.0.mlp"


@pytest.mark.parametrize(("tensors", "config", "message"), [
    ({f"{STEM}.experts.lora_A.weight": torch.zeros(16, 64), f"{STEM}.experts.lora_B.weight": torch.zeros(48, 16)},
     {}, r"layers\.0\.mlp\.experts has lora_A \(16, 64\) and lora_B \(48, 16\).*gate_up_proj needs \[4 \* r, 64\]"),
    ({f"{STEM}.experts.3.down_proj.lora_A.weight": torch.zeros(4, 64),
      f"{STEM}.experts.3.down_proj.lora_B.weight": torch.zeros(64, 4)}, {},
     r"'model\.layers\.0\.mlp\.experts\.3\.down_proj' has lora_A \(4, 64\).*needs \(4, 32\) and \(64, 4\)"),
    ({f"{STEM}.experts.4.w1.lora_A.weight": torch.zeros(4, 64),
      f"{STEM}.experts.4.w1.lora_B.weight": torch.zeros(32, 4)}, {}, "has 4 experts a layer"),
    ({f"{STEM}.gate.lora_A.weight": torch.zeros(4, 64), f"{STEM}.gate.lora_B.weight": torch.zeros(4, 4)}, {},
     "'model.layers.0.mlp.gate', a mixture-of-experts router"),
    ({}, {"target_parameters": ["mlp.gate.weight"]}, "'mlp.gate.weight', a mixture-of-experts router"),
    ({f"{STEM}.experts.lora_A.weight": torch.zeros(128, 64), f"{STEM}.experts.lora_B.weight": torch.zeros(64, 128)},
     {"r": 32}, "rank 32, above max_lora_rank 16"),
], ids=["fused-shape", "per-expert-shape", "expert-index", "router-module", "router-parameter", "rank"])
def test_bad_expert_adapters_are_refused_by_name(tmp_path, moe_shape, tensors, config, message):
    tensors = tensors or {f"{STEM}.experts.lora_A.weight": torch.zeros(16, 64),
                          f"{STEM}.experts.lora_B.weight": torch.zeros(64, 16)}
    lora = write_adapter(tmp_path / "bad", tensors, **config)
    with pytest.raises(LoRAAdapterError, match=message):
        load_adapter(lora, BaseModelShape.of(moe_shape, 16))


def test_expert_adapters_on_a_base_without_experts_are_refused(tmp_path):
    from transformers import LlamaConfig

    dense = LlamaConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
    lora = write_adapter(tmp_path / "experts", {f"{STEM}.experts.lora_A.weight": torch.zeros(16, 64),
                                                f"{STEM}.experts.lora_B.weight": torch.zeros(64, 16)})
    with pytest.raises(LoRAAdapterError, match="mixture-of-experts experts, which the base model has none"):
        load_adapter(lora, BaseModelShape.of(dense, 16))


def test_tensor_parallel_ranks_partial_outputs_with_adapters_add_up():
    """Each rank keeps gate_up's B rows and down's A columns of its slice of every expert: the
    ranks' partial outputs (what the all-reduce sums) are the one-rank layer's output."""
    from corectl.distributed import TensorParallel, parallel_state
    from corectl.lora.experts import ExpertLoRA
    from corectl.lora.layers import LoRABatch
    from corectl.models.moe import FusedMoE, fused_moe_torch, select_experts

    e, h, i, rank = 4, 16, 8, 4
    pairs = {"gate_up_proj": (torch.randn(e, 2, rank, h), torch.randn(e, 2 * i, rank)),
             "down_proj": (torch.randn(e, 1, rank, i), torch.randn(e, h, rank))}
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    hidden = torch.randn(5, h)
    weights, ids = select_experts(torch.randn(5, e), 2, renormalize=False)
    batch = LoRABatch(2, 8, torch.device("cpu"))
    batch.token_slots[:5] = torch.tensor([1, -1, 0, 1, 1], dtype=torch.int32)
    batch.ranks, batch.scale_list = [rank, rank], [0.5, 2.0]

    def partial(tp_rank: int, world: int) -> torch.Tensor:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(parallel_state, "_state", TensorParallel(tp_rank, world))
            experts = FusedMoE(e, h, i, 2, False)
        lora = ExpertLoRA(experts, batch, 2, 8, torch.float32, torch.device("cpu"))
        for slot in range(2):
            lora.load_slot(slot, pairs)
        rows = torch.arange(tp_rank * i // world, (tp_rank + 1) * i // world)
        return fused_moe_torch(hidden, gate_up[:, torch.cat([rows, rows + i])], down[:, :, rows], weights, ids,
                               lora=lora)

    whole = partial(0, 1)
    torch.testing.assert_close(partial(0, 2) + partial(1, 2), whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item())


def test_dummy_adapters_adapt_the_experts_of_a_moe_base(tmp_path, moe_shape):
    """The benchmarks' random adapters on a mixture-of-experts base: attention plus both expert
    stacks of every layer, through the same checks."""
    from corectl.lora.dummy import write_dummy_adapters

    (lora,) = write_dummy_adapters(tmp_path, moe_shape, num=1, rank=8)
    adapter = load_adapter(lora, BaseModelShape.of(moe_shape, 16))
    assert adapter.rank == 8
    assert {m.rsplit(".", 1)[-1] for m in adapter.weights} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_up_proj", "down_proj"}
    assert adapter.weights["model.layers.1.mlp.experts.gate_up_proj"][0].shape == (4, 2, 8, 64)
