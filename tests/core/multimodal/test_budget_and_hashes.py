"""The scheduler's encoder budget over its encoder-cache manager, and the prefix-cache hashes of
blocks holding image placeholders."""
from __future__ import annotations

import numpy as np

from corectl.kv.block_hash import extend_block_hashes
from corectl.multimodal.budget import EncoderBudget
from corectl.multimodal.cache_manager import EncoderCacheManager
from corectl.multimodal.inputs import MultiModalInput
from corectl.request import Request
from corectl.sampling_params import SamplingParams

def _image(offset: int, length: int, seed: int = 0) -> MultiModalInput:
    pixels = np.random.default_rng(seed).random((4, 6), dtype=np.float32)
    return MultiModalInput.build(pixels, [1, 2, 2], offset, length)


def _two_images() -> list[MultiModalInput]:
    """A at positions 4..13, B at 20..29."""
    return [_image(4, 10), _image(20, 10, 1)]


def _request(req_id: str, images: list[MultiModalInput], num_computed: int = 0) -> Request:
    req = Request(req_id, list(range(60)), SamplingParams(), max_tokens=1, mm_inputs=images)
    req.num_computed_tokens = num_computed
    return req


def _fit(images, num_computed, num_tokens, compute=16, spent=0, cache=None, whole_images=False) -> tuple[int, int]:
    """(tokens fitted, encoder rows spent) of one chunk in a step that has spent `spent` already."""
    budget = EncoderBudget(compute, cache or EncoderCacheManager(64), whole_images)
    budget.spent = spent
    return budget.fit(_request("r", images), num_computed, num_tokens), budget.spent


def _step(cache: EncoderCacheManager, *chunks: tuple[Request, int], compute: int = 16) -> list[int]:
    """One scheduler step over `cache`: fit each request's chunk, advance the requests, commit."""
    budget = EncoderBudget(compute, cache)
    fitted = [budget.fit(req, req.num_computed_tokens, n) for req, n in chunks]
    for (req, _), n in zip(chunks, fitted):
        req.num_computed_tokens += n
    budget.commit([req for (req, _), n in zip(chunks, fitted) if n])
    return fitted


def test_idle_entries_leave_least_recently_used_first_and_referenced_ones_never():
    cache = EncoderCacheManager(30)
    for key in "ABC":
        cache.add(key, 10)
    cache.reference("B", "r")
    cache.reference("A", "s")
    cache.release("A", "s")                       # read again: the most recently used idle entry
    cache.add("D", 10)
    cache.add("E", 10)
    assert cache.take_evicted() == ["C", "A"] and cache.take_evicted() == []
    cache.free("r")                               # B is idle now, and newer than D and E
    cache.add("F", 10)
    assert cache.take_evicted() == ["D"]
    assert all(key in cache for key in "BEF") and cache.rows == 30 and cache.referenced_rows == 0


def test_a_chunk_stops_before_an_image_the_step_has_no_encoder_compute_for():
    images = _two_images()
    assert _fit(images, 0, 40) == (20, 10)                 # the second image waits for the next step
    assert _fit(images, 0, 40, spent=8) == (4, 8)          # the text before the first still runs
    assert _fit(images, 0, 40, compute=32) == (40, 20)
    assert _fit([_image(0, 50)], 0, 60) == (60, 50)        # larger than the budget: runs as the first
    assert _fit(images, 0, 8, whole_images=True) == (4, 0)  # Gemma 3: never ends inside an image


def test_an_image_the_cache_holds_costs_no_encoding_wherever_the_chunk_starts():
    """A repeated image, or one that a prefix hit (or a preemption) ends inside, is read from the
    worker's cache when the manager says it holds it; when not, it is encoded again and charged, and
    a waiting request whose chunk starts inside it waits while no compute is left."""
    images = _two_images()
    cache = EncoderCacheManager(64)
    assert _step(cache, (_request("first", images), 16)) == [16]   # A whole, B not yet reached
    assert cache.is_idle(images[0].hash) and images[1].hash not in cache
    assert _fit(images, 0, 40, cache=cache) == (40, 10)            # A cached: only B is charged
    assert _fit(images, 8, 32, spent=10, cache=cache) == (12, 10)  # admitted inside A: free; B waits
    assert _fit(images, 8, 4, spent=16, cache=cache) == (4, 16)
    assert _fit(images, 8, 4, spent=10) == (0, 10)                 # A not cached, no compute: waits
    assert _fit(images, 8, 32) == (12, 10)                         # A charged again, B waits


def test_an_image_an_earlier_chunk_began_stays_referenced_until_the_prefill_moves_past_it():
    images = _two_images()
    cache = EncoderCacheManager(64)
    req = _request("r", images)
    assert _step(cache, (req, 8)) == [8]
    key = images[0].hash
    assert not cache.is_idle(key) and cache.referenced_rows == 10
    assert _step(cache, (req, 4), compute=0) == [4]                # still inside A: nothing to encode
    assert _step(cache, (req, 14)) == [14]                         # past A and into B
    assert cache.is_idle(key) and not cache.is_idle(images[1].hash) and cache.referenced_rows == 10
    cache.free("r")                                                # finished, aborted or preempted
    assert cache.referenced_rows == 0 and cache.is_idle(images[1].hash)


def test_an_image_waits_for_cache_room_that_referenced_images_hold():
    a, b, c = _image(4, 10), _image(4, 10, 1), _image(4, 10, 2)
    cache = EncoderCacheManager(20)
    first, second, third = _request("1", [a]), _request("2", [b]), _request("3", [c])
    assert _step(cache, (first, 8), (second, 8), compute=32) == [8, 8]  # both stop inside their image
    assert _step(cache, (third, 8)) == [4]                 # no room: the text before C runs, C waits
    assert cache.take_evicted() == []
    cache.free("1")                                        # preempted: A is idle, room can come from it
    assert _step(cache, (third, 8)) == [8]
    assert a.hash not in cache and cache.take_evicted() == [a.hash]
    assert cache.rows == 20 and cache.referenced_rows == 20


def test_requests_sharing_an_image_in_one_step_encode_it_once():
    image = _image(4, 10)
    cache = EncoderCacheManager(64)
    budget = EncoderBudget(10, cache)
    one, two = _request("1", [image]), _request("2", [image])
    assert budget.fit(one, 0, 8) == 8 and budget.fit(two, 0, 8) == 8 and budget.spent == 10
    # The first is left out after all (no KV room): the image is still the second's, encoded once.
    two.num_computed_tokens = 8
    budget.commit([two])
    assert not cache.is_idle(image.hash) and cache.rows == 10
    cache.free("2")
    assert cache.is_idle(image.hash) and cache.referenced_rows == 0


def test_blocks_holding_another_images_placeholders_hash_differently():
    tokens = list(range(100, 148))  # three blocks of 16; the image's placeholders fill 20..27
    same = [(20, 28, _image(20, 8).hash_bytes)]
    other = [(20, 28, _image(20, 8, seed=5).hash_bytes)]
    a = extend_block_hashes([], tokens, 16, 3, images=same)
    assert a == extend_block_hashes([], tokens, 16, 3, images=same)
    b = extend_block_hashes([], tokens, 16, 3, images=other)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert a[0] == extend_block_hashes([], tokens, 16, 1)[0]
