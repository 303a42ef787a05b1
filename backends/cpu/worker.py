"""CPU worker: thread count, an exactly-int8 head served as int8 groups, prepacked linear weights, the
fused C layer kernels of fp32 models (fused_ops.py) and a KV cache sized from a memory budget in GiB."""
from __future__ import annotations

import torch
from corectl.errors import ConfigError
from corectl.kv.sizing import DEFAULT_KV_CACHE_BYTES, blocks_per_sequence, fixed_kv_blocks
from corectl.models.kernels import LayerKernels
from corectl.worker.worker import ModelInfo, Worker

from .fused_layer import cpu_layer_kernels
from .int8_head import serve_int8_head
from .prepack import prepack_linears


class CPUWorker(Worker):
    def init_device(self) -> torch.device:
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        return torch.device("cpu")

    def load_model(self) -> ModelInfo:
        info = super().load_model()
        models = [self.runner.model] + ([self.runner.drafter.runner.model] if self.runner.drafter is not None else [])
        for model in models:
            serve_int8_head(model)
            prepack_linears(model, self.torch_dtype)
        return info

    def layer_kernels(self) -> LayerKernels | None:
        return cpu_layer_kernels(self.torch_dtype)

    def profile_num_kv_blocks(self) -> int:
        budget = self.config.kv_cache_budget_bytes or DEFAULT_KV_CACHE_BYTES
        per_block = self.kv_block_bytes()
        num_blocks = fixed_kv_blocks(budget, per_block)
        needed = blocks_per_sequence(self.max_model_len, self.config.block_size, self.model_info.sliding_window,
                                     self.config.max_num_batched_tokens)
        if num_blocks < needed:
            raise ConfigError(
                self.config.kv_cache_budget_field,
                f"{budget / (1 << 30):.3f} GiB holds {num_blocks * self.config.block_size} tokens, fewer than one "
                f"sequence of max_model_len={self.max_model_len}; raise it to at least "
                f"{needed * per_block / (1 << 30):.3f} GiB ({needed * per_block} bytes) or lower max_model_len",
            )
        return num_blocks
