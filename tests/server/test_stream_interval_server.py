"""`corectl serve --stream-interval 4` through the OpenAI SDK: chunks of four tokens, the same text as
without streaming, and metrics that still count every token's gap."""
from __future__ import annotations

import re

import httpx
import pytest
from support.server import API_KEY, SMALL_ENGINE, running_server

MAX_TOKENS = 9


@pytest.fixture(scope="module")
def server():
    with running_server(*SMALL_ENGINE, "--api-key", API_KEY, "--stream-interval", "4") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _itl_count(server) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return float(re.search(r"^vllm:inter_token_latency_seconds_count\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_completion_chunks_gather_four_tokens(server, client):
    model = client.models.list().data[0].id
    args = dict(model=model, prompt="The colours of the rainbow are", max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].text
    gaps_before = _itl_count(server)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    # Deltas of 1, 4 and 4 tokens: the first token at once, then four at a time (a delta whose tokens
    # decode to no text yet sends no chunk, so there may be fewer).
    assert 1 <= len(texts) <= 3, texts
    assert "".join(texts) == whole
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    # The histogram has every gap between the streamed request's tokens, not one per chunk.
    assert _itl_count(server) - gaps_before == MAX_TOKENS - 1


def test_chat_stream_ends_with_its_finish_reason(client):
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    chunks = list(stream)
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert content and len(content) <= 3
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
