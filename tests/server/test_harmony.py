"""The harmony format of gpt-oss: rendering against openai-harmony's own expected renderings (its
repository's `test-data`, Apache-2.0: the library's encoding needs the o200k vocabulary, which it
downloads, so its rendered text is pinned here), the channel parser whole and streamed on harmony
outputs as its format document writes them, and one server on a small random gpt-oss whose prompt
tokens are the served tokenizer's encoding of that rendering."""
from __future__ import annotations

import openai
import pytest
from corectl.server.http.harmony import render_chat, today
from corectl.server.http.harmony_output import HarmonyText
from support.server import API_KEY, ServerProcess

SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
          "Knowledge cutoff: 2024-06\n{date}\nReasoning: {effort}\n\n# Valid channels: analysis, commentary, final. "
          "Channel must be included for every message.{calls}<|end|>")
# test-data/test_simple_convo_low_effort.txt
LOW_EFFORT = (SYSTEM.format(date="", effort="low", calls="") + "<|start|>developer<|message|># Instructions\n\n"
              "Answer the user's questions like a robot.<|end|><|start|>user<|message|>What is the capital of the "
              "largest country in the world?<|end|><|start|>assistant")
# test-data/test_render_functions_with_parameters.txt
FUNCTIONS = (SYSTEM.format(date="Current date: 2025-06-28\n", effort="high",
                           calls="\nCalls to these tools must go to the commentary channel: 'functions'.")
             + """<|start|>developer<|message|># Instructions

Always respond in riddles

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// A function with various complex schemas.
type kitchensink = (_: // params object
{
// STRING
//
// A string
// Examples:
// - "hello"
// - "world"
string?: string,
// A nullable string
string_nullable?: string | null, // default: "the default"
string_enum?: "a" | "b" | "c",
// a oneof
// default: 20
oneof_string_or_number?:
 | string // default: "default_string_in_oneof"
 | number // numbers can happen too
,
}) => any;

} // namespace functions<|end|><|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant""")
FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
TOOLS = [{"type": "function", "function": f} for f in [
    {"name": "get_location", "description": "Gets the location of the user."},
    {"name": "get_current_weather", "description": "Gets the current weather in the provided location.",
     "parameters": {"type": "object", "required": ["location"], "properties": {
         "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
         "format": FORMAT}}},
    {"name": "get_multiple_weathers", "description": "Gets the current weather in the provided list of locations.",
     "parameters": {"type": "object", "required": ["locations"], "properties": {
         "locations": {"type": "array", "items": {"type": "string"},
                       "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]'},
         "format": FORMAT}}},
    {"name": "kitchensink", "description": "A function with various complex schemas.", "parameters": {
        "description": "params object", "type": "object", "properties": {
            "string": {"type": "string", "title": "STRING", "description": "A string", "examples": ["hello", "world"]},
            "string_nullable": {"type": "string", "nullable": True, "description": "A nullable string",
                                "default": "the default"},
            "string_enum": {"type": "string", "enum": ["a", "b", "c"]},
            "oneof_string_or_number": {"oneOf": [{"type": "string", "default": "default_string_in_oneof"},
                                                 {"type": "number", "description": "numbers can happen too"}],
                                       "description": "a oneof", "default": 20}}}}]]
# docs/format.md's examples of what the model writes after `<|start|>assistant`.
REASONED = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
            "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.")
CALLED = ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>"
          'commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}')


def test_renders_as_openai_harmony():
    effort = [{"role": "system", "content": "Answer the user's questions like a robot."},
              {"role": "user", "content": "What is the capital of the largest country in the world?"}]
    assert render_chat(effort, None, "low", None) == LOW_EFFORT
    riddles = [{"role": "developer", "content": "Always respond in riddles"},
               {"role": "user", "content": "What is the weather like in SF?"}]
    assert render_chat(riddles, TOOLS, "high", "2025-06-28") == FUNCTIONS


def test_tool_calls_and_results_render_as_the_format_document_shows():
    history = [{"role": "user", "content": "Weather in SF?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "function": {"name": "get_weather", "arguments": '{"location":"San Francisco"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": '{"sunny": true, "temperature": 20}'}]
    rendered = render_chat(history, None, None, None)
    assert rendered.endswith(
        '<|start|>user<|message|>Weather in SF?<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
        '<|constrain|>json<|message|>{"location":"San Francisco"}<|call|><|start|>functions.get_weather to=assistant'
        '<|channel|>commentary<|message|>{"sunny": true, "temperature": 20}<|end|><|start|>assistant')


def _whole_and_streamed(text: str):
    whole = HarmonyText("assistant")
    whole.feed(text, final=True)
    streamed = HarmonyText("assistant")
    deltas = [streamed.feed(piece, final=False) for piece in text] + [streamed.feed("", final=True)]
    return whole.message()[0], streamed.message()[0], deltas


def test_channels_split_into_reasoning_content_and_calls():
    whole, streamed, deltas = _whole_and_streamed(REASONED)
    assert (whole.reasoning_content, whole.content, whole.tool_calls) == (
        'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", [])
    assert (streamed.reasoning_content, streamed.content) == (whole.reasoning_content, whole.content)
    assert "".join(d.content or "" for d in deltas) == "2 + 2 = 4."
    assert not any("<|" in (d.content or "") + (d.reasoning or "") for d in deltas)

    whole, streamed, deltas = _whole_and_streamed(CALLED)
    assert whole.content is None and whole.reasoning == "Need to use function get_weather."
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [
        ("get_weather", '{"location":"San Francisco"}')]
    pieces = [call for d in deltas for call in d.tool_calls or []]
    assert pieces[0].function.name == "get_weather" and pieces[0].id == streamed.tool_calls[0].id
    assert "".join(p.function.arguments for p in pieces) == '{"location":"San Francisco"}'
    # An output a grammar held from its first token has no header: all content.
    assert _whole_and_streamed('{"a": 1}')[0].content == '{"a": 1}'
    # Without a header, harmony's tokens the request kept for the parser never reach the client.
    whole, streamed, deltas = _whole_and_streamed("<|end|>plain<|message|> text<|end|>")
    assert whole.content == streamed.content == "plain text" and all("<|" not in (d.content or "") for d in deltas)


HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


@pytest.fixture(scope="module")
def gpt_oss_server(tmp_path_factory, default_model_dir):
    from support.arch_parity import save_random_model
    from transformers import AutoTokenizer, GptOssConfig

    folder = tmp_path_factory.mktemp("gpt-oss")
    config = GptOssConfig(vocab_size=49160, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=131072, bos_token_id=1,
                          eos_token_id=[49157, 49158], pad_token_id=0)
    save_random_model(config, folder, default_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})  # ids 49152..49158
    tokenizer.save_pretrained(folder)
    # vLLM's gpt-oss launch flags: the parsers they name read the harmony channels the chat reads anyway.
    # The rendering is the server's; its requests are plain ones, so the engine runs in the server's process.
    proc = ServerProcess(str(folder), "--api-key", API_KEY, "--dtype", "float32", "--kv-cache-memory", "0.02",
                         "--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "openai",
                         "--reasoning-parser", "openai_gptoss", "--engine-in-process").wait_ready(600)
    yield folder, proc
    assert proc.stop() == 0


def test_gpt_oss_chat_prompt_is_the_harmony_rendering(gpt_oss_server):
    from transformers import AutoTokenizer

    folder, proc = gpt_oss_server
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in SF?"}]
    tools = TOOLS[1:2]
    reply = client.chat.completions.create(model=str(folder), messages=messages, tools=tools, max_tokens=4,
                                           reasoning_effort="high", extra_body={"prompt_logprobs": 0})
    expected = AutoTokenizer.from_pretrained(folder).encode(
        render_chat(messages, tools, "high", today()), add_special_tokens=False)
    prompt = [None] + [int(next(iter(position))) for position in reply.model_extra["prompt_logprobs"][1:]]
    assert prompt[1:] == expected[1:] and reply.usage.prompt_tokens == len(expected)
    assert len(expected) > 150 and expected.count(49152) == 4  # system, developer, user, assistant
    chunks = list(client.chat.completions.create(model=str(folder), messages=messages, max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    # The Responses API's turns take the same path.
    response = client.responses.create(model=str(folder), input="Weather in SF?", instructions="Be brief.",
                                       max_output_tokens=4)
    assert response.status == "incomplete" and response.usage.input_tokens == len(
        AutoTokenizer.from_pretrained(folder).encode(render_chat(messages, None, None, today())))
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=str(folder), messages=messages, tools=tools, tool_choice="required")
    assert exc.value.body["param"] == "tool_choice"
