"""The sampler's draw for random rows on the GPU: the torch form of the exponential race (noise in a
tensor of its own, then subtract and argmax) against `race_draw`'s one pass, at the decode shapes
of W4 (256 x Qwen3's 151,936), W1 (256 x Llama 3's 128,256), a batch of 64 and batch 1.

    python benchmarks/race_draw_bench.py      (on the device: bash benchmarks/device_bench.sh sweep:race)

Prints each shape's median time (`triton.testing.do_bench`) and the logits' bytes over it.
"""
import torch
from corectl.backends.triton.race_draw import race_draw
from corectl.sample.random_sampling import draw_tokens
from triton.testing import do_bench

SHAPES = [(256, 151_936), (256, 128_256), (64, 151_936), (1, 151_936)]


def main() -> None:
    print(f"{'rows x vocab':>16} {'torch form':>12} {'race_draw':>12} {'race GB/s':>10}")
    for rows, vocab in SHAPES:
        logits = torch.randn(rows, vocab, device="cuda")
        work = torch.empty_like(logits)

        def torch_form():
            work.copy_(logits)  # the torch form draws in place; the copy is timed apart and subtracted
            return draw_tokens(work, {}, "exponential_race")

        copy = do_bench(lambda: work.copy_(logits))
        torch_ms = do_bench(torch_form) - copy
        race_ms = do_bench(lambda: race_draw(logits))
        print(f"{rows:>6} x {vocab:<7} {torch_ms * 1e3:>9.1f} us {race_ms * 1e3:>9.1f} us "
              f"{logits.numel() * 4 / race_ms / 1e6:>10.0f}")


if __name__ == "__main__":
    main()
