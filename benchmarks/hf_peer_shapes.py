"""The HF transformers peer (`.peers/hf_baseline.py`, DESIGN.md's harness, read-only) on model shapes
it does not list: its own measurement code, run unchanged, with SHAPES extended by the presets that
issue 28's speed targets name (and eager attention for gpt-oss, which transformers runs no other way
without the kernels hub). `device_bench.sh`'s `peer` runs every shape through this file.

  python benchmarks/hf_peer_shapes.py PEER_SCRIPT static --shape gpt-oss-20b --batch 128 ...
"""
import importlib.util
import sys


def extra_shapes() -> dict:
    from transformers import DeepseekV2Config, GptOssConfig

    return {
        # openai/gpt-oss-20b's config.json; the peer runs its experts in bf16 (~42 GB).
        "gpt-oss-20b": lambda: GptOssConfig(
            hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
            sliding_window=128, swiglu_limit=7.0, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
            max_position_embeddings=131072,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
        # deepseek-ai/DeepSeek-V2-Lite's config.json.
        "deepseek-v2-lite": lambda: DeepseekV2Config(
            vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
            n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
            norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6, max_position_embeddings=163840,
            tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": 4096}),
    }


# transformers' gpt-oss refuses SDPA (its attention sinks): eager attention is its own path there.
EAGER_ONLY = {"gpt-oss-20b"}


def main() -> None:
    spec = importlib.util.spec_from_file_location("hf_baseline", sys.argv[1])
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    peer.SHAPES.update(extra_shapes())
    build = peer.build
    peer.build = lambda shape, attn: build(shape, "eager" if shape in EAGER_ONLY and attn == "sdpa" else attn)
    sys.argv = [sys.argv[1], *sys.argv[2:]]
    peer.main()


if __name__ == "__main__":
    main()
