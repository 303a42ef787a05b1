"""The scheduler's encoder budget and the prefix-cache hashes of blocks holding image placeholders."""
from __future__ import annotations

import numpy as np

from corectl.kv.block_hash import extend_block_hashes
from corectl.multimodal.budget import EncoderBudget, pinned_rows
from corectl.multimodal.inputs import MultiModalInput
from corectl.request import Request
from corectl.sampling_params import SamplingParams


def _image(offset: int, length: int, seed: int = 0) -> MultiModalInput:
    pixels = np.random.default_rng(seed).random((4, 6), dtype=np.float32)
    return MultiModalInput.build(pixels, [1, 2, 2], offset, length)


def _fit(images, num_computed, num_tokens, compute=16, cache_rows=64, spent=0, pinned=0,
         admitted=False) -> tuple[int, int, int]:
    budget = EncoderBudget(compute, cache_rows, pinned=pinned, spent=spent)
    return budget.fit(images, num_computed, num_tokens, admitted), budget.spent, budget.pinned


def test_a_chunk_stops_before_an_image_the_step_has_no_encoder_room_for():
    images = [_image(4, 10), _image(20, 10, 1)]
    assert _fit(images, 0, 40) == (20, 10, 0)               # the second image waits for the next step
    assert _fit(images, 0, 40, spent=8) == (4, 8, 0)        # the text before the first still runs
    assert _fit(images, 8, 32) == (32, 10, 0)               # the first was begun earlier: free
    assert _fit(images, 8, 32, spent=10) == (12, 10, 0)
    assert _fit(images, 0, 40, compute=32) == (40, 20, 0)
    assert _fit([_image(0, 50)], 0, 60) == (60, 50, 0)      # larger than the budget: runs as the first


def test_an_admitted_chunk_that_starts_inside_an_image_pays_for_encoding_it_again():
    """After a prefix hit (or a preemption) that ends inside an image, the worker has no pinned rows
    for it: the admitting chunk is charged as if it started the image, and waits when no room is left,
    so 64 such requests never encode 64 images in one step."""
    images = [_image(4, 10), _image(20, 10, 1)]
    assert _fit(images, 8, 32) == (32, 10, 0)                             # a running request's: free
    assert _fit(images, 8, 32, admitted=True) == (12, 10, 0)                            # admitted: charged, second waits
    assert _fit(images, 8, 32, compute=32, admitted=True) == (32, 20, 0)
    assert _fit(images, 8, 4, spent=10, admitted=True) == (0, 10, 0)                    # no room: the request waits
    assert _fit(images, 8, 4, admitted=True) == (4, 10, 10)                             # stops inside: pinned again
    assert _fit(images, 14, 26, admitted=True) == (26, 10, 0)                           # past the first image: only the second


def test_a_chunk_that_stops_inside_an_image_pins_its_rows_within_the_cache():
    images = [_image(4, 10)]
    assert _fit(images, 0, 8) == (8, 10, 10)                # split: its rows stay pinned
    assert _fit(images, 0, 8, cache_rows=64, pinned=60) == (4, 0, 60)
    assert _fit(images, 0, 20, cache_rows=64, pinned=60) == (20, 10, 60)  # taken whole: nothing pinned
    running = Request("r", list(range(30)), SamplingParams(), max_tokens=1, mm_inputs=images)
    running.num_computed_tokens = 8
    assert pinned_rows([running]) == 10
    running.num_computed_tokens = 14
    assert pinned_rows([running]) == 0


def test_blocks_holding_another_images_placeholders_hash_differently():
    tokens = list(range(100, 148))  # three blocks of 16; the image's placeholders fill 20..27
    same = [(20, 28, _image(20, 8).hash_bytes)]
    other = [(20, 28, _image(20, 8, seed=5).hash_bytes)]
    a = extend_block_hashes([], tokens, 16, 3, images=same)
    assert a == extend_block_hashes([], tokens, 16, 3, images=same)
    b = extend_block_hashes([], tokens, 16, 3, images=other)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert a[0] == extend_block_hashes([], tokens, 16, 1)[0]
