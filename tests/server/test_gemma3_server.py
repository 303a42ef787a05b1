"""Gemma 3 behind the chat API: a real `corectl serve` of the tiny random-weight checkpoint and the
`openai` client. An image is answered with and without pan-and-scan crops (vLLM's
mm_processor_kwargs: a request's own over the server's --mm-processor-kwargs), /tokenize counts
every crop's tokens, --limit-mm-per-prompt counts images rather than crops, and bad input is a 400
with the server healthy after."""
from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from support.openai_errors import expect_error
from support.server import API_KEY, ServerProcess
from support.vision_models import data_url, png_bytes, random_image

IMAGE_TOKEN = "<image_soft_token>"
PAN_AND_SCAN = {"mm_processor_kwargs": {"do_pan_and_scan": True}}


@pytest.fixture(scope="module")
def gemma3_server(gemma3_dir):
    # At most 2 crops an image (the processor's default is 4), so the server's own options show.
    proc = ServerProcess(str(gemma3_dir), "--api-key", API_KEY, "--dtype", "float32", "--kv-cache-memory", "0.02",
                         "--max-model-len", "256", "--limit-mm-per-prompt", '{"image": 1}',
                         "--mm-processor-kwargs", '{"pan_and_scan_max_num_crops": 2}', "--engine-in-process",
                         "--served-model-name", "g").wait_ready()
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def gemma3_http(gemma3_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=gemma3_server.url, headers=headers, timeout=120) as client:
        yield client


def _messages(*images, text: str = " What is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _chat(client: httpx.Client, messages: list[dict], **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": "g", "messages": messages, "max_tokens": 3,
                                                   "temperature": 0, **extra})


def test_a_wide_image_with_and_without_crops_and_tokenize_counts_every_crop(gemma3_server, gemma3_http):
    """A 4:1 image: 2 crops (the server's limit; the processor alone would cut 4) after the whole
    image's square, 3 squares of 16 tokens, one image under a limit of one image a prompt."""
    messages = _messages(random_image(1024, 256, 1))
    client = OpenAI(base_url=gemma3_server.url + "/v1", api_key=API_KEY, max_retries=0)
    image_tokens = {}
    for extra in ({}, PAN_AND_SCAN):
        reply = client.chat.completions.create(model="g", messages=messages, max_tokens=3, temperature=0,
                                               extra_body=extra)
        assert reply.choices[0].message.content is not None
        tokenized = gemma3_http.post("/tokenize", json={"messages": messages, "return_token_strs": True,
                                                        **extra}).json()
        assert reply.usage.prompt_tokens == tokenized["count"]
        image_tokens[bool(extra)] = tokenized["token_strs"].count(IMAGE_TOKEN)
    assert image_tokens == {False: 16, True: 3 * 16}


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"do_pan_and_scan": 1}, "do_pan_and_scan must be true or false"),
    ({"max_pixels": 1000}, "no option 'max_pixels'"),
    ({"pan_and_scan_max_num_crops": 100}, "an integer from 1 to 16"),
])
def test_bad_processor_options_are_400s_naming_the_field(gemma3_http, kwargs, says):
    messages = _messages(random_image(64, 64, 2))
    for response in (_chat(gemma3_http, messages, mm_processor_kwargs=kwargs),
                     gemma3_http.post("/tokenize", json={"messages": messages, "mm_processor_kwargs": kwargs})):
        assert says in expect_error(response, 400, "mm_processor_kwargs")["message"]


def test_a_bad_image_too_many_or_options_without_images_are_400s_and_the_server_still_serves(gemma3_http):
    corrupt = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(b"\x89PNG\r\n\x1a\nnot an image at all")}}]}]
    expect_error(_chat(gemma3_http, corrupt, **PAN_AND_SCAN), 400, "messages", "invalid_image")
    two = _messages(random_image(64, 64, 3), random_image(64, 64, 4))
    expect_error(_chat(gemma3_http, two), 400, "messages", "too_many_images")
    # Options for images, sent with a text prompt that holds none.
    expect_error(gemma3_http.post("/tokenize", json={"prompt": "Hi", **PAN_AND_SCAN}), 400, "mm_processor_kwargs")
    assert gemma3_http.get("/health").status_code == 200
    assert _chat(gemma3_http, _messages(random_image(300, 600, 5)), **PAN_AND_SCAN).status_code == 200
    assert _chat(gemma3_http, [{"role": "user", "content": "Hi"}]).status_code == 200
