"""Gemma 3 vision-language end to end on a tiny random-weight checkpoint: greedy parity with
transformers (bidirectional attention over each image's tokens) for one and two images batched
with a text-only request, with 18-token steps that would otherwise split images; no chunk and no
prefix hit ends inside an image; pan-and-scan crops (vLLM's mm_processor_kwargs) against
transformers' Gemma3Processor and model."""
from __future__ import annotations

import re

import pytest
import torch
from support.vision_models import data_url, hf_greedy_with_images, png_bytes, random_image

from corectl import LLM, SamplingParams

MAX_TOKENS = 5
STEP_TOKENS = 18


@pytest.fixture(scope="module")
def llm(gemma3_dir):
    return LLM(str(gemma3_dir), dtype="float32", platform="cpu", kv_cache_memory_gib=0.02, max_model_len=256,
               max_num_batched_tokens=STEP_TOKENS)


@pytest.fixture(scope="module")
def hf(gemma3_dir):
    from transformers import Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

    model = Gemma3ForConditionalGeneration.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    return model, Gemma3ImageProcessorPil.from_pretrained(gemma3_dir)


@pytest.fixture(scope="module")
def hf_processor(gemma3_dir, hf):
    """transformers' Gemma3Processor for the checkpoint (its tokenizer told Gemma's image tokens)."""
    from transformers import AutoTokenizer, Gemma3Processor

    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    return Gemma3Processor(image_processor=hf[1], tokenizer=tokenizer, image_seq_length=16)


def _hf_prompt_logprobs(model, ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
    """transformers' log-probability of each prompt token after the first ([1, T] ids)."""
    with torch.no_grad():
        logits = model(ids, pixel_values=pixel_values,
                       token_type_ids=(ids == model.config.image_token_id).long()).logits[0]
    return torch.log_softmax(logits[:-1].double(), dim=-1).gather(1, ids[0, 1:, None])[:, 0]


def _prompt_logprobs(out) -> torch.Tensor:
    ids = list(out.prompt_token_ids)
    return torch.tensor([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])],
                        dtype=torch.float64)


def _hf_greedy(hf, prompt_ids: list[int], images) -> list[int]:
    model, processor = hf
    ids = torch.tensor([prompt_ids])
    extra = {}
    if images:
        extra = dict(pixel_values=processor(images=images, return_tensors="pt")["pixel_values"],
                     token_type_ids=(ids == model.config.image_token_id).long())
    return hf_greedy_with_images(model, ids, extra, MAX_TOKENS)


def _user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_pil", "image_pil": p}
               for p in parts]
    return [{"role": "user", "content": content}]


def test_greedy_parity_with_transformers_one_and_two_images_batched_with_text(llm, hf):
    first, second = random_image(100, 70, 1), random_image(60, 90, 2)
    url = data_url(png_bytes(first))
    conversations = [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                      {"type": "text", "text": "What is this?"}]}],
        _user("Look:", first, second, "Compare them."),
        [{"role": "user", "content": "Just text."}],
    ]
    outs = llm.chat(conversations, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    for out, images in zip(outs, [[first], [first, second], []]):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, list(out.prompt_token_ids), images)
    model = hf[0]
    ids = list(outs[1].prompt_token_ids)
    image, boi, eoi = model.config.image_token_id, model.config.boi_token_id, model.config.eoi_token_id
    # Each image is the processor's run: <start_of_image>, 16 image tokens, <end_of_image>.
    assert ids.count(image) == 32 and ids.count(boi) == ids.count(eoi) == 2
    assert ids[ids.index(boi) + 1:ids.index(boi) + 18] == [image] * 16 + [eoi]



def test_prompt_logprobs_match_transformers_inside_and_after_the_image(llm, hf):
    """Greedy tokens barely feel the image tokens' bidirectional attention on this tiny model; the
    prompt's logprobs do (causal attention over the image moves them by up to ~9 nats here)."""
    model, processor = hf
    image = random_image(80, 80, 3)
    out = llm.chat(_user("Look:", image, "Now."), SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                   use_tqdm=False)[0]
    expected = _hf_prompt_logprobs(model, torch.tensor([list(out.prompt_token_ids)]),
                                   processor(images=[image], return_tensors="pt")["pixel_values"])
    torch.testing.assert_close(_prompt_logprobs(out), expected, atol=2e-3, rtol=1e-4)


@pytest.mark.slow
def test_two_pipeline_stages_match_transformers(gemma3_dir, hf):
    """The first stage holds the tower and merges the image rows; each stage attends both ways
    within the image for its layers (prompt logprobs show it)."""
    model, processor = hf
    image = random_image(80, 80, 3)
    staged = LLM(str(gemma3_dir), dtype="float32", platform="cpu", kv_cache_memory_gib=0.02, max_model_len=256,
                 max_num_batched_tokens=STEP_TOKENS, pipeline_parallel_size=2)
    try:
        out = staged.chat(_user("Look:", image, "Now."),
                          SamplingParams(max_tokens=MAX_TOKENS, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    finally:
        staged.engine.executor.shutdown()
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, list(out.prompt_token_ids), [image])
    expected = _hf_prompt_logprobs(model, torch.tensor([list(out.prompt_token_ids)]),
                                   processor(images=[image], return_tensors="pt")["pixel_values"])
    torch.testing.assert_close(_prompt_logprobs(out), expected, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("pan_and_scan", [True, False])
def test_pan_and_scan_matches_transformers_on_a_wide_image(llm, hf, hf_processor, pan_and_scan):
    """600 x 256 is wide enough for the processor's default pan-and-scan (2 crops of 300 x 256, each a
    square of its own after the whole image's): the prompt, the pixels, greedy tokens and prompt
    logprobs (each square's tokens attend both ways among themselves only) equal transformers'."""
    model = hf[0]
    image = random_image(600, 256, 7)
    messages = _user("Look:", image, " What is it?")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, prompt_logprobs=0)
    out = llm.chat(messages, params, use_tqdm=False, mm_processor_kwargs={"do_pan_and_scan": pan_and_scan})[0]
    text = hf_processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"} if part["type"] == "image_pil" else part
                                      for part in messages[0]["content"]]}], tokenize=False, add_generation_prompt=True)
    expected = hf_processor(text=text, images=[[image]], add_special_tokens=False, do_pan_and_scan=pan_and_scan,
                            return_tensors="pt")
    squares = expected["pixel_values"].shape[0]
    assert squares == (3 if pan_and_scan else 1)
    ids = list(out.prompt_token_ids)
    assert ids == expected["input_ids"][0].tolist()
    assert ids.count(model.config.image_token_id) == 16 * squares
    assert list(out.outputs[0].token_ids) == hf_greedy_with_images(
        model, expected["input_ids"], dict(pixel_values=expected["pixel_values"],
                                           token_type_ids=expected["token_type_ids"]), MAX_TOKENS)
    torch.testing.assert_close(_prompt_logprobs(out), _hf_prompt_logprobs(model, expected["input_ids"],
                                                                          expected["pixel_values"]),
                               atol=2e-3, rtol=1e-4)


def test_an_image_at_a_chunk_boundary_is_not_split_and_a_prefix_hit_stops_before_it(llm):
    """With 18-token steps the image's 16 tokens would straddle step boundaries; the scheduler gives
    each image a step of its own from its first token, and a repeated prompt's prefix hit ends at
    the last block boundary before the image."""
    image = random_image(64, 64, 5)
    system = {"role": "system", "content": "You describe pictures carefully and in a few words, always, please."}
    scheduler = llm.engine.scheduler
    chunks: list[tuple[int, int]] = []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        for req in scheduler.running:
            n = out.num_scheduled_tokens.get(req.request_id, 0)
            if n and req.mm_inputs:
                chunks.append((req.num_computed_tokens - n, req.num_computed_tokens))
        return out

    scheduler.schedule = recording
    try:
        params = SamplingParams(max_tokens=1, temperature=0)
        first = llm.chat([system, *_user(image, "Describe.")], params, use_tqdm=False)[0]
        again = llm.chat([system, *_user(image, "Describe.")], params, use_tqdm=False)[0]
    finally:
        del scheduler.schedule
    boi = llm.engine.source.hf_config.boi_token_id
    offset = list(first.prompt_token_ids).index(boi) + 1
    image_span = (offset, offset + 16)
    assert offset // STEP_TOKENS != (offset + 15) // STEP_TOKENS  # steps from 0 on would split the image
    assert chunks and not any(image_span[0] < end < image_span[1] for _, end in chunks)
    assert any(start <= image_span[0] and image_span[1] <= end for start, end in chunks)
    block = llm.config.block_size
    assert offset < (len(first.prompt_token_ids) - 1) // block * block < offset + 16  # a full hit would end inside
    assert again.num_cached_tokens == offset // block * block > 0
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)


def test_the_prompt_is_gemma3_processors(gemma3_dir, hf_processor):
    """The image runs, and the newline runs merged around them, are the ids transformers'
    Gemma3Processor writes for the same rendered text. (The test tokenizer is SmolLM2's byte-level
    BPE, which splits a newline run before a word, where Gemma's tokenizer keeps it whole: the text
    after each image here starts with a space or a special token, where both agree.)"""
    from corectl.loaders.hf_config import load_hf_config
    from corectl.multimodal.processors import image_processing_for

    processing = image_processing_for(gemma3_dir, load_hf_config(gemma3_dir, None)[0])
    tokenizer = hf_processor.tokenizer
    for parts in (["Look:", None, None, " Compare."], ["A\n", None]):
        # The first image is wide enough for pan-and-scan crops, the second is not.
        images = [random_image(*((600, 256) if i == 1 else (50, 40)), i)
                  for i, part in enumerate(parts) if part is None]
        content = [{"type": "image"} if part is None else {"type": "text", "text": part} for part in parts]
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        for pan_and_scan in (False, True):
            ours = processing.prompt(tokenizer.encode(text, add_special_tokens=False), images,
                                     processing.options({"do_pan_and_scan": pan_and_scan}))["prompt_token_ids"]
            expected = hf_processor(text=text, images=[images], add_special_tokens=False,
                                    do_pan_and_scan=pan_and_scan)["input_ids"][0]
            assert ours == list(expected)


def test_each_crop_is_its_own_encoder_input_and_the_whole_square_is_the_image_without_crops(gemma3_dir):
    """The encoder cache and prefix-cache hashes key each square by its pixels: the crops differ from
    each other and from the whole image, whose square is the same pixels as the image read without
    pan-and-scan (so the two share one encoder output, rightly)."""
    from corectl.loaders.hf_config import load_hf_config
    from corectl.multimodal.processors import image_processing_for

    processing = image_processing_for(gemma3_dir, load_hf_config(gemma3_dir, None)[0])
    image, boi = random_image(256, 600, 8), processing.placeholder_id
    on = processing.prompt([5, boi, 6], [image], processing.options({"do_pan_and_scan": True}))["mm_inputs"]
    off = processing.prompt([5, boi, 6], [image])["mm_inputs"]
    assert len(on) == 3 and len({item.hash for item in on}) == 3 and len(off) == 1
    assert on[0].hash == off[0].hash and on[0].pixel_values == off[0].pixel_values
    assert all(a.end < b.offset for a, b in zip(on, on[1:])) and {item.length for item in on} == {16}


def test_processor_options_are_checked_by_name_and_value_and_a_request_overrides_the_engine(gemma3_dir,
                                                                                           default_model_dir):
    from corectl.errors import ConfigError, InvalidRequestError
    from corectl.loaders.hf_config import load_hf_config
    from corectl.multimodal.processors import check_processor_kwargs, image_processing_for

    hf_config = load_hf_config(gemma3_dir, None)[0]
    processing = image_processing_for(gemma3_dir, hf_config, {"do_pan_and_scan": True})
    assert processing.options(None) == {"do_pan_and_scan": True}
    assert processing.options({"do_pan_and_scan": False, "pan_and_scan_max_num_crops": 2}) == {
        "do_pan_and_scan": False, "pan_and_scan_max_num_crops": 2}
    for bad, says in (({"size": 3}, "no option 'size' (it takes do_pan_and_scan, pan_and_scan_max_num_crops"),
                      ({"do_pan_and_scan": "yes"}, "do_pan_and_scan must be true or false"),
                      ({"pan_and_scan_max_num_crops": 17}, "an integer from 1 to 16"),
                      ({"pan_and_scan_min_crop_size": 0}, "a positive integer")):
        with pytest.raises(InvalidRequestError, match=re.escape(says)) as caught:
            processing.options(bad)
        assert caught.value.param == "mm_processor_kwargs"
    check_processor_kwargs(hf_config, {"do_pan_and_scan": True, "pan_and_scan_min_ratio_to_activate": 2})
    with pytest.raises(ConfigError, match="mm_processor_kwargs: .*no option 'crops'"):
        check_processor_kwargs(hf_config, {"crops": 2})
    with pytest.raises(ConfigError, match="reads no images"):
        check_processor_kwargs(load_hf_config(default_model_dir, None)[0], {"do_pan_and_scan": True})


def test_a_step_budget_smaller_than_one_bidirectional_image_is_refused():
    from corectl.config import EngineConfig
    from corectl.errors import ConfigError
    from corectl.scheduler import Scheduler

    with pytest.raises(ConfigError, match="cannot hold one image of 256 tokens"):
        Scheduler(EngineConfig(max_num_batched_tokens=200), 256, 64, bidirectional_image_tokens=256)
    assert Scheduler(EngineConfig(max_num_batched_tokens=256), 256, 64, bidirectional_image_tokens=256).whole_images


def test_the_memory_profile_encodes_as_many_whole_squares_as_a_step_starts(llm):
    """18-token steps start one 16-row image; its rows, at the text width, stay held until the block ends."""
    worker = llm.engine.executor.worker
    with worker.worst_case_encoding() as encoded:
        outputs = encoded.outputs
        assert [tuple(rows.shape) for rows in outputs] == [(16, 64)]
        assert [item.pixel_shape for item in encoded.images] == [[1, 3, 32, 32]]
    assert outputs == []
