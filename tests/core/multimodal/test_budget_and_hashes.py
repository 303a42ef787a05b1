"""The scheduler's encoder budget and the prefix-cache hashes of blocks holding image placeholders."""
from __future__ import annotations

import numpy as np

from corectl.kv.block_hash import extend_block_hashes
from corectl.multimodal.budget import fit_encoder_budget
from corectl.multimodal.inputs import MultiModalInput


def _image(offset: int, length: int, seed: int = 0) -> MultiModalInput:
    pixels = np.random.default_rng(seed).random((4, 6), dtype=np.float32)
    return MultiModalInput.build(pixels, [1, 2, 2], offset, length)


def test_a_chunk_stops_before_an_image_the_step_has_no_encoder_room_for():
    images = [_image(4, 10), _image(20, 10, 1)]
    assert fit_encoder_budget(images, 0, 40, budget=16, spent=0) == (20, 10)   # the second waits
    assert fit_encoder_budget(images, 0, 40, budget=16, spent=8) == (4, 0)     # the text before it runs
    assert fit_encoder_budget(images, 8, 32, budget=16, spent=0) == (32, 10)   # the first is begun: free
    assert fit_encoder_budget(images, 8, 32, budget=16, spent=10) == (12, 0)
    assert fit_encoder_budget(images, 0, 40, budget=32, spent=0) == (40, 20)
    # An image larger than the whole budget runs when it is the step's first.
    assert fit_encoder_budget([_image(0, 50)], 0, 60, budget=16, spent=0) == (60, 50)


def test_blocks_holding_another_images_placeholders_hash_differently():
    tokens = list(range(100, 148))  # three blocks of 16; the image's placeholders fill 20..27
    same = [(20, 28, _image(20, 8).hash_bytes)]
    other = [(20, 28, _image(20, 8, seed=5).hash_bytes)]
    a = extend_block_hashes([], tokens, 16, 3, images=same)
    assert a == extend_block_hashes([], tokens, 16, 3, images=same)
    b = extend_block_hashes([], tokens, 16, 3, images=other)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert a[0] == extend_block_hashes([], tokens, 16, 1)[0]
