"""The one-pass exponential race (`race_draw`) under the interpreter: its draws follow
softmax(logits) (a chi-square test), masked tokens never win and the best token wins wherever its
split lies, the sampler redraws seeded rows from their own generators as the torch form does, its
exponentials are exact where light tokens win, and rejection sampling drawing with it keeps the
target's distribution."""
import torch
import triton
import triton.language as tl
from corectl.backends.triton.race_draw import _exponential, race_draw
from corectl.sample.random_sampling import draw_tokens
from corectl.sample.transfer import DeviceTarget
from corectl.spec_decode.rejection import VerifyLayout, rejection_sample
from support.spec_decode import chi_square_p_value

# Chi-square critical value at p = 0.001 for 4 degrees of freedom (5 tokens that can win).
CHI2_DF4_P001 = 18.467


def test_draws_follow_the_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, float("-inf"), 0.5])
    rows = 2000
    tokens = race_draw(logits.expand(rows, -1).contiguous())
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[4] == 0  # the masked token
    expected = logits.softmax(0).double() * rows
    kept = expected > 0
    chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    assert chi2 < CHI2_DF4_P001
    assert tokens.dtype == torch.int64


def test_a_dominant_token_wins_in_any_split_and_logits_stay():
    """20,000 ids in 5 splits of 4,096: the winner sits in the first, a middle and the last split, and
    a row masked but for its last id takes that id."""
    vocab = 20_000
    logits = torch.randn(4, vocab)
    for row, column in enumerate((7, 9_000, vocab - 1)):
        logits[row, column] = 60.0
    logits[3] = float("-inf")
    logits[3, vocab - 1] = -3.0
    before = logits.clone()
    assert race_draw(logits).tolist() == [7, 9_000, vocab - 1, vocab - 1]
    assert torch.equal(logits, before)


def test_seeded_rows_draw_from_their_generators_as_the_torch_form_does():
    torch.manual_seed(1)
    logits = torch.randn(3, 300)

    def seeded() -> dict[int, torch.Generator]:
        return {1: torch.Generator().manual_seed(1234)}

    fused = draw_tokens(logits.clone(), seeded(), "exponential_race", race=race_draw)
    torch_form = draw_tokens(logits.clone(), seeded(), "exponential_race")
    assert fused[1] == torch_form[1]
    assert fused.shape == (3,) and bool(((fused >= 0) & (fused < 300)).all())


@triton.jit
def _exponentials(bits_ptr, out_ptr, N: tl.constexpr):
    cols = tl.arange(0, N)
    tl.store(out_ptr + cols, _exponential(tl.load(bits_ptr + cols)))


def test_exponentials_are_exact_where_light_tokens_win():
    """q from the smallest random words on (where a light token's chance is decided: an fp32 u's
    -log u could give none of these values below 6e-8) to the largest, against float64's -log1p(-w)."""
    words = [0, 1, 2, 7, 1000, 2 ** 20, 2 ** 24 + 1, 2 ** 30, 2 ** 31, 3 * 2 ** 30, 2 ** 32 - 2 ** 12, 2 ** 32 - 1]
    words += [0] * (16 - len(words))
    bits = torch.tensor(words, dtype=torch.int64).to(torch.uint32)
    out = torch.empty(16, dtype=torch.float32)
    _exponentials[(1,)](bits, out, N=16)
    w = (torch.tensor(words, dtype=torch.float64) + 0.5) * 2.0 ** -32
    expected = -torch.log1p(-w)
    error = (out.double() - expected).abs() / expected
    small = expected < 1.0
    assert float(error[small].max()) < 1e-5
    # Large q only makes a token lose by more: finite, and within fp32's steps of w below 1.
    assert bool(torch.isfinite(out).all()) and float(error[~small].max()) < 1e-3


def test_rejection_sampling_with_the_race_leaves_the_target_distribution_unchanged():
    """n-gram drafts verified with the kernel drawing the recovered and bonus tokens: each emitted
    position is distributed as the target's row there (chi-square)."""
    target = torch.tensor([[1.2, 0.3, -0.4, 0.9, -1.5, 0.0], [-0.2, 1.1, 0.4, -0.8, 0.6, 0.1],
                           [0.5, -0.5, 1.4, 0.2, -0.3, 0.7]])
    rows = 1200
    torch.manual_seed(0)
    layout = VerifyLayout.build([[0, 1]] * rows, DeviceTarget(torch.device("cpu")))
    out = rejection_sample(target.repeat(rows, 1), layout, greedy_rows=None, all_greedy=False, generators={},
                           draw="exponential_race", race=race_draw)
    for position in range(2):
        reached = out.num_emitted > position
        assert reached.sum() > 300
        p = chi_square_p_value(out.token_ids[reached, position], target[position].softmax(dim=-1))
        assert p > 1e-4, f"position {position}: chi-square p-value {p:.2e}"
