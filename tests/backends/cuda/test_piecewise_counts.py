"""Which token counts the CUDA runner captures piecewise graphs for, and which one a step replays."""
import torch
from corectl.backends.cuda.piecewise import PIECEWISE_TOKENS, PiecewiseGraphs, capture_batch, piecewise_token_counts


def test_counts_stop_at_the_step_budget():
    assert piecewise_token_counts(8192) == list(PIECEWISE_TOKENS)
    assert piecewise_token_counts(512)[-1] == 512
    assert piecewise_token_counts(192) == [16, 32, 64, 96, 128, 192]
    assert piecewise_token_counts(8) == []


def test_a_budget_between_counts_is_captured_itself():
    assert piecewise_token_counts(224) == [16, 32, 64, 96, 128, 192, 224]
    assert piecewise_token_counts(4000) == list(PIECEWISE_TOKENS)


def test_a_step_replays_the_smallest_count_that_holds_it():
    graphs = PiecewiseGraphs([16, 64, 192], torch.device("cpu"))
    assert [graphs.bucket(n) for n in (1, 16, 17, 64, 65, 192, 193)] == [16, 16, 64, 64, 192, 192, None]
    assert graphs.input_ids.shape == (192,) and graphs.positions.shape == (192,)


def test_the_capture_batch_stores_nothing_and_spans_its_tokens():
    batch = capture_batch(40, 16, torch.device("cpu"))
    assert batch.query_start_loc.tolist() == [0, 40] and batch.seq_lens.tolist() == [40]
    assert batch.block_tables.shape == (1, 3) and not batch.block_tables.any()
    assert (batch.slot_mapping == -1).all() and batch.slot_mapping.shape == (40,)
    assert batch.max_query_len == 40 and not batch.is_pure_decode
