"""The sampler against straightforward references: argmax, analytic truncated distributions,
per-row Python penalties, and torch's log_softmax for logprobs."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from corectl.sample import Sampler, SamplingMetadata, compute_prompt_logprobs
from corectl.sample.metadata import UnreadOutputTokens
from corectl.sample.random_sampling import truncate
from corectl.sample.sampler import edit_logits
from corectl.sample.transfer import DeviceTarget
from corectl.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def build(params, *, device=torch.device("cpu"), outputs=None, prompts=None, generators=None, eos=None, vocab=32):
    rows = len(params)
    return SamplingMetadata.build(
        params,
        prompts or [[] for _ in range(rows)],
        outputs or [[] for _ in range(rows)],
        generators or [None] * rows,
        eos,
        vocab,
        DeviceTarget(device, pinned_memory=device.type == "cuda"),
    )


def sample(logits, params, **kwargs):
    """Sample from a copy of `logits` on its own device; returns the output moved to the CPU."""
    meta = build(params, device=logits.device, vocab=logits.shape[1], **kwargs)
    out = Sampler()(logits.clone(), meta)
    return out.sampled_token_ids.cpu(), out.logprobs


def seeded(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_all_greedy_is_a_plain_argmax_and_builds_no_tensors(device):
    logits = randn(6, 1000, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[3])] * 6
    meta = build(params, device=device, outputs=[[1, 2]] * 6, eos=5, vocab=1000)
    assert meta.all_greedy and not meta.edits_logits and meta.max_num_logprobs is None
    tokens, logprobs = sample(logits.to(device), params, outputs=[[1, 2]] * 6, eos=5)
    assert logprobs is None
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_one_is_greedy_even_at_high_temperature(device):
    logits = randn(8, 200, seed=1)
    torch.manual_seed(0)
    for _ in range(20):
        tokens, _ = sample(logits.to(device), [SamplingParams(temperature=50.0, top_k=1)] * 8)
        assert torch.equal(tokens, logits.argmax(dim=-1))


def test_nan_logits_still_give_a_token_of_the_vocabulary(device):
    """A diverged row (NaN logits) must not hand the next step an id no embedding holds."""
    logits = randn(4, 50, seed=2)
    logits[1, 7] = float("nan")
    logits[3] = float("nan")
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=20)):
        for _ in range(10):
            tokens, _ = sample(logits.to(device), [params] * 4)
            assert ((tokens >= 0) & (tokens < 50)).all(), tokens


def _seeded_run(seed: int, position: int, others: list[SamplingParams], steps: torch.Tensor, device) -> list[int]:
    """Tokens a seeded row draws over the steps' logits when sat at `position` among `others`."""
    params = list(others)
    params.insert(position, SamplingParams(temperature=0.9, top_k=20, top_p=0.8, seed=seed))
    generators: list[torch.Generator | None] = [None] * len(params)
    generators[position] = seeded(seed, device)
    tokens = []
    for step, row in enumerate(steps):
        logits = randn(len(params), steps.shape[1], seed=100 * step + len(params))
        logits[position] = row
        sampled, _ = sample(logits.to(device), params, generators=generators)
        tokens.append(int(sampled[position]))
    return tokens


def test_seeded_request_is_reproducible_whatever_the_batch(device):
    steps = randn(8, 64, seed=2, scale=0.5)
    alone = _seeded_run(1234, 0, [], steps, device)
    # Other rows change the candidate count (a top-p row without top-k forces a full sort) and
    # consume the unseeded stream; the seeded row must not notice.
    crowd = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.2, top_k=40, min_p=0.1),
    ]
    torch.manual_seed(7)
    assert _seeded_run(1234, 2, crowd, steps, device) == alone
    torch.manual_seed(8)
    assert _seeded_run(1234, 3, crowd, steps, device) == alone
    assert _seeded_run(4321, 0, [], steps, device) != alone


def _reference_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """vLLM's truncation order, token by token in float64: temperature, top-k, top-p over the
    top-k-renormalised distribution, min-p relative to the most likely token."""
    probs = (logits.double() / p.temperature).softmax(dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[: p.top_k] if p.top_k else order
    mass = sum(probs[t].item() for t in kept)
    nucleus, before = [], 0.0
    for token in kept:
        if before >= p.top_p:
            break
        nucleus.append(token)
        before += probs[token].item() / mass
    floor = p.min_p * probs.max().item()
    result = torch.zeros_like(probs)
    for token in nucleus:
        if probs[token] >= floor:
            result[token] = probs[token]
    return result / result.sum()


_LOGITS_8 = torch.tensor([2.1, 1.6, 1.05, 0.45, 0.1, -0.55, -1.2, -2.3])
_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=0.8, top_p=0.75),
    SamplingParams(temperature=1.0, min_p=0.15),
    SamplingParams(temperature=1.5, top_k=6, top_p=0.8, min_p=0.05),
]


def _assert_matches(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    n = tokens.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts.tolist()}"
    chi2 = (((counts - n * expected) ** 2)[support] / (n * expected[support])).sum().item()
    df = int(support.sum()) - 1
    assert chi2 < df + 5 * math.sqrt(2 * df) + 5, f"chi2 {chi2:.1f} (df {df}): {counts.tolist()} vs {expected.tolist()}"


@pytest.mark.parametrize("params", _CASES, ids=["temperature", "top_k", "top_p", "min_p", "combined"])
def test_empirical_distribution_matches_truncated_reference(params, device):
    expected = _reference_distribution(_LOGITS_8, params)
    torch.manual_seed(0)
    tokens, _ = sample(_LOGITS_8.to(device).expand(20000, -1), [params] * 20000)
    _assert_matches(tokens, expected)


def test_rows_with_different_settings_in_one_batch_keep_their_own_distribution(device):
    params = [_CASES[i % len(_CASES)] for i in range(10000 * len(_CASES))]
    torch.manual_seed(1)
    tokens, _ = sample(_LOGITS_8.to(device).expand(len(params), -1), params)
    for i, case in enumerate(_CASES):
        _assert_matches(tokens[i :: len(_CASES)], _reference_distribution(_LOGITS_8, case))


def test_truncation_ranks_only_the_candidates_it_needs():
    def candidates(*params):
        return build(list(params), vocab=1000).random.num_candidates

    assert candidates(SamplingParams(temperature=1.0), SamplingParams(min_p=0.1)) == 0
    assert candidates(SamplingParams(top_k=5), SamplingParams(top_k=50, top_p=0.9), SamplingParams()) == 50
    assert candidates(SamplingParams(top_k=5), SamplingParams(top_p=0.9)) == 1000


def test_top_p_of_one_keeps_the_whole_vocabulary_beside_a_top_p_row(device):
    # fp32 cumulative mass reaches 1.0 before the far tail; a p of 1 must still keep that tail.
    logits = torch.zeros(2, 64)
    logits[:, 0] = 25.0
    meta = build([SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)], device=device, vocab=64)
    truncated = logits.to(device)
    truncate(truncated, meta.random)
    assert torch.isfinite(truncated[0]).all()
    assert torch.isfinite(truncated[1]).sum() == 1


def _reference_penalties(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    counts = Counter(output)
    seen = set(prompt) | set(output)
    result = []
    for token, x in enumerate(row):
        if token in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * counts[token]
        x -= p.presence_penalty * (counts[token] > 0)
        result.append(x)
    return result


def test_penalties_match_a_per_row_reference(device):
    vocab = 20
    logits = randn(4, vocab, seed=3, scale=3.0)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.8),
        SamplingParams(temperature=0.0, repetition_penalty=0.7, frequency_penalty=-0.4, presence_penalty=1.5),
        SamplingParams(temperature=0.0),
    ]
    prompts = [[1, 2, 2, 9], [3, 4], [5, 5, 6, 0], [1, 2, 3]]
    outputs = [[7, 7, 2], [4, 4, 4, 11, 12], [0, 13, 13, 19], [1, 1, 1]]
    meta = build(params, device=device, prompts=prompts, outputs=outputs, vocab=vocab)
    expected = torch.tensor(
        [_reference_penalties(logits[i].tolist(), params[i], prompts[i], outputs[i]) for i in range(4)]
    )
    torch.testing.assert_close(edit_logits(logits.to(device), meta).cpu(), expected)
    tokens, _ = sample(logits.to(device), params, prompts=prompts, outputs=outputs)
    assert torch.equal(tokens, expected.argmax(dim=-1))


def test_output_tokens_still_on_the_device_count_as_history(device):
    """Async scheduling: the previous step's token joins penalties and min_tokens on the device."""
    vocab, eos = 20, 5
    logits = randn(3, vocab, seed=6, scale=3.0)
    logits[2, eos] = 50.0
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, min_tokens=2),
    ]
    prompts = [[1, 2], [3], [4]]
    known = [[7, 7], [4], [8]]
    unread = UnreadOutputTokens([0, 2], torch.tensor([9, 1], device=device))
    with_unread = SamplingMetadata.build(params, prompts, known, [None] * 3, eos, vocab, DeviceTarget(device),
                                          unread=unread)
    whole = build(params, device=device, prompts=prompts, outputs=[[7, 7, 9], [4], [8, 1]], eos=eos, vocab=vocab)
    torch.testing.assert_close(edit_logits(logits.to(device), with_unread).cpu(),
                               edit_logits(logits.to(device), whole).cpu())
    # Two outputs, one of them unread, satisfy min_tokens=2: EOS is allowed again.
    assert Sampler()(logits.to(device), with_unread).sampled_token_ids.tolist()[2] == eos


def test_logit_bias_is_added_and_steers_greedy(device):
    logits = randn(2, 32, seed=4)
    params = [SamplingParams(temperature=0.0, logit_bias={5: 50.0, 6: -3.0}), SamplingParams(temperature=0.0)]
    expected = logits.clone()
    expected[0, 5] += 50.0
    expected[0, 6] -= 3.0
    torch.testing.assert_close(edit_logits(logits.to(device), build(params, device=device)).cpu(), expected)
    tokens, _ = sample(logits.to(device), params)
    assert tokens.tolist() == [5, int(logits[1].argmax())]


def test_min_tokens_suppresses_eos_and_stop_token_ids(device):
    eos, stop = 5, 7
    logits = torch.zeros(1, 32)
    logits[0, eos], logits[0, stop], logits[0, 11] = 3.0, 2.0, 1.0
    logits = logits.to(device)
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])]
    assert sample(logits, params, outputs=[[1]], eos=eos)[0].tolist() == [11]
    assert sample(logits, params, outputs=[[1, 2, 3]], eos=eos)[0].tolist() == [eos]
    edited = edit_logits(logits.clone(), build(params, device=device, outputs=[[1, 2]], eos=eos))
    assert torch.isinf(edited[0]).nonzero().flatten().tolist() == [eos, stop]
    # An ignored EOS cannot end the request, so min_tokens leaves it alone (vLLM's rule).
    ignoring = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)]
    assert sample(logits, ignoring, outputs=[[1]], eos=eos)[0].tolist() == [eos]


def test_logprobs_ranks_and_top_k_come_from_the_raw_logits(device):
    logits = randn(3, 50, seed=5, scale=2.0)
    params = [
        SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=2.0),
        SamplingParams(temperature=1.5, top_k=10, logprobs=3, seed=9),
        SamplingParams(temperature=0.8, presence_penalty=1.0),
    ]
    generators = [None, seeded(9, device), None]
    chosen, lp = sample(
        logits.to(device), params, prompts=[[0, 1, 2]] * 3, outputs=[[3, 4]] * 3, generators=generators
    )
    reference = logits.log_softmax(dim=-1)
    lists = lp.to_lists([0, 3, 0])
    assert lp.token_ids.shape == (3, 4) and lp.logprobs.shape == (3, 4)
    assert [row[0] for row in lists.token_ids] == chosen.tolist()
    torch.testing.assert_close(lp.logprobs[:, 0].cpu(), reference.gather(1, chosen[:, None]).squeeze(1))
    top = reference.topk(3, dim=-1)
    assert lists.token_ids[1][1:] == top.indices[1].tolist()
    torch.testing.assert_close(lp.logprobs[:, 1:].cpu(), top.values)
    ranks = [1 + int((reference[i] > reference[i, chosen[i]]).sum()) for i in range(3)]
    assert lists.ranks == ranks
    assert [len(row) for row in lists.token_ids] == [1, 4, 1]
    assert [len(row) for row in lists.logprobs] == [1, 4, 1]


def _processed_reference(logits: torch.Tensor) -> torch.Tensor:
    """The logits each row of `_MODE_PARAMS` samples from, by hand: row 0 greedy with a repetition
    penalty over its history [0..4]; row 1 tempered by 1.5 and cut to its 10 best; row 2 tempered by 0.8."""
    expected = logits.clone()
    seen = torch.tensor([0, 1, 2, 3, 4])
    row = expected[0, seen]
    expected[0, seen] = torch.where(row > 0, row / 2.0, row * 2.0)
    expected[1] /= 1.5
    expected[1, expected[1] < expected[1].topk(10).values[-1]] = float("-inf")
    expected[2] /= 0.8
    return expected


_MODE_PARAMS = [
    SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=2.0),
    SamplingParams(temperature=1.5, top_k=10, logprobs=3, seed=9),
    SamplingParams(temperature=0.8, logprobs=2),
]


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_report_raw_or_processed_values(mode, device):
    logits = randn(3, 50, seed=5, scale=2.0)
    meta = build(_MODE_PARAMS, device=device, prompts=[[0, 1, 2]] * 3, outputs=[[3, 4]] * 3,
                 generators=[None, seeded(9, device), seeded(4, device)], vocab=50)
    out = Sampler(logprobs_mode=mode)(logits.clone().to(device), meta)
    chosen = out.sampled_token_ids.cpu()
    values = logits if mode.startswith("raw_") else _processed_reference(logits)
    expected = values.log_softmax(dim=-1) if mode.endswith("_logprobs") else values
    lists = out.logprobs.to_lists([0, 3, 2])
    torch.testing.assert_close(torch.tensor([row[0] for row in lists.logprobs]),
                               expected.gather(1, chosen[:, None]).squeeze(1))
    top = expected.topk(3, dim=-1)
    assert lists.token_ids[1][1:] == top.indices[1].tolist()
    torch.testing.assert_close(torch.tensor(lists.logprobs[1][1:]), top.values[1])
    if mode.startswith("processed_"):
        assert torch.isinf(expected[1]).sum() == 40  # top-k's cut shows as -inf in what is reported
    assert lists.ranks == [1 + int((expected[i] > expected[i, chosen[i]]).sum()) for i in range(3)]


def test_an_unknown_logprobs_mode_is_refused():
    with pytest.raises(ValueError, match="logprobs mode"):
        Sampler(logprobs_mode="logits")


def test_prompt_logprobs_match_log_softmax(device):
    logits = randn(5, 30, seed=6)
    targets = torch.tensor([3, 0, 29, 7, 7])
    result = compute_prompt_logprobs(logits.to(device), targets.to(device), 2)
    reference = logits.log_softmax(dim=-1)
    torch.testing.assert_close(result.logprobs[:, 0].cpu(), reference[torch.arange(5), targets])
    assert torch.equal(result.token_ids[:, 1:].cpu(), reference.topk(2, dim=-1).indices)
    ranks = [1 + int((reference[i] > reference[i, t]).sum()) for i, t in enumerate(targets)]
    assert result.ranks.tolist() == ranks


def test_mixed_batch_keeps_greedy_rows_exact_and_random_rows_in_their_top_k(device):
    logits = randn(6, 40, seed=7, scale=0.3)
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0, top_k=3)
              for i in range(6)]
    allowed = logits.topk(3, dim=-1).indices
    torch.manual_seed(3)
    off_argmax = 0
    for _ in range(30):
        tokens, _ = sample(logits.to(device), params)
        assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))
        for row in range(1, 6, 2):
            assert tokens[row] in allowed[row]
        off_argmax += int((tokens[1::2] != logits[1::2].argmax(dim=-1)).sum())
    assert off_argmax > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist only with an asynchronous device")
def test_a_full_featured_step_never_waits_for_the_device():
    device = torch.device("cuda")
    params = [
        SamplingParams(temperature=0.0, logit_bias={1: 2.0}, logprobs=2),
        SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05, seed=3, repetition_penalty=1.2),
        SamplingParams(temperature=1.1, top_p=0.7, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4),
    ]
    logits = randn(3, 64, seed=8).to(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = build(
            params, device=device, prompts=[[1, 2]] * 3, outputs=[[3]] * 3,
            generators=[None, seeded(3, device), None], eos=0, vocab=64,
        )
        out = Sampler()(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.shape == (3,) and out.logprobs.token_ids.shape == (3, 3)
