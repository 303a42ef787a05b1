"""allowed_token_ids and bad_words in the sampler, against per-row Python references; and the
intake's tokenization of bad words and prompt truncation."""
from __future__ import annotations

import torch
from corectl.engine.intake import bad_words_token_ids, prepare_request
from corectl.sample import Sampler, SamplingMetadata
from corectl.sample.metadata import UnreadOutputTokens, is_plain_greedy
from corectl.sample.sampler import edit_logits
from corectl.sample.transfer import DeviceTarget
from corectl.sampling_params import SamplingParams

VOCAB = 16
CPU = DeviceTarget(torch.device("cpu"))


def _meta(params, outputs, unread=None):
    rows = len(params)
    return SamplingMetadata.build(params, [[]] * rows, outputs, [None] * rows, None, VOCAB, CPU, unread)


def _reference(logits, params, outputs):
    """Row by row: mask everything outside allowed_token_ids, then every bad word's last token
    where the output ends with the word's other tokens."""
    expected = logits.clone()
    for row, (p, history) in enumerate(zip(params, outputs)):
        if p.allowed_token_ids:
            keep = torch.full((VOCAB,), float("-inf"))
            keep[p.allowed_token_ids] = 0.0
            expected[row] += keep
        for word in p.bad_words_token_ids or ():
            prefix = word[:-1]
            if not prefix or list(history[-len(prefix):]) == prefix:
                expected[row, word[-1]] = float("-inf")
    return expected


def test_allowed_and_bad_words_match_reference():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=[3, 5, 9]),
        SamplingParams(temperature=0.0, bad_words_token_ids=[[7], [1, 2], [4, 2, 8], [6, 6]]),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, allowed_token_ids=[5, 7], bad_words_token_ids=[[5]]),
    ]
    outputs = [[1, 2], [3, 4, 2], [1, 2], [0]]
    assert not any(is_plain_greedy(p) for p in (params[0], params[1]))
    edited = edit_logits(logits.clone(), _meta(params, outputs))
    torch.testing.assert_close(edited, _reference(logits, params, outputs), rtol=0, atol=0)
    # Row 1: [7] always, [1, 2] does not match (output ends 4, 2), [4, 2, 8] matches, [6, 6] does not.
    assert torch.isinf(edited[1, [7, 8]]).all() and torch.isfinite(edited[1, [2, 6]]).all()
    sampled = Sampler()(logits.clone(), _meta(params, outputs)).sampled_token_ids
    assert sampled[0].item() in (3, 5, 9) and sampled[3].item() == 7


def test_bad_word_prefix_ending_in_an_unread_token_is_checked_on_device():
    """Async scheduling: the newest output token is on the device only; a word whose before-last
    token must match it is forbidden exactly where it does."""
    logits = torch.zeros(2, VOCAB)
    params = [SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 4, 5], [9, 11]])] * 2
    outputs = [[3], [3]]  # the host's copy; each row's unread token follows it
    unread = UnreadOutputTokens(rows=[0, 1], token_ids=torch.tensor([4, 9]))
    edited = edit_logits(logits.clone(), _meta(params, outputs, unread))
    assert torch.isinf(edited[0, 5]) and torch.isfinite(edited[0, 11])  # output 3, 4 -> ban 5
    assert torch.isinf(edited[1, 11]) and torch.isfinite(edited[1, 5])  # output 3, 9 -> ban 11


def test_bad_words_tokenized_bare_and_after_a_space(llm_int4):
    tokenizer = llm_int4.tokenizer
    words = bad_words_token_ids(["hello", "once upon"], tokenizer)
    assert tokenizer.encode("hello", add_special_tokens=False) in words
    assert tokenizer.encode(" hello", add_special_tokens=False) in words
    assert tokenizer.encode("once upon", add_special_tokens=False) in words


def test_truncate_prompt_tokens_keeps_the_tail():
    params = SamplingParams(truncate_prompt_tokens=3)
    prompt, ids, _ = prepare_request("text", [1, 2, 3, 4, 5], params, None)
    assert (prompt, ids) == (None, [3, 4, 5])
    assert prepare_request("text", [1, 2], params, None)[:2] == ("text", [1, 2])


def test_bad_words_keep_a_greedy_generation_off_a_word(llm_int4):
    """Through the engine: the greedy continuation's first word, once banned, never appears."""
    prompt = "The capital of France is"
    free = llm_int4.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    word = free.text.split()[0]
    banned = llm_int4.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, bad_words=[word]))[0]
    assert word not in banned.outputs[0].text.split()
    allowed = llm_int4.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4,
                                                         allowed_token_ids=[11, 12]))[0]
    assert set(allowed.outputs[0].token_ids) <= {11, 12}
