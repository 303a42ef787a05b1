"""Structured output after reasoning end to end: the real engine on a random-weight Qwen3 whose
tokenizer has `<think>` and `</think>` as single tokens.

The weights are nearly flat (initializer_range 0.02), so biases drive the reasoning deterministically:
"Hello" (+60) wins until the frequency penalty (2 per use) brings it under `</think>` (+55), after
a few of them. "Hello" is a token no JSON object starts with, so those tokens were sampled free."""
import json

import jsonschema
import pytest
from corectl import LLM, SamplingParams
from corectl.sampling_params import ReasoningGate, StructuredOutputsParams
from corectl.structured.reasoning import reasoning_gate
from support.models import build_random_checkpoint, save_think_tokenizer

START, END, EOS = 49152, 49153, 2
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
THINKING = "<|im_start|>user\nIs it ok?<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    tokenizer = save_think_tokenizer(default_model_dir, tmp_path_factory.mktemp("think-tokenizer"))
    return build_random_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3-think"), tokenizer, seed=5,
                                   vocab_size=49280, initializer_range=0.02)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", kv_cache_memory_gib=0.05)


def hello(llm):
    (token,) = llm.get_tokenizer().encode("Hello", add_special_tokens=False)
    return token


def params(llm, gate, **extra):
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, reasoning=gate)
    return SamplingParams(temperature=0.0, max_tokens=48, logit_bias={hello(llm): 60.0, END: 55.0},
                          frequency_penalty=2.0, structured_outputs=spec, **extra)


def split(sample):
    """(reasoning token ids, answer text) of an output that closed its reasoning."""
    at = sample.token_ids.index(END)
    return sample.token_ids[:at], sample.text.split("</think>", 1)[1]


def test_the_grammar_starts_after_the_reasoning_ends(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(THINKING, add_special_tokens=False)
    gate = reasoning_gate(tokenizer, prompt)
    assert gate == ReasoningGate(start=START, end=END, thinking=True)
    (out,) = llm.generate([prompt], params(llm, gate, n=2), use_tqdm=False)
    for sample in out.outputs:
        reasoning, answer = split(sample)
        assert reasoning and set(reasoning) == {hello(llm)}  # free tokens, which the grammar forbids
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(answer), SCHEMA)
    # Without the gate the same biases meet the grammar from the first token.
    (ungated,) = llm.generate([prompt], params(llm, None), use_tqdm=False)
    assert hello(llm) not in ungated.outputs[0].token_ids and END not in ungated.outputs[0].token_ids
    jsonschema.validate(json.loads(ungated.outputs[0].text), SCHEMA)


def test_an_output_may_open_its_reasoning_or_answer_at_once(llm):
    prompt = llm.get_tokenizer().encode("<|im_start|>assistant\n", add_special_tokens=False)
    gate = ReasoningGate(start=START, end=END)
    # "<think>" beats what the grammar allows first, never "Hello" or "</think>" (the grammar forbids those).
    opens = params(llm, gate)
    opens.logit_bias[START] = 50.0
    answers = params(llm, gate)
    answers.logit_bias[START] = -50.0
    opened, answered = llm.generate([prompt, prompt], [opens, answers], use_tqdm=False)
    reasoning, answer = split(opened.outputs[0])
    assert reasoning[0] == START and set(reasoning[1:]) == {hello(llm)}
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert answered.outputs[0].token_ids[0] != START
    jsonschema.validate(json.loads(answered.outputs[0].text), SCHEMA)


def test_min_tokens_holds_while_thinking(llm):
    prompt = llm.get_tokenizer().encode(THINKING, add_special_tokens=False)
    eager = params(llm, ReasoningGate(end=END, thinking=True), min_tokens=2)
    eager.logit_bias[EOS] = 80.0  # the stop token would come first
    (out,) = llm.generate([prompt], eager, use_tqdm=False)
    assert out.outputs[0].token_ids == [hello(llm), hello(llm), EOS] and out.outputs[0].finish_reason == "stop"


def test_async_scheduling_and_preemption_keep_the_gated_outputs(llm, model_dir):
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(THINKING + "x" * i, add_special_tokens=False) for i in range(8)]
    batch = [params(llm, ReasoningGate(end=END, thinking=True)) for _ in prompts]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, batch, use_tqdm=False)]
    small = LLM(str(model_dir), dtype="float32", async_scheduling=True, max_model_len=96,
                kv_cache_memory_gib=0.00008, max_num_batched_tokens=32)
    outputs = small.generate(prompts, batch, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert small.engine.scheduler.make_stats().num_preemptions > 0
