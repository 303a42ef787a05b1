"""The CPU backend's fast paths against the torch code they replace: prepacked linears equal to
F.linear, paged decode attention equal to dense SDPA, the CPU draw never picking a masked token."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from corectl.attention import AttentionBatch
from corectl.backends.cpu.attention import TorchSDPABackend
from corectl.backends.cpu.platform import CPUPlatform
from corectl.backends.cpu.prepack import PrepackedLinear, can_prepack
from corectl.sample.random_sampling import RandomParams, sample_random
from corectl.sample.transfer import DeviceTarget
from corectl.sampling_params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prepacked_linear_matches_f_linear(dtype):
    if not can_prepack(dtype):
        pytest.skip("oneDNN cannot pack this dtype here")
    linear = torch.nn.Linear(64, 48, bias=True).to(dtype)
    packed = PrepackedLinear(linear)
    for rows in (1, 7):
        x = _rand(rows, 64, dtype=dtype, seed=rows)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5 if dtype == torch.float32 else 0, atol=1e-5)


def _decode_batch(seq_lens, block_size, blocks_per_seq):
    b = len(seq_lens)
    block_tables = torch.arange(b * blocks_per_seq, dtype=torch.int32).flip(0).view(b, blocks_per_seq)
    slots = torch.tensor([int(block_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(seq_lens)])
    return AttentionBatch(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables, slot_mapping=slots, query_lens_host=[1] * b, seq_lens_host=list(seq_lens),
        max_query_len=1, max_seq_len=max(seq_lens), block_size=block_size,
    )


@pytest.mark.parametrize("seq_lens", [[7], [9, 3, 12]])
def test_paged_decode_attention_matches_dense_sdpa(seq_lens):
    h, hk, d, bs = 6, 2, 8, 4
    backend = TorchSDPABackend(h, hk, d, torch.float32, torch.device("cpu"), bs)
    batch = _decode_batch(seq_lens, bs, 4)
    cache = torch.zeros(backend.kv_cache_shape(16, bs, hk, d))
    dense_k = [_rand(n, hk, d, dtype=torch.float32, seed=20 + i) for i, n in enumerate(seq_lens)]
    dense_v = [_rand(n, hk, d, dtype=torch.float32, seed=40 + i) for i, n in enumerate(seq_lens)]
    for i, n in enumerate(seq_lens):
        for pos in range(n - 1):
            slot = int(batch.block_tables[i, pos // bs]) * bs + pos % bs
            cache[0].view(-1, hk, d)[slot], cache[1].view(-1, hk, d)[slot] = dense_k[i][pos], dense_v[i][pos]
    q = _rand(len(seq_lens), h * d, dtype=torch.float32, seed=60)
    k = torch.stack([kk[-1] for kk in dense_k]).view(len(seq_lens), -1)
    v = torch.stack([vv[-1] for vv in dense_v]).view(len(seq_lens), -1)
    out = backend.forward(q, k, v, cache, backend.build_metadata(batch), d ** -0.5)
    for i in range(len(seq_lens)):
        ref = F.scaled_dot_product_attention(q[i].view(1, h, 1, d), dense_k[i].transpose(0, 1)[None],
                                             dense_v[i].transpose(0, 1)[None], scale=d ** -0.5, enable_gqa=True)
        torch.testing.assert_close(out[i], ref.reshape(-1), rtol=1e-5, atol=1e-5)


def test_cpu_draw_never_picks_a_masked_token():
    caps = CPUPlatform().capabilities()
    assert caps.sampling_draw == "inverse_cdf" and not caps.pinned_memory
    logits = torch.full((4, 1000), float("-inf"))
    logits[:, 3], logits[:, 997] = 0.0, -30.0
    params = RandomParams.build([SamplingParams(temperature=1.0)] * 4, [False] * 4, [None] * 4, 1000,
                                DeviceTarget(torch.device("cpu")))
    torch.manual_seed(0)
    for _ in range(50):
        assert set(sample_random(logits.clone(), params, caps.sampling_draw).tolist()) <= {3, 997}
