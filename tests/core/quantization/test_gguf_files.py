"""A GGUF file written here with the `gguf` package (a random Llama, its projections in Q4_0, Q4_1
and Q8_0, a synthetic vocabulary of 512 tokens) is served from its 4-bit blocks where the blocks are
int4 groups and dequantized elsewhere, with the greedy tokens of its dequantized fp32 path."""
from __future__ import annotations

import pytest
from corectl import LLM
from gguf import GGMLQuantizationType as Q
from support.gguf_files import write_gguf
from support.models import build_random_checkpoint
from support.quant_checkpoints import greedy_divergences, random_prompts

ENGINE = {"kv_cache_memory_gib": 0.05, "max_model_len": 128}
VOCAB = 512
# projection -> storage type; layer 1's down projection stays Q8_0 (dequantized at load)
TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_1,
         "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("gguf")
    dense = build_random_checkpoint("llama", root / "dense", default_model_dir, seed=5, hidden_size=128,
                                    intermediate_size=256, initializer_range=0.1, vocab_size=VOCAB)
    return write_gguf(dense, root / "tiny-llama.gguf", TYPES, {("1", "ffn_down"): Q.Q8_0})


def test_mixed_gguf_keeps_its_int4_layers_and_matches_the_dequantized_path(gguf_file):
    ours = LLM(str(gguf_file), **ENGINE)
    assert ours.engine.info.quantization == "gguf (Q4_0/Q4_1 int4 layers via cpu_int4pack)"
    layers = ours.engine.executor.worker.runner.model.model.layers
    assert hasattr(layers[0].mlp.down_proj, "packed_weight")
    assert getattr(layers[1].mlp.down_proj, "quant_method", None) is None  # Q8_0: dequantized (and prepacked)
    reference = LLM(str(gguf_file), quantization="none", dtype="float32", **ENGINE)
    divergences = greedy_divergences(ours, reference, random_prompts(vocab=VOCAB))
    print(f"tiny Llama GGUF (Q4_0/Q4_1/Q8_0) vs fp32: {len(divergences)} near-tie divergences {divergences}")
