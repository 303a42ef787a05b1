"""Grammar-constrained generation end to end: the real engine, scheduler, worker and sampler on the
embedded SmolLM2 (its default 4-bit CPU path: the tests check the constraints and compare the engine
with itself) and on a random-weight Qwen3 (fp32) whose logits are wider than its tokenizer."""
import json
import re

import jsonschema
import pytest
from corectl import LLM, SamplingParams
from corectl.errors import InvalidRequestError
from corectl.sampling_params import StructuredOutputsParams
from support.models import CHAT_PROMPTS, build_random_checkpoint

SCHEMAS = {
    "nested": ({"type": "object", "properties": {"user": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                        "required": ["city"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False}, "Describe a user with a name and a city as JSON."),
    "enum": ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L"]}},
              "required": ["color", "size"], "additionalProperties": False}, "Pick a t-shirt color and size, as JSON."),
    "array": ({"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                           "minItems": 2, "maxItems": 4}},
               "required": ["fruits"], "additionalProperties": False}, "List some fruits as JSON."),
    "numbers": ({"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                                  "humidity": {"type": "integer", "minimum": 0, "maximum": 100}},
                 "required": ["temperature", "humidity"], "additionalProperties": False}, "Give today's weather as JSON."),
    "required": ({"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                                   "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                                   "rating": {"type": "number"}},
                  "required": ["title", "year"], "additionalProperties": False}, "Name a movie with its year as JSON."),
}
PHONE = r"\d{3}-\d{4}"
CITIES = ["Paris", "London", "Berlin"]
YES_NO = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"'


def chat(llm, question):
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)


def greedy(spec=None, **params):
    return SamplingParams(temperature=0.0, max_tokens=params.pop("max_tokens", 120), structured_outputs=spec, **params)


def constrained_batch(llm):
    """Every kind of constraint, plus the questions to ask."""
    jobs = [(q, greedy(StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
            for schema, q in SCHEMAS.values()]
    jobs += [("Give me a phone number.", greedy(StructuredOutputsParams(regex=PHONE))),
             ("What is the capital of France?", greedy(StructuredOutputsParams(choice=CITIES))),
             ("Is the sea salty?", greedy(StructuredOutputsParams(grammar=YES_NO))),
             ("Return a JSON object with a name and an age.",
              greedy(StructuredOutputsParams(json_object=True, disable_any_whitespace=True)))]
    return [chat(llm, q) for q, _ in jobs], [p for _, p in jobs]


def check_constrained(outputs):
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), [o.outputs[0].finish_reason for o in outputs]
    for (schema, _), text in zip(SCHEMAS.values(), texts):
        jsonschema.validate(json.loads(text), schema)
    phone, city, answer, obj = texts[len(SCHEMAS):]
    assert re.fullmatch(PHONE, phone) and city in CITIES
    assert answer in ("The answer is yes.", "The answer is no.")
    assert isinstance(json.loads(obj), dict)


@pytest.fixture(scope="module")
def constrained_outputs(llm_int4):
    """The constrained batch on the shared engine, synchronous: checked once, and the reference the
    async engine must reproduce."""
    prompts, params = constrained_batch(llm_int4)
    return llm_int4.generate(prompts, params, use_tqdm=False)


@pytest.mark.slow
def test_every_kind_of_constraint_holds(constrained_outputs):
    check_constrained(constrained_outputs)


@pytest.mark.slow
def test_free_requests_get_the_same_tokens_beside_constrained_ones(llm_int4):
    free = [chat(llm_int4, q) for q in CHAT_PROMPTS[:4]]
    alone = llm_int4.generate(free, greedy(max_tokens=24), use_tqdm=False)
    prompts, params = constrained_batch(llm_int4)
    mixed = llm_int4.generate(prompts + free, params + [greedy(max_tokens=24)] * len(free), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[len(prompts):]] == [o.outputs[0].token_ids for o in alone]
    check_constrained(mixed[:len(prompts)])


@pytest.mark.slow
def test_async_scheduling_and_preemption_keep_the_constrained_outputs(llm_int4, constrained_outputs):
    prompts, params = constrained_batch(llm_int4)
    expected = [o.outputs[0].token_ids for o in constrained_outputs]
    llm = LLM(async_scheduling=True, max_model_len=256, kv_cache_memory_gib=0.012, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.scheduler.make_stats().num_preemptions > 0
    assert not llm.engine.has_unfinished_requests()


def test_sampling_features_compose_with_a_grammar(llm_int4):
    schema, question = SCHEMAS["enum"]
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, presence_penalty=1.0, repetition_penalty=1.3,
                             logprobs=3, min_tokens=30, max_tokens=60, structured_outputs=spec)
    (out,) = llm_int4.generate(chat(llm_int4, question), sampled, use_tqdm=False)
    for sample in out.outputs:
        # min_tokens cannot outlast the grammar: the object ends when the grammar does.
        assert sample.finish_reason == "stop" and len(sample.token_ids) < 30
        jsonschema.validate(json.loads(sample.text), schema)
        chosen = [next(iter(position.values())).logprob for position in sample.logprobs]
        assert all(lp > float("-inf") for lp in chosen)
    cut = greedy(StructuredOutputsParams(regex=PHONE), stop=["-"])
    (out,) = llm_int4.generate(chat(llm_int4, "Give me a phone number."), cut, use_tqdm=False)
    assert re.fullmatch(r"\d{3}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"


def test_bad_grammars_are_refused_before_the_engine_naming_the_field(llm_int4):
    for spec, param in [(StructuredOutputsParams(json={"type": "objectx"}), "structured_outputs.json"),
                        (StructuredOutputsParams(regex="(abc"), "structured_outputs.regex"),
                        (StructuredOutputsParams(grammar="root ::= "), "structured_outputs.grammar")]:
        with pytest.raises(InvalidRequestError) as err:
            llm_int4.generate("Hi", greedy(spec), use_tqdm=False)
        assert err.value.param == param
    assert not llm_int4.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, default_model_dir):
    # Logits wider than the tokenizer (49152): the padding tokens must never be sampled.
    return build_random_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), default_model_dir, seed=3,
                                   vocab_size=49280)


def test_a_random_weight_model_still_writes_valid_json(qwen3_dir):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    llm = LLM(str(qwen3_dir), dtype="float32", kv_cache_memory_gib=0.05)
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = [greedy(spec, max_tokens=40), SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs=spec)]
    for out in llm.generate(["Hello", "Write JSON"], params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop" and max(out.outputs[0].token_ids) < 49152
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_a_grammar_that_overruns_the_compile_bound_ends_its_request_alone(qwen3_dir):
    llm = LLM(str(qwen3_dir), dtype="float32", kv_cache_memory_gib=0.05, structured_outputs_compile_timeout=1e-9)
    late, free = llm.generate(["Hello", "Hello"], [greedy(StructuredOutputsParams(json_object=True)),
                                                     greedy(max_tokens=5)], use_tqdm=False)
    assert late.outputs[0].finish_reason == "abort" and late.outputs[0].token_ids == []
    assert "structured_outputs.json_object took longer than" in late.outputs[0].error
    assert free.outputs[0].finish_reason == "length" and free.outputs[0].error is None
