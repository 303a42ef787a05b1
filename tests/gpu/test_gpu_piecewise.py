"""Piecewise CUDA graphs: prefill chunks and mixed steps replay graphs cut at each attention call and
give the tokens that eager execution of those steps gives (CORECTL_PIECEWISE_GRAPHS=0)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl import SamplingParams  # noqa: E402
from corectl.backends.cuda.piecewise import PiecewiseGraphs, non_owning_view  # noqa: E402
from support.gpu import MAX_TOKENS, PROMPT_LENGTHS, compare_greedy_outputs, generate, random_prompts  # noqa: E402

TIE_TOLERANCE = {"float32": 0.0, "bfloat16": 0.25}


@pytest.fixture
def piecewise_steps(monkeypatch) -> list[tuple[int, int]]:
    """(tokens, captured count) of every piecewise replay from here on."""
    steps: list[tuple[int, int]] = []
    run = PiecewiseGraphs.run

    def watched(self, bucket, backend, metadata, input_ids, positions):
        steps.append((input_ids.shape[0], bucket))
        return run(self, bucket, backend, metadata, input_ids, positions)

    monkeypatch.setattr(PiecewiseGraphs, "run", watched)
    return steps


def _greedy(checkpoint, dtype, **options):
    # Four sequences at a time over 13 prompts of different lengths and budgets: requests end at
    # different steps, so prompts join running decodes (mixed steps); a small token budget chunks
    # the long prompts.
    prompts = random_prompts(PROMPT_LENGTHS, seed=4)
    prompts += [prompts[1][:-3], prompts[5]]  # prefix-cache hits: the recomputed last block beside decodes
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=5, ignore_eos=True)
              for n in MAX_TOKENS + [9, 14]]
    return generate(checkpoint, prompts, params, dtype=dtype, max_num_seqs=4, max_num_batched_tokens=192,
                    **options)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_steps_replay_pieces_with_eager_tokens(dtype, checkpoint, piecewise_steps, monkeypatch):
    monkeypatch.setenv("CORECTL_PIECEWISE_GRAPHS", "0")
    eager = _greedy(checkpoint, dtype)
    assert not piecewise_steps
    monkeypatch.delenv("CORECTL_PIECEWISE_GRAPHS")
    pieces = _greedy(checkpoint, dtype)
    counts = {bucket for _, bucket in piecewise_steps}
    assert len(piecewise_steps) > 10 and len(counts) > 3, piecewise_steps
    assert any(n < bucket for n, bucket in piecewise_steps), "some steps must replay with padding rows"
    compare_greedy_outputs(eager, pieces, TIE_TOLERANCE[dtype], exact=dtype == "float32")


def test_enforce_eager_captures_no_pieces(checkpoint, piecewise_steps):
    _greedy(checkpoint, "bfloat16", enforce_eager=True)
    assert not piecewise_steps


def test_a_non_owning_view_shares_memory_without_holding_it():
    base = torch.arange(4096 * 3, dtype=torch.float32, device="cuda").view(4096, 3)[:, 1:]
    view = non_owning_view(base)
    assert view.dtype == base.dtype and view.shape == base.shape and view.stride() == base.stride()
    assert view.data_ptr() == base.data_ptr() and torch.equal(view, base)
    view.fill_(7.0)
    assert torch.all(base == 7.0)
    bf16 = torch.ones(64, 32, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(non_owning_view(bf16), bf16)
    allocated = torch.cuda.memory_allocated()
    del base
    assert torch.cuda.memory_allocated() < allocated, "the view must not keep the memory allocated"


def test_a_capture_out_of_memory_leaves_steps_eager(checkpoint, piecewise_steps, monkeypatch):
    """Memory running out part-way through the pieces (the KV cache took the rest) ends the open
    capture, frees the pieces and serves every step as before: mixed steps eagerly, same tokens."""
    from corectl.backends.cuda import piecewise

    reference = _greedy(checkpoint, "float32")
    piecewise_steps.clear()
    cut = piecewise._CuttingBackend._cut
    calls = []

    def failing(self, method, args, kwargs):
        calls.append(method)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return cut(self, method, args, kwargs)

    monkeypatch.setattr(piecewise._CuttingBackend, "_cut", failing)
    outputs = _greedy(checkpoint, "float32")
    assert len(calls) == 3 and not piecewise_steps
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
