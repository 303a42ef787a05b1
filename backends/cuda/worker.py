"""CUDA worker: KV cache sized by profiling peak memory, decode CUDA graphs captured at warm-up."""
from __future__ import annotations

import logging

import torch
from corectl.envs import graph_verify_enabled, piecewise_graphs_enabled
from corectl.errors import ConfigError
from corectl.kv.sizing import blocks_per_sequence, profile_num_seqs, profiled_kv_blocks
from corectl.models.kernels import LayerKernels
from corectl.multimodal.budget import ENCODER_CACHE_ROWS
from corectl.sample.random_sampling import RaceKernel
from corectl.worker.worker import ModelInfo, Worker

from ..triton.layer_kernels import batch_invariant_layer_kernels, triton_layer_kernels
from ..triton.race_draw import race_draw
from .batch_invariant import check_invariant_quantization, make_runner_invariant
from .graph_runner import CUDAGraphModelRunner, graph_batch_sizes
from .piecewise import piecewise_token_counts

logger = logging.getLogger("corectl.cuda")


# An explicit KV budget past this share of what the device has left draws a warning.
_BUDGET_HEADROOM = 0.95


class CUDAWorker(Worker):
    runner_cls = CUDAGraphModelRunner

    def init_device(self) -> torch.device:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        # e4m3fn conversions: NVIDIA from Ada/Hopper on (ROCm's MI300 uses the e4m3fnuz variant, not done).
        if self.config.kv_cache_dtype != "auto" and (
                torch.version.hip is not None or torch.cuda.get_device_capability(device) < (8, 9)):
            raise ConfigError("kv_cache_dtype", "an FP8 KV cache needs an NVIDIA GPU with FP8 conversions (compute "
                              f"capability 8.9 or newer: Ada, Hopper); {torch.cuda.get_device_name(device)} has "
                              "none here: use --kv-cache-dtype auto")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return device

    def profile_num_kv_blocks(self) -> int:
        """Memory left for the KV cache after weights, a worst-case step's activations (a
        vision-language model's: with its largest encoder batch), non-torch allocations and the
        encoder cache, within `gpu_memory_utilization` of the device; or the explicit budget
        (`--kv-cache-memory-bytes`, `--kv-cache-memory`) where it fits."""
        cfg = self.config
        peak, reserved = self._profile_peak()
        free, total = torch.cuda.mem_get_info()
        non_torch = (total - free) - torch.cuda.memory_reserved()
        per_block = self.kv_block_bytes()
        num_blocks = profiled_kv_blocks(total, cfg.gpu_memory_utilization, peak, non_torch, per_block, reserved)
        window = self.model_info.sliding_window
        needed = blocks_per_sequence(self.max_model_len, cfg.block_size, window, cfg.max_num_batched_tokens)
        if cfg.kv_cache_budget_bytes is not None:
            num_blocks = self._budget_blocks(total, peak, non_torch, reserved, per_block, needed)
        elif num_blocks < needed:
            raise ConfigError(
                "gpu_memory_utilization",
                f"the model needs {(peak + reserved) / 2**30:.2f} GiB for weights, activations and its encoder "
                f"cache, leaving room for "
                f"{max(num_blocks, 0) * cfg.block_size} KV tokens of the {self.max_model_len} one sequence "
                f"needs on this {total / 2**30:.1f} GiB device; raise gpu_memory_utilization, lower "
                "max_model_len or max_num_batched_tokens, or use a smaller model",
            )
        tokens = num_blocks * cfg.block_size
        concurrency, note = tokens / self.max_model_len, ""
        if window is not None:
            # A decoding sequence holds only its window's blocks: the others go back to the pool.
            per_seq = blocks_per_sequence(self.max_model_len, cfg.block_size, window)
            concurrency = num_blocks / per_seq
            note = f" (sliding window of {window} tokens on every layer: {per_seq} blocks per sequence)"
        logger.info("KV cache: %d blocks = %d tokens (%.2f GiB); max concurrency at %d tokens: %.1fx%s",
                    num_blocks, tokens, num_blocks * per_block / 2**30, self.max_model_len, concurrency, note)
        return num_blocks

    def _budget_blocks(self, total: int, peak: int, non_torch: int, reserved: int, per_block: int, needed: int) -> int:
        """The blocks of an explicit KV budget (`kv_cache_budget_bytes`, which sets aside
        `gpu_memory_utilization`), refused when it holds less than one sequence or more than the
        device has left after the weights and a worst-case step."""
        cfg = self.config
        budget, field = cfg.kv_cache_budget_bytes, cfg.kv_cache_budget_field
        room = profiled_kv_blocks(total, 1.0, peak, non_torch, per_block, reserved)
        num_blocks = budget // per_block
        if num_blocks < needed:
            raise ConfigError(field, f"{budget / 2**30:.3f} GiB holds {num_blocks * cfg.block_size} KV tokens, fewer "
                              f"than one sequence of max_model_len={self.max_model_len} ({needed * per_block} bytes)")
        if num_blocks > room:
            raise ConfigError(field, f"{budget / 2**30:.3f} GiB of KV cache does not fit: the weights, a worst-case "
                              f"step and other allocations leave {max(room, 0) * per_block / 2**30:.3f} GiB of this "
                              f"{total / 2**30:.1f} GiB device")
        if num_blocks > _BUDGET_HEADROOM * room:
            logger.warning("%s leaves %.2f GiB of this device free; CUDA graphs and the sampler's buffers may not "
                           "fit in it", field, (room - num_blocks) * per_block / 2**30)
        return num_blocks

    def _profile_peak(self) -> tuple[int, int]:
        """(peak bytes of the weights and a worst-case step, bytes reserved for the encoder cache).
        The step: dummy prefills over the whole token budget, run inside a vision-language model's
        worst-case encoding so that the tower's outputs stay alive meanwhile, as in a real step."""
        cfg = self.config
        num_seqs = profile_num_seqs(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len)
        per_seq_blocks = -(-max(1, cfg.max_num_batched_tokens // num_seqs) // cfg.block_size)
        self.init_kv_cache(num_seqs * per_seq_blocks)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with self.worst_case_encoding() as encoded:
            torch.cuda.synchronize()
            reserved = 0
            if encoded is not None:
                reserved = encoded.cache_bytes
                logger.info("Vision tower: %d images, %d encoder rows (the most one step encodes): %.2f GiB of "
                            "activations and outputs in the profile; encoder cache: %d rows, %.2f GiB reserved "
                            "outside the KV cache", len(encoded.images), encoded.rows,
                            (torch.cuda.max_memory_allocated() - before) / 2**30, ENCODER_CACHE_ROWS,
                            reserved / 2**30)
            self.run_dummy_step(cfg.max_num_batched_tokens, num_seqs)
            torch.cuda.synchronize()
        profile_cache_bytes = sum(c.numel() * c.element_size() for c in self.runner.kv_caches)
        peak = torch.cuda.max_memory_allocated() - profile_cache_bytes
        self.runner.set_kv_caches([])
        torch.cuda.empty_cache()
        return peak, reserved

    def quantization_kernels(self) -> dict:
        from ..triton.gemm.fp8_block import fp8_block_w8a16
        from ..triton.gemm.fp8_gemv import fp8_w8a16_gemv
        from ..triton.gemm.fp8_quant import quantize_rows_fp8
        from ..triton.gemm.w4a16 import w4a16_gemm_trusted
        from ..triton.gemm.w8a16 import w8a16_gemm
        from ..triton.moe.mxfp4_moe import routed_mxfp4_moe

        return {"w4a16": w4a16_gemm_trusted, "w8a16": w8a16_gemm, "fp8_quantize_rows": quantize_rows_fp8,
                "fp8_w8a16_gemv": fp8_w8a16_gemv, "fp8_block_w8a16": fp8_block_w8a16, "mxfp4_moe": routed_mxfp4_moe}

    def load_model(self) -> ModelInfo:
        if self.config.batch_invariant:
            check_invariant_quantization(self.quantization)
        info = super().load_model()
        if self.config.batch_invariant:
            make_runner_invariant(self.runner)
        return info

    def layer_kernels(self) -> LayerKernels:
        return batch_invariant_layer_kernels() if self.config.batch_invariant else triton_layer_kernels()

    def race_kernel(self) -> RaceKernel:
        return race_draw

    def warmup(self) -> None:
        """Compile the kernels' variants before the first request, then capture decode graphs.

        The profiling step compiled the prefill path for one tile size (`prefill_block_m`); short
        queries (a few tokens per sequence, mixed steps) and long ones use the other. Each Triton
        compile takes about a second, which the first request needing it would otherwise wait.
        """
        for num_tokens, num_seqs in warmup_prefill_shapes(self.config.max_num_batched_tokens, self.max_model_len):
            self.run_dummy_step(num_tokens, num_seqs)
        # The dummy steps are greedy: compile the random rows' draw too, before a request waits on it.
        self.runner.sampler.race(torch.zeros(1, self.runner.vocab_size, device=self.device))
        torch.cuda.synchronize()
        cfg, graphs = self.config, self.config.compilation_config
        if cfg.enforce_eager or graphs.cudagraph_mode == "NONE":
            return
        spec = cfg.speculative_config
        # Verify steps of k + 1 rows a request replay the graphs only when asked (see graph_runner).
        rows_per_seq = 1 + spec.num_speculative_tokens if spec is not None and graph_verify_enabled() else 1
        decode = graphs.sizes(cfg.max_num_seqs, graph_batch_sizes(cfg.max_num_seqs)) if graphs.decode_graphs else []
        pieces = (graphs.sizes(cfg.max_num_batched_tokens, piecewise_token_counts(cfg.max_num_batched_tokens))
                  if graphs.piecewise_graphs and piecewise_graphs_enabled() else [])
        self.runner.capture_graphs(self.max_model_len, decode, rows_per_seq, pieces)


def warmup_prefill_shapes(max_num_batched_tokens: int, max_model_len: int) -> list[tuple[int, int]]:
    """(tokens, sequences) of the warm-up steps: 2-token queries (small prefill tiles) and one long
    query (large tiles), within the step's token budget and the KV cache (which holds at least
    one max_model_len sequence, and the steps use blocks from its start)."""
    short = min(8, max_num_batched_tokens, max_model_len)
    return [(short, max(1, short // 2)), (min(512, max_num_batched_tokens, max_model_len), 1)]
