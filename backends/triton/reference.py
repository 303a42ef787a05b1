"""Plain torch references for the Triton kernels: the specification tests compare against.

Written for clarity, not speed: per-sequence loops, fp32 math. Each returns a new tensor and
leaves its inputs untouched.
"""
from __future__ import annotations

import torch


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The cache after writing k, v `[T, Hk * D]` at `slot_mapping` (slot -1 = skip); an FP8 cache
    gets k / k_scale and v / v_scale saturated at +-448, e4m3's largest finite value."""
    result = kv_cache.clone()
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = result.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if kv_cache.dtype == torch.float8_e4m3fn:
        k = (k.float() / k_scale).clamp(-448.0, 448.0)
        v = (v.float() / v_scale).clamp(-448.0, 448.0)
    flat[0, slots] = k[keep].view(-1, num_kv_heads, head_dim).to(kv_cache.dtype)
    flat[1, slots] = v[keep].view(-1, num_kv_heads, head_dim).to(kv_cache.dtype)
    return result


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [seq_len, Hk, D] of one sequence, read through its block table."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_table.long()[positions // block_size]
    offsets = positions % block_size
    return kv_cache[0, blocks, offsets], kv_cache[1, blocks, offsets]


def causal_attention_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, *,
                         sliding_window: int | None = None, logits_soft_cap: float | None = None,
                         sinks: torch.Tensor | None = None, attention_chunk: int | None = None,
                         bidirectional_spans: list[tuple[int, int]] = ()) -> torch.Tensor:
    """q [Lq, Hq, D] are the last Lq positions of a context keys/values [L, Hk, D]; returns fp32 [Lq, Hq, D].

    The query at position p sees keys j with p - sliding_window < j <= p (all j <= p without a
    window); `logits_soft_cap` c turns each score s into c * tanh(s / c) before the mask (Gemma 2);
    `sinks` [Hq] add exp(sinks[h]) to head h's softmax denominator (gpt-oss), as transformers does:
    a column of sink logits joins the scores and is dropped after the softmax; `attention_chunk` C
    keeps the query at p to keys C * (p // C) <= j <= p (Llama 4's chunked local layers);
    `bidirectional_spans` [start, end): queries and keys of one span see each other both ways (an
    image's tokens in Gemma 3), within the window as transformers composes them.
    """
    query_len, num_heads, _ = q.shape
    context = keys.shape[0]
    group = num_heads // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    q_pos = torch.arange(context - query_len, context, device=q.device)[:, None]
    k_pos = torch.arange(context, device=q.device)[None, :]
    visible = k_pos <= q_pos
    for start, end in bidirectional_spans:
        visible |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    if attention_chunk is not None:
        visible &= k_pos >= q_pos // attention_chunk * attention_chunk
    # Only the visible keys enter the products: a key outside every window may hold anything
    # (its block may be back in the pool), even NaN.
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float()[:, None, None].expand(num_heads, query_len, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v.masked_fill(~visible.any(0)[:, None, None], 0.0))


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                        sliding_window: int | None = None, logits_soft_cap: float | None = None,
                        k_scale: float = 1.0, v_scale: float = 1.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed queries q [T, Hq * D] over each sequence's paged context
    (windows, soft-capping and sinks as in `causal_attention_ref`); the cached keys and values count as
    k_scale and v_scale times what the cache holds (an FP8 cache's scales)."""
    head_dim = kv_cache.shape[4]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        keys, values = gather_context(kv_cache, block_tables[i], seq_len)
        keys, values = keys.float() * k_scale, values.float() * v_scale
        q_i = q[lo:hi].view(hi - lo, -1, head_dim)
        attended = causal_attention_ref(q_i, keys, values, scale, sliding_window=sliding_window,
                                        logits_soft_cap=logits_soft_cap, sinks=sinks)
        out[lo:hi] = attended.reshape(hi - lo, -1).to(q.dtype)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """Hugging Face Llama's RMSNorm; with `residual`: (norm(x + residual), x + residual)."""
    if residual is not None:
        residual = x + residual
        x = residual
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return out if residual is None else (out, residual)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:] in x's dtype, as Hugging Face's MLP computes it."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation (HF `x * cos + rotate_half(x) * sin`) of the first rot_dim dims of
    q [T, Hq, D] and k [T, Hk, D], in fp32; returns rotated copies in the input dtype."""
    rot_dim = cos_cache.shape[1]
    cos = cos_cache[positions].float().unsqueeze(1)
    sin = sin_cache[positions].float().unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        head, tail = x[..., :rot_dim], x[..., rot_dim:]
        half = rot_dim // 2
        rotated_half = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
        return torch.cat((head * cos + rotated_half * sin, tail), dim=-1)

    return rotate(q).to(q.dtype), rotate(k).to(k.dtype)


def align_to_experts_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What moe_align.align_to_experts returns: the pairs (token * k + slot) of each expert in
    order, each expert's run padded to whole `block_m` blocks with the value T * k; each block's
    expert (the last expert past the rows in use); the rows in use."""
    flat = topk_ids.flatten().tolist()
    num_pairs = len(flat)
    capacity = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32)
    block_expert = torch.full((capacity // block_m,), num_experts - 1, dtype=torch.int32)
    row = 0
    for expert in range(num_experts):
        pairs = [p for p, e in enumerate(flat) if e == expert]
        blocks = -(-len(pairs) // block_m)
        sorted_pairs[row:row + len(pairs)] = torch.tensor(pairs, dtype=torch.int32)
        block_expert[row // block_m:row // block_m + blocks] = expert
        row += blocks * block_m
    return sorted_pairs, block_expert, torch.tensor([row], dtype=torch.int32)
