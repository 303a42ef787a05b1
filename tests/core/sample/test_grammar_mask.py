"""The grammar bitmask applied to the logits (core/sample/grammar.py) against two references: a
bit-by-bit reading of the mask, and xgrammar's own CPU kernel."""
import pytest
import torch
import xgrammar as xgr
from corectl.sample.grammar import apply_grammar_bitmask, unpack_bitmask


def reference(logits, bitmask, rows):
    """Token t of mask row i is allowed when bit t % 32 of word t // 32 is set; past the words, never."""
    expected = logits.clone()
    words = bitmask.tolist()
    for i, row in enumerate(rows):
        for t in range(logits.shape[1]):
            word = t // 32
            if word >= len(words[i]) or not (words[i][word] >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    return expected


def random_bitmask(num_rows, vocab_size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (num_rows, (vocab_size + 31) // 32), dtype=torch.int32, generator=g)


@pytest.mark.parametrize("vocab_size, mask_vocab", [(100, 100), (96, 96), (130, 100), (90, 100)])
@pytest.mark.parametrize("rows", [[0, 2, 3], [0, 1, 2, 3, 4], [4, 1]])
def test_matches_the_bitwise_reference(vocab_size, mask_vocab, rows):
    logits = torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(1))
    bitmask = random_bitmask(len(rows), mask_vocab, seed=len(rows))
    expected = reference(logits, bitmask, rows)
    out = logits.clone()
    apply_grammar_bitmask(out, bitmask, torch.tensor(rows))
    assert torch.equal(out, expected)
    untouched = [r for r in range(5) if r not in rows]
    assert torch.equal(out[untouched], logits[untouched])


def test_all_rows_in_order_need_no_index():
    logits = torch.randn(3, 70)
    bitmask = random_bitmask(3, 70, seed=3)
    out = logits.clone()
    apply_grammar_bitmask(out, bitmask, None)
    assert torch.equal(out, reference(logits, bitmask, [0, 1, 2]))


def test_matches_xgrammar_kernel_on_a_real_vocabulary_width():
    vocab_size, rows = 49152, [1, 3, 6]
    logits = torch.randn(8, vocab_size, generator=torch.Generator().manual_seed(2))
    full = random_bitmask(8, vocab_size, seed=4)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, full, indices=rows)
    out = logits.clone()
    apply_grammar_bitmask(out, full[rows], torch.tensor(rows))
    assert torch.equal(out, expected)


def test_sign_bit_is_token_31():
    bitmask = torch.tensor([[-2**31, 1]], dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, 64)[0].nonzero().flatten().tolist()
    assert allowed == [31, 32]
