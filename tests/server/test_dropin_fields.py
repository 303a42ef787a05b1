"""Every field of vLLM's request models is implemented or refused by name, never accepted and dropped.

The field names are vLLM's (`vllm/entrypoints/openai/protocol.py`: CompletionRequest,
ChatCompletionRequest, EmbeddingCompletionRequest + EmbeddingChatRequest), written here as data.
For each one the test sends a request that sets it to a value other than its default and checks
that our request Struct declares it and that it either
- changes the SamplingParams the request builds (SAMPLING),
- changes the prompt the chat template renders (TEMPLATE),
- shapes the response, checked through a real server in test_dropin_server.py (OUTPUT), or
- is refused with a 400 whose `param` names it.
"""
from __future__ import annotations

import msgspec
import pytest
from corectl.tokenizer import Tokenizer
from corectl.server.http.chat import chat_prompt
from corectl.server.http.embedding_protocol import EmbeddingRequest
from corectl.server.http.errors import APIError
from corectl.server.http.protocol import ChatCompletionRequest, CompletionRequest

VLLM_COMPLETION_FIELDS = [
    "model", "prompt", "prompt_embeds", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
    "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
]
VLLM_CHAT_FIELDS = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "include_reasoning",
    "parallel_tool_calls", "user", "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs",
    "allowed_token_ids", "bad_words", "echo", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
]
VLLM_EMBEDDING_FIELDS = [
    "model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens", "add_special_tokens",
    "priority", "request_id", "normalize",
    # EmbeddingChatRequest's own
    "messages", "chat_template", "chat_template_kwargs", "mm_processor_kwargs",
]

# A non-default value for each field, and the SamplingParams attribute it must change.
SAMPLING = {
    "frequency_penalty": (0.5, "frequency_penalty"), "presence_penalty": (0.5, "presence_penalty"),
    "logit_bias": ({"5": 2.0}, "logit_bias"), "max_tokens": (7, "max_tokens"),
    "max_completion_tokens": (7, "max_tokens"), "n": (2, "n"), "seed": (3, "seed"), "stop": (["x"], "stop"),
    "temperature": (0.5, "temperature"), "top_p": (0.5, "top_p"), "top_k": (5, "top_k"), "min_p": (0.1, "min_p"),
    "repetition_penalty": (1.2, "repetition_penalty"), "stop_token_ids": ([5], "stop_token_ids"),
    "include_stop_str_in_output": (True, "include_stop_str_in_output"), "ignore_eos": (True, "ignore_eos"),
    "min_tokens": (2, "min_tokens"), "skip_special_tokens": (False, "skip_special_tokens"),
    "spaces_between_special_tokens": (False, "spaces_between_special_tokens"),
    "truncate_prompt_tokens": (4, "truncate_prompt_tokens"), "allowed_token_ids": ([1, 2], "allowed_token_ids"),
    "bad_words": (["bad"], "bad_words"), "prompt_logprobs": (2, "prompt_logprobs"), "cache_salt": ("s", "cache_salt"),
    "kv_transfer_params": ({"do_remote_prefill": True, "transfer_id": "t1"}, "kv_transfer_params"),
    "response_format": ({"type": "json_object"}, "structured_outputs"),
    "guided_json": ({"type": "object"}, "structured_outputs"), "guided_regex": ("a+", "structured_outputs"),
    "guided_choice": (["a", "b"], "structured_outputs"), "guided_grammar": ('root ::= "a"', "structured_outputs"),
    "logprobs": (None, "logprobs"), "top_logprobs": (3, "logprobs"),
    "best_of": (3, "n"),  # best_of samples run, the n best returned (test_best_of_and_beam_search.py)
}
COMPLETION_LOGPROBS = 2
CHAT_LOGPROBS = True
# Fields the chat template reads: a template that prints them shows whether they arrived.
TEMPLATE = {
    "reasoning_effort": "high", "documents": [{"title": "t", "text": "doc-text"}],
    "add_generation_prompt": False, "chat_template_kwargs": {"flavour": "mint"}, "continue_final_message": True,
}
PROBE_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    "{% if documents %}{% for d in documents %}<{{ d.text }}>{% endfor %}{% endif %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}{% endif %}"
    "{% if flavour is defined %}flavour={{ flavour }}{% endif %}"
    "{% if add_generation_prompt %}[assistant:{% endif %}"
)
# Fields whose effect is on the response, the route or the engine's queue; each is exercised through
# a real server (test_dropin_server.py, test_openai_api.py, test_structured_api.py, test_tool_parsers.py).
OUTPUT = {"model", "prompt", "messages", "input", "echo", "stream", "stream_options", "user", "priority",
          "request_id", "tools", "tool_choice", "parallel_tool_calls", "encoding_format", "dimensions",
          "normalize", "chat_template", "suffix",
          "mm_processor_kwargs",  # the image processor's options: test_gemma3_server.py
          "return_tokens_as_token_ids",
          "return_token_ids"}  # test_dropin_server.py (chat), test_tokenizer_free.py (completions)
# Values that must be refused, naming the field (the refused fields' non-default values).
REFUSED_VALUES = {
    "prompt_embeds": "AAAA", "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "logits_processors": ["m.P"],
    "vllm_xargs": {"a": 1},
    "structural_tag": "{}", "include_reasoning": False,
}
# OpenAI's chat fields beyond vLLM's model: the ones that would change the answer are refused when set,
# the ones that cannot (a latency hint, billing, tags for stored completions) are accepted.
OPENAI_CHAT_REFUSED = {
    "functions": [{"name": "f", "parameters": {}}], "function_call": "auto", "audio": {"voice": "alloy"},
    "modalities": ["text", "audio"], "web_search_options": {}, "verbosity": "low", "store": True,
    "service_tier": "priority",
}
OPENAI_CHAT_ACCEPTED = {"prediction": {"type": "content", "content": "x"}, "service_tier": "auto",
                        "metadata": {"k": "v"}, "modalities": ["text"], "store": False}
EMBEDDING_REFUSED = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "x",
                     "chat_template_kwargs": {"a": 1}, "mm_processor_kwargs": {"a": 1}}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer.from_dir(default_model_dir)


def _decode(cls, body: dict):
    return msgspec.json.decode(msgspec.json.encode(body), type=cls)


def _completion(extra: dict) -> CompletionRequest:
    return _decode(CompletionRequest, {"prompt": "hello", **extra})


def _chat(extra: dict) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "partial"}]
    return _decode(ChatCompletionRequest, {"messages": messages, **extra})


def _refused(request, field: str) -> bool:
    try:
        request.check_supported()
    except APIError as exc:
        assert exc.status_code == 400 and exc.param == field, (field, exc.param, str(exc))
        return True
    return False


def _params(request):
    return request.sampling_params() if isinstance(request, CompletionRequest) else request.sampling_params("none")


def _check_sampling_field(make, field: str) -> None:
    value, attribute = SAMPLING[field]
    extra = {field: value}
    if field in ("logprobs", "top_logprobs"):
        extra = {"logprobs": COMPLETION_LOGPROBS if make is _completion else CHAT_LOGPROBS}
        if field == "top_logprobs":
            extra["top_logprobs"] = 3
    request = make(extra)
    request.check_supported()
    changed = getattr(_params(request), attribute)
    assert changed != getattr(_params(make({})), attribute), f"{field} did not reach SamplingParams.{attribute}"


# Both run beam search (test_best_of_and_beam_search.py); length_penalty needs it.
BEAM_SEARCH = {"use_beam_search", "length_penalty"}


def _check_beam_search_fields(make) -> None:
    make({"use_beam_search": True, "length_penalty": 0.5, "n": 2}).check_supported()
    assert _refused(make({"length_penalty": 0.5}), "length_penalty")


@pytest.mark.parametrize("field", VLLM_COMPLETION_FIELDS)
def test_completion_field_is_implemented_or_refused(field):
    assert field in {f.name for f in msgspec.structs.fields(CompletionRequest)}, f"{field} is not declared"
    if field in BEAM_SEARCH:
        _check_beam_search_fields(_completion)
    elif field in REFUSED_VALUES:
        assert _refused(_completion({field: REFUSED_VALUES[field]}), field)
    elif field in SAMPLING:
        _check_sampling_field(_completion, field)
    elif field == "add_special_tokens":
        assert _completion({field: False}).add_special_tokens is False  # the route tokenizes: test_dropin_server.py
    else:
        assert field in OUTPUT, f"{field} is neither implemented nor refused"


@pytest.mark.parametrize("field", VLLM_CHAT_FIELDS)
def test_chat_field_is_implemented_or_refused(field, tokenizer):
    assert field in {f.name for f in msgspec.structs.fields(ChatCompletionRequest)}, f"{field} is not declared"
    if field in BEAM_SEARCH:
        _check_beam_search_fields(_chat)
    elif field in REFUSED_VALUES:
        assert _refused(_chat({field: REFUSED_VALUES[field]}), field)
    elif field in SAMPLING:
        _check_sampling_field(_chat, field)
    elif field in TEMPLATE:
        base = {"chat_template": PROBE_TEMPLATE}
        extra = {field: TEMPLATE[field]}
        if field == "continue_final_message":
            extra["add_generation_prompt"] = False
            base["add_generation_prompt"] = False
        request = _chat({**base, **extra})
        request.check_supported()
        rendered = chat_prompt(request, tokenizer, None, "auto")
        assert rendered != chat_prompt(_chat(base), tokenizer, None, "auto"), f"{field} did not reach the template"
    elif field == "add_special_tokens":
        request = _chat({field: True, "chat_template": PROBE_TEMPLATE})
        text = tokenizer.apply_chat_template([m for m in ({"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": "partial"})],
                                             chat_template=PROBE_TEMPLATE)
        assert chat_prompt(request, tokenizer, None, "auto") == tokenizer.encode(text, add_special_tokens=True)
    else:
        assert field in OUTPUT, f"{field} is neither implemented nor refused"


@pytest.mark.parametrize("field, value", OPENAI_CHAT_REFUSED.items())
def test_openai_chat_fields_that_change_the_answer_are_refused(field, value):
    try:
        request = _chat({field: value, "add_generation_prompt": False})
    except msgspec.ValidationError as exc:  # a value outside the field's type (the server's 400 names it)
        assert f"$.{field}" in str(exc)
        return
    assert _refused(request, field)


@pytest.mark.parametrize("field, value", OPENAI_CHAT_ACCEPTED.items())
def test_openai_chat_fields_that_cannot_change_the_answer_are_accepted(field, value):
    assert not _refused(_chat({field: value, "add_generation_prompt": False}), field)


@pytest.mark.parametrize("field", VLLM_EMBEDDING_FIELDS)
def test_embedding_field_is_declared_and_chat_forms_refused(field):
    assert field in {f.name for f in msgspec.structs.fields(EmbeddingRequest)}, f"{field} is not declared"
    if field in EMBEDDING_REFUSED:
        request = _decode(EmbeddingRequest, {field: EMBEDDING_REFUSED[field]})
        with pytest.raises(APIError) as exc:
            request.inputs()
        assert exc.value.param == field


def test_continue_final_message_needs_the_assistant_last_and_no_generation_prompt():
    assert _refused(_chat({"continue_final_message": True}), "continue_final_message")
    user_last = _decode(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                                "continue_final_message": True, "add_generation_prompt": False})
    assert _refused(user_last, "continue_final_message")


@pytest.mark.parametrize("make", [_completion, _chat])
def test_best_of_below_n_or_streamed_above_n_is_refused(make):
    assert _refused(make({"n": 3, "best_of": 2}), "best_of")
    assert _refused(make({"n": 1, "best_of": 2, "stream": True}), "best_of")
    make({"n": 2, "best_of": 2, "stream": True}).check_supported()
