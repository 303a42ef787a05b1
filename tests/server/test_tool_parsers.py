"""Tool and reasoning parsers on the text real models write, whole and streamed token by token (the
text cut where the embedded SmolLM2 tokenizer cuts it, as the server's detokenizer would stream it),
and their discovery through the plugin hooks."""
from __future__ import annotations

import json

import pytest
from corectl.errors import ConfigError
from corectl.server.http.parsers import reasoning_parser_class, tool_parser_class
from corectl.server.http.reasoning.builtin import (DeepSeekR1ReasoningParser, HarmonyReasoningParser,
                                                 Qwen3ReasoningParser)
from corectl.server.http.tool_parsers.builtin import (HarmonyToolParser, HermesToolParser, Llama3JsonToolParser,
                                                     MistralToolParser)
from corectl.server.http.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from corectl.tokenizer import Tokenizer

# What Qwen2.5/Qwen3 write with their chat template's tool instructions (hermes format).
QWEN_TWO_CALLS = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                  '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                  '{"timezone": "Europe/Paris", "note": "say \\"hi\\" } {"}}\n</tool_call>')
QWEN_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}),
              ("get_time", {"timezone": "Europe/Paris", "note": 'say "hi" } {'})]
# Llama 3.1 with its JSON tool prompt, and with the built-in python tag; several calls joined by ";".
LLAMA_CALLS = ('{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}; '
               '{"name": "get_time", "parameters": {}}')
LLAMA_TAGGED = '<|python_tag|>{"name": "search", "parameters": {"query": "corectl"}}'
# Mistral 7B Instruct v0.3: [TOOL_CALLS] then a JSON array; arguments before the name happen too.
MISTRAL_CALLS = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"arguments": {"timezone": "UTC"}, "name": "get_time"}]')


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer.from_dir(default_model_dir)


def token_pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """`text` as streamed: the new text after each token (an undecodable partial character waits)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, sent = [], ""
    for end in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:end])
        if not decoded.endswith("\ufffd"):
            pieces.append(decoded[len(sent):])
            sent = decoded
    assert sent == text
    return pieces


def streamed(parser, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """Feed the pieces one at a time and assemble what the client would: content, and each call
    from its deltas (name in the first delta of an index, argument fragments concatenated)."""
    content, calls, ids = "", {}, {}
    for i, piece in enumerate(pieces + [""]):
        text, deltas = parser.feed(piece, final=i == len(pieces))
        content += text
        for delta in deltas:
            if delta.id is not None:
                assert delta.index not in calls and delta.function.name and delta.type == "function"
                ids[delta.index] = delta.id
                calls[delta.index] = [delta.function.name, ""]
            else:
                assert delta.function.name is None
            calls[delta.index][1] += delta.function.arguments or ""
    assert all(i.startswith("call_") for i in ids.values()) and len(set(ids.values())) == len(ids)
    return content, [(name, json.loads(arguments)) for name, arguments in (calls[i] for i in sorted(calls))]


def whole(parser, text: str) -> tuple[str, list[tuple[str, dict]] | None]:
    content, _ = parser.feed(text, final=True)
    calls = parser.result()
    return content, None if calls is None else [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("cls, text, content, calls", [
    (HermesToolParser, QWEN_TWO_CALLS, "I will look both up.\n", QWEN_CALLS),
    (Llama3JsonToolParser, LLAMA_CALLS, "", [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]),
    (Llama3JsonToolParser, LLAMA_TAGGED, "", [("search", {"query": "corectl"})]),
    (MistralToolParser, MISTRAL_CALLS, "", [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})]),
], ids=["hermes", "llama3_json", "llama3_python_tag", "mistral"])
def test_parsers_find_calls_whole_and_streamed_alike(tokenizer, cls, text, content, calls):
    assert whole(cls(tokenizer), text) == (content, calls)
    assert streamed(cls(tokenizer), token_pieces(tokenizer, text)) == (content, calls)
    assert streamed(cls(tokenizer), list(text)) == (content, calls)  # one character at a time


@pytest.mark.parametrize("cls", [HermesToolParser, Llama3JsonToolParser, MistralToolParser])
def test_plain_answers_stay_content(tokenizer, cls):
    text = "The weather in Paris is sunny, 22 degrees. Use a <tool> or [TOOLS] if {needed}."
    assert whole(cls(tokenizer), text) == (text, None)
    assert streamed(cls(tokenizer), token_pieces(tokenizer, text)) == (text, [])


def test_a_call_cut_short_is_no_call(tokenizer):
    """A call the length limit cut (its arguments do not parse) leaves the text as the answer."""
    parser = HermesToolParser(tokenizer)
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, _ = parser.feed(text, final=True)
    assert content == "Sure.\n" and parser.result() is None


def test_a_marker_split_across_tokens_is_held_back(tokenizer):
    parser = HermesToolParser(tokenizer)
    assert parser.feed("Checking <tool", final=False) == ("Checking ", [])
    content, deltas = parser.feed('_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', final=True)
    assert content == "" and [(d.function.name, d.function.arguments) for d in deltas] == [("f", '{"a": 1}')]


def test_forced_required_calls_stream_and_parse(tokenizer):
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    assert whole(RequiredCallsParser(tokenizer), text) == ("", [("get_weather", {"city": "Paris"}),
                                                                ("get_time", {})])
    assert streamed(RequiredCallsParser(tokenizer), token_pieces(tokenizer, text))[1][0] == ("get_weather",
                                                                                          {"city": "Paris"})


def test_forced_named_call_is_the_whole_output(tokenizer):
    text = '{"city": "Paris", "days": 3}'
    assert whole(NamedCallParser("get_weather"), text) == ("", [("get_weather", {"city": "Paris", "days": 3})])
    assert streamed(NamedCallParser("get_weather"), token_pieces(tokenizer, text)) == (
        "", [("get_weather", {"city": "Paris", "days": 3})])
    assert NamedCallParser("f").result() is None


def reasoning_streamed(parser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for i, piece in enumerate(pieces + [""]):
        r, c = parser.feed(piece, final=i == len(pieces))
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("cls, text, expected", [
    # Qwen3 with thinking on opens <think> itself, and ends it with a blank line before the answer.
    (Qwen3ReasoningParser, "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     ("\nThe user wants 2+2. That is 4.\n", "The answer is 4.")),
    # Thinking off (enable_thinking false): no tag, all content.
    (Qwen3ReasoningParser, "The answer is 4.", ("", "The answer is 4.")),
    # Cut inside the reasoning: all of it is reasoning.
    (Qwen3ReasoningParser, "<think>\nLet me count: 1, 2", ("\nLet me count: 1, 2", "")),
    # DeepSeek-R1's template opens <think> in the prompt: the output starts inside the reasoning.
    (DeepSeekR1ReasoningParser, "Okay, 2+2 is 4.\n</think>\n\n**4**", ("Okay, 2+2 is 4.\n", "**4**")),
    (DeepSeekR1ReasoningParser, "<think>\nHmm.\n</think>\n\n4", ("\nHmm.\n", "4")),
    (DeepSeekR1ReasoningParser, "Still thinking", ("Still thinking", "")),
])
def test_reasoning_parsers_split_think_whole_and_streamed(tokenizer, cls, text, expected):
    assert cls(tokenizer).feed(text, final=True) == expected
    assert reasoning_streamed(cls(tokenizer), token_pieces(tokenizer, text)) == expected
    assert reasoning_streamed(cls(tokenizer), list(text)) == expected


@pytest.mark.parametrize("cls, thinking, text, expected", [
    # A template that opened <think> in the prompt: Qwen3's parser starts inside the reasoning too.
    (Qwen3ReasoningParser, True, "Hmm.\n</think>\n\n{}", ("Hmm.\n", "{}")),
    # A prompt that closed an empty think block: DeepSeek-R1's output is then all content.
    (DeepSeekR1ReasoningParser, False, "{}</think>", ("", "{}</think>")),
])
def test_reasoning_parsers_start_where_the_prompt_left_them(tokenizer, cls, thinking, text, expected):
    for pieces in ([text], token_pieces(tokenizer, text), list(text)):
        parser = cls(tokenizer)
        parser.begin(thinking)
        assert reasoning_streamed(parser, pieces) == expected


def test_parsers_are_found_through_the_plugin_hooks():
    assert tool_parser_class("hermes") is HermesToolParser
    assert tool_parser_class("llama3_json") is Llama3JsonToolParser
    assert tool_parser_class("mistral") is MistralToolParser
    assert reasoning_parser_class("qwen3") is Qwen3ReasoningParser
    assert reasoning_parser_class("deepseek_r1") is DeepSeekR1ReasoningParser
    # vLLM's names for gpt-oss's harmony channels (launch commands pass them).
    assert tool_parser_class("openai") is HarmonyToolParser
    assert reasoning_parser_class("openai_gptoss") is HarmonyReasoningParser
    with pytest.raises(ConfigError, match="unknown tool parser 'nope'; registered: hermes, llama3_json, mistral, "
                                          "openai"):
        tool_parser_class("nope")
    with pytest.raises(ConfigError, match="unknown reasoning parser"):
        reasoning_parser_class("nope")
