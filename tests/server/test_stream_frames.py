"""Streamed completions: a delta of new text alone is spliced into its choice's pre-encoded frame,
which must carry the very bytes the general path encodes for it; every other delta takes that path."""
from __future__ import annotations

import msgspec
import pytest
from corectl.outputs import CompletionOutput, RequestOutput
from corectl.server.http import sse
from corectl.server.http.completions import _Choices
from corectl.server.http.protocol import CompletionRequest
from corectl.server.http.responses import CompletionResponse

HEAD = {"id": "cmpl-1", "created": 1700000000, "model": "SmolLM2-135M-Instruct.Q4_1"}
TEXTS = ["Hello", " world", 'a "quoted"\\ path', "\n\ttabs\r\n", "é中文🙂", "\x00text\x00", "</s>", " "]


def _delta(text: str, finish_reason: str | None = None, index: int = 0) -> RequestOutput:
    return RequestOutput(request_id="cmpl-1", prompt="Say", prompt_token_ids=[1, 2, 3],
                         outputs=[CompletionOutput(index, text, [7], finish_reason=finish_reason)],
                         finished=finish_reason is not None)


def _choices(**fields) -> _Choices:
    body = msgspec.convert({"prompt": "Say", "stream": True, **fields}, CompletionRequest)
    return _Choices(body, tokenizer=None, n=body.n, head=HEAD, continuous_usage=body.stream_usage(False)[1])


def _general(choices: _Choices, out: RequestOutput) -> bytes:
    return sse.frame(CompletionResponse(**HEAD, choices=choices.stream_pieces(0, out)))


def test_text_frames_are_the_general_paths_bytes():
    spliced, general = _choices(), _choices()
    assert spliced.text_frame(0, _delta("First")) is None  # a choice's first piece: general path
    _general(spliced, _delta("First"))
    _general(general, _delta("First"))
    for text in TEXTS:
        frame = spliced.text_frame(0, _delta(text))
        assert frame == _general(general, _delta(text))
        assert msgspec.json.decode(frame[len(b"data: "):])["choices"][0]["text"] == text


@pytest.mark.parametrize("fields", [{"logprobs": 1}, {"return_token_ids": True},
                                    {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}])
def test_deltas_with_more_than_text_take_the_general_path(fields):
    choices = _choices(**fields)
    choices.stream_pieces(0, _delta("First"))
    assert choices.text_frame(0, _delta("x")) is None


def test_the_echo_goes_with_the_first_piece_then_text_splices():
    spliced, general = _choices(echo=True), _choices(echo=True)
    assert spliced.text_frame(0, _delta("First")) is None
    first = _general(spliced, _delta("First"))
    assert first == _general(general, _delta("First"))
    assert msgspec.json.decode(first[len(b"data: "):])["choices"][0]["text"] == "SayFirst"
    assert spliced.text_frame(0, _delta(" more")) == _general(general, _delta(" more"))


def test_an_end_an_empty_delta_and_several_samples_take_the_general_path():
    choices = _choices(n=2)
    two = RequestOutput(request_id="cmpl-1", prompt="Say", prompt_token_ids=[1], finished=False,
                        outputs=[CompletionOutput(0, "a", [7]), CompletionOutput(1, "b", [8])])
    choices.stream_pieces(0, two)
    assert choices.text_frame(0, two) is None
    single = _choices()
    single.stream_pieces(0, _delta("First"))
    assert single.text_frame(0, _delta("", None)) is None
    assert single.text_frame(0, _delta("end", "length")) is None
