"""Rejection sampling against what sampling from the target alone gives: chi-square tests over
many independent requests verified in one call, n-gram (one-hot) and sampled drafts, greedy rows
and seeded reproducibility."""
from __future__ import annotations

import pytest
import torch
from corectl.sample import Sampler, SamplingMetadata
from corectl.sample.random_sampling import DRAWS
from corectl.sample.transfer import DeviceTarget
from corectl.sampling_params import SamplingParams
from corectl.spec_decode.rejection import VerifyLayout, rejection_sample
from corectl.spec_decode.verify import expand_rows, verify
from support.spec_decode import chi_square_p_value

CPU = DeviceTarget(torch.device("cpu"))
# Target logits of positions 0, 1 and 2 (the bonus position); independent of the prefix here,
# so the k-th emitted token must be distributed as softmax(row k) whatever came before it.
TARGET = torch.tensor([[1.2, 0.3, -0.4, 0.9, -1.5, 0.0],
                       [-0.2, 1.1, 0.4, -0.8, 0.6, 0.1],
                       [0.5, -0.5, 1.4, 0.2, -0.3, 0.7]])
N = 12000


def _run(drafts: list[list[int]], draft_probs: torch.Tensor | None = None, seed: int = 0):
    k = len(drafts[0])
    layout = VerifyLayout.build(drafts, CPU)
    logits = TARGET[: k + 1].repeat(len(drafts), 1)
    torch.manual_seed(seed)
    out = rejection_sample(logits, layout, greedy_rows=None, all_greedy=False, generators={}, draw="inverse_cdf",
                           draft_probs=draft_probs)
    return out.token_ids, out.num_emitted


def _check_positions(tokens: torch.Tensor, emitted: torch.Tensor, k: int) -> None:
    for position in range(k + 1):
        reached = emitted > position
        assert reached.sum() > 1000, "too few samples reach this position for a meaningful test"
        p = chi_square_p_value(tokens[reached, position], TARGET[position].softmax(dim=-1))
        assert p > 1e-4, f"position {position}: chi-square p-value {p:.2e}"


def test_ngram_drafts_leave_the_target_distribution_unchanged():
    tokens, emitted = _run([[0, 1]] * N)
    _check_positions(tokens, emitted, 2)
    # Acceptance of an n-gram draft is the target's probability of it.
    accepted_first = (emitted > 1).double().mean().item()
    assert abs(accepted_first - TARGET[0].softmax(-1)[0].item()) < 0.02


def test_sampled_drafts_leave_the_target_distribution_unchanged():
    q_logits = torch.tensor([[0.0, 1.0, 0.5, -0.5, 0.2, 0.8], [1.0, 0.0, -0.3, 0.4, 0.9, -1.0]])
    q = q_logits.softmax(dim=-1)
    gen = torch.Generator().manual_seed(3)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(2)], dim=1)
    draft_probs = torch.cat([q, torch.zeros(1, 6)]).repeat(N, 1)
    tokens, emitted = _run(drafts.tolist(), draft_probs)
    _check_positions(tokens, emitted, 2)


def test_a_rejected_row_never_returns_its_draft_and_emission_stops_there():
    tokens, emitted = _run([[3, 3]] * 4000, seed=5)
    rejected_first = emitted == 1
    assert rejected_first.any()
    assert (tokens[rejected_first, 0] != 3).all()


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    drafts = [[0, 1], [0, 4], [5, 1], []]
    layout = VerifyLayout.build(drafts, CPU)
    logits = torch.cat([TARGET, TARGET, TARGET, TARGET[:1]])
    out = rejection_sample(logits, layout, greedy_rows=None, all_greedy=True, generators={}, draw="inverse_cdf")
    # argmax of the rows: 0, 1, 2
    assert out.num_emitted.tolist() == [3, 2, 1, 1]
    assert out.token_ids[0].tolist() == [0, 1, 2]
    assert out.token_ids[1, :2].tolist() == [0, 1]
    assert out.token_ids[2, 0].item() == 0 and out.token_ids[3, 0].item() == 0


def _verify_seeded(seed: int, drafts: list[list[int]], batch_noise: int) -> list[list[int]]:
    """A seeded request verified beside `batch_noise` unseeded ones, through the sampler's processing."""
    params = [SamplingParams(temperature=1.0, top_k=4, seed=seed)] + [SamplingParams(temperature=0.9)] * batch_noise
    # One generator per verified position of the seeded request (its rows draw from their own).
    gens = [[torch.Generator().manual_seed(seed + j) for j in range(len(drafts[0]) + 1)]] + [None] * batch_noise
    all_drafts = drafts + [[1, 2]] * batch_noise
    rows = expand_rows(params, [()] * len(params), [()] * len(params), gens, all_drafts)
    meta = SamplingMetadata.build(rows.params, rows.prompt_token_ids, rows.output_token_ids, rows.generators,
                                  None, 6, CPU)
    logits = torch.cat([TARGET] * len(params))
    verified, _ = verify(logits, meta, VerifyLayout.build(all_drafts, CPU), Sampler("inverse_cdf"))
    return verified.token_ids[0, : verified.num_emitted[0]].tolist()


def test_a_seeded_request_verifies_the_same_whatever_the_batch():
    runs = {tuple(_verify_seeded(11, [[0, 1]], noise)) for noise in (0, 3, 7)}
    assert len(runs) == 1


def test_top_k_applies_to_the_target_before_verification():
    # top_k=1 makes every row greedy in effect: a draft that is not the argmax is always rejected.
    params = [SamplingParams(temperature=1.0, top_k=1)] * 200
    drafts = [[3, 1]] * 200
    rows = expand_rows(params, [()] * 200, [()] * 200, [None] * 200, drafts)
    meta = SamplingMetadata.build(rows.params, rows.prompt_token_ids, rows.output_token_ids, rows.generators,
                                  None, 6, CPU)
    verified, _ = verify(TARGET.repeat(200, 1), meta, VerifyLayout.build(drafts, CPU), Sampler("inverse_cdf"))
    assert verified.num_emitted.eq(1).all() and verified.token_ids[:, 0].eq(0).all()


@pytest.mark.parametrize("draw", DRAWS)
def test_a_seeded_request_without_drafts_draws_as_plain_sampling_does(draw):
    # Its one (bonus) row in a verify step, beside a request with drafts, against the plain sampler.
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    plain, verified = [], []
    for position in range(20):
        meta = SamplingMetadata.build([params], [()], [()], [torch.Generator().manual_seed(position)], None, 6, CPU)
        plain.append(Sampler(draw)(TARGET[2:].clone(), meta).sampled_token_ids.item())
        rows = expand_rows([params, SamplingParams(temperature=1.0)], [(), ()], [(), ()],
                           [[torch.Generator().manual_seed(position)], None], [[], [0, 1]])
        meta = SamplingMetadata.build(rows.params, rows.prompt_token_ids, rows.output_token_ids, rows.generators,
                                      None, 6, CPU)
        out, _ = verify(torch.cat([TARGET[2:], TARGET]), meta, VerifyLayout.build([[], [0, 1]], CPU), Sampler(draw))
        verified.append(out.token_ids[0, 0].item())
    assert verified == plain and len(set(plain)) > 1
