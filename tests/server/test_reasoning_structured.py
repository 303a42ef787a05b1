"""Structured output after reasoning through the HTTP server and the `openai` SDK: a random-weight
Qwen3 whose tokenizer has `<think>` and `</think>` as single tokens, served with the deepseek_r1
reasoning parser and a ChatML template that writes an empty think block when `enable_thinking` is
false (as Qwen3's does).

The weights are nearly flat, so biases drive the reasoning: "Hello" (+60) until the frequency
penalty brings it under `</think>` (+55). No JSON starts with "Hello", so the reasoning was free."""
from __future__ import annotations

import json

import jsonschema
import pytest
from support.models import build_random_checkpoint, save_think_tokenizer
from support.server import SMALL_ENGINE_FP32, ServerProcess

MODEL = "think"
HELLO, END = 19556, 49153
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
# Compact JSON: a random model left optional whitespace wanders into it.
COMPACT = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
TOOL = {"type": "function", "function": {"name": "check", "parameters": SCHEMA}}
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Is it ok?"}]
BIASED = dict(temperature=0, max_tokens=48, frequency_penalty=2.0, logit_bias={str(HELLO): 60, str(END): 55})


@pytest.fixture(scope="module")
def think_server(tmp_path_factory, default_model_dir):
    tokenizer = save_think_tokenizer(default_model_dir, tmp_path_factory.mktemp("think-tokenizer"))
    model = build_random_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3-think"), tokenizer, seed=5,
                                    vocab_size=49280, initializer_range=0.02)
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(TEMPLATE)
    proc = ServerProcess(str(model), *SMALL_ENGINE_FP32, "--served-model-name", MODEL, "--chat-template", str(template),
                         "--reasoning-parser", "deepseek_r1").wait_ready()
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(think_server):
    from openai import OpenAI

    return OpenAI(base_url=think_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def check_reasoning(text):
    assert text and set(text.split("Hello")) == {""}, text  # free tokens, which the grammar forbids


def test_a_constrained_output_thinks_first_whole_and_streamed(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, n=2, extra_body=COMPACT, **BIASED)
    for choice in out.choices:
        check_reasoning(choice.message.reasoning_content)
        assert choice.message.reasoning == choice.message.reasoning_content and choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, extra_body=COMPACT, stream=True, **BIASED))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == out.choices[0].message.reasoning
    assert "".join(d.content or "" for d in deltas) == out.choices[0].message.content


def test_forced_tool_calls_come_after_the_reasoning(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], **BIASED,
                                         tool_choice={"type": "function", "function": {"name": "check"}})
    message = out.choices[0].message
    check_reasoning(message.reasoning_content)
    (call,) = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None


def test_a_prompt_that_closed_the_reasoning_answers_at_once(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, **BIASED,
                                         extra_body={**COMPACT, "chat_template_kwargs": {"enable_thinking": False}})
    message = out.choices[0].message
    assert message.reasoning_content is None and "Hello" not in message.content
    jsonschema.validate(json.loads(message.content), SCHEMA)
    # Unconstrained, the parser reads the prompt the same way: the output is content, not reasoning.
    free = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=4,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert free.choices[0].message.reasoning_content is None and free.choices[0].message.content


def test_without_a_reasoning_parser_the_grammar_holds_from_the_first_token(openai_client, model_id):
    """The shared server (SmolLM2, no --reasoning-parser): the same biases cannot get past the grammar."""
    out = openai_client.chat.completions.create(model=model_id, messages=ASK, extra_body=COMPACT,
                                                **{**BIASED, "logit_bias": {str(HELLO): 60}})
    message = out.choices[0].message
    assert "Hello" not in message.content and message.model_extra.get("reasoning_content") is None
    jsonschema.validate(json.loads(message.content), SCHEMA)
