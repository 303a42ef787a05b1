"""The offline API takes vLLM's prompt forms and chat options on the embedded SmolLM2 (its default 4-bit
CPU path: prompt forms are compared with each other)."""
import pytest

from corectl import SamplingParams
from corectl.errors import InvalidRequestError


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, **kw)


def test_prompt_dicts_give_the_tokens_of_their_plain_forms(llm_int4):
    text = "The capital of France is"
    ids = llm_int4.get_tokenizer().encode(text)
    plain = llm_int4.generate([text, ids], greedy(), use_tqdm=False)
    dicts = llm_int4.generate([{"prompt": text}, {"prompt_token_ids": ids}], greedy(), use_tqdm=False)
    single = llm_int4.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert single[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    assert dicts[0].prompt == text and dicts[1].prompt_token_ids == ids


@pytest.mark.parametrize("prompt,message", [
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"prompt": "a", "multi_modal_data": {}}, "'multi_modal_data'"),
    ({"prompt": 5}, "'prompt' must be a string, not int"),
    ([1, "2"], "not a list holding int, str"),
    ([1.5, 2.0], "not a list holding float"),
    ({"prompt_token_ids": [True]}, "not a list holding bool"),
    (3.0, "not float"),
])
def test_malformed_prompts_are_refused_with_a_clear_error(llm_int4, prompt, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        llm_int4.generate([prompt], greedy(), use_tqdm=False)
    assert err.value.param == "prompt"
    assert not llm_int4.engine.has_unfinished_requests()


def test_chat_passes_tools_and_template_variables_to_the_template(llm_int4):
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                "{% if mood %}mood: {{ mood }}\n{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conversation = [{"role": "user", "content": "Hi"}]
    (out,) = llm_int4.chat(conversation, greedy(), use_tqdm=False, chat_template=template, tools=tools,
                           chat_template_kwargs={"mood": "sunny"})
    assert out.prompt == "user: Hi\ntools: get_weather\nmood: sunny\nassistant:"


def test_chat_continues_the_final_message(llm_int4):
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
    (out,) = llm_int4.chat(conversation, greedy(), use_tqdm=False, add_generation_prompt=False,
                           continue_final_message=True)
    assert out.prompt.endswith("My answer is")
    with pytest.raises(InvalidRequestError, match="add_generation_prompt=False") as err:
        llm_int4.chat(conversation, greedy(), use_tqdm=False, continue_final_message=True)
    assert err.value.param == "continue_final_message"
