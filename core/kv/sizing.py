"""How many KV blocks fit: the rules the workers apply at startup and `corectl plan` applies ahead
of it (`corectl.planning`), kept in one place so a plan and the engine it describes agree."""
from __future__ import annotations

# The KV budget (2 GiB) of a platform that does not profile memory (CPU) when none is given
# (`EngineConfig.kv_cache_budget_bytes`).
DEFAULT_KV_CACHE_BYTES = 2 << 30


def blocks_per_sequence(max_model_len: int, block_size: int, sliding_window: int | None = None,
                        chunk_tokens: int = 1) -> int:
    """Blocks one sequence of `max_model_len` tokens holds at most; fewer and the engine refuses to start.

    With a `sliding_window` on every layer the KV manager returns the blocks before the window, so
    a sequence computing `chunk_tokens` at a time (1 while it decodes, up to the step's token
    budget while it prefills) holds the blocks its window and the chunk straddle.
    """
    full = -(-max_model_len // block_size)
    if sliding_window is None:
        return full
    return min(full, -(-(sliding_window + chunk_tokens - 2) // block_size) + 1)


def fixed_kv_blocks(budget_bytes: int, bytes_per_block: int) -> int:
    """Blocks in a KV budget given in bytes (`EngineConfig.kv_cache_budget_bytes`)."""
    return budget_bytes // bytes_per_block


def profiled_kv_blocks(total_bytes: float, utilization: float, peak_bytes: float, non_torch_bytes: float,
                       bytes_per_block: int, reserved_bytes: float = 0) -> int:
    """Blocks left within `utilization` of the device once the weights and a worst-case step's
    activations (`peak_bytes`), the memory torch does not manage and `reserved_bytes` (what fills
    later outside the KV cache: a vision-language model's encoder cache) are taken; negative when
    even those do not fit."""
    budget = total_bytes * utilization - peak_bytes - max(non_torch_bytes, 0) - reserved_bytes
    return int(budget // bytes_per_block)


def profile_num_seqs(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> int:
    """Sequences of the memory-profiling step: a full batch, but enough that none is longer than the
    model's context (its rotary table)."""
    return max(min(max_num_seqs, max_num_batched_tokens), -(-max_num_batched_tokens // max_model_len))
