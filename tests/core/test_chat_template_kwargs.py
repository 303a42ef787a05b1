"""chat_template_kwargs (issue 27, defect 2): names the renderer sets are refused up front, and whatever
the template raises because of the request's variables is an InvalidRequestError naming them."""
import pytest
from corectl.errors import InvalidRequestError
from corectl.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
# A template that uses its variables the way real ones do: as numbers, mappings and callables.
TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if budget is defined %}{{ budget + 1 }}{% endif %}"
            "{% if opts is defined %}{{ opts['level'] }}{% endif %}"
            "{% if first_message_must_be_system and messages[0]['role'] != 'system' %}"
            "{{ raise_exception('first message must be system') }}{% endif %}")


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.mark.parametrize("name", ["tools", "messages", "conversation", "tokenize", "add_generation_prompt",
                                  "continue_final_message", "chat_template", "return_dict", "eos_token", "bos_token"])
def test_reserved_names_are_refused_before_rendering(tok, name):
    with pytest.raises(InvalidRequestError, match=f"chat_template_kwargs may not set {name}") as err:
        tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, template_kwargs={name: "x"})
    assert err.value.param == "chat_template_kwargs"


def test_every_renderer_argument_is_reserved(tok):
    import inspect

    own = {p.name for p in inspect.signature(tok.hf.apply_chat_template).parameters.values()
           if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    assert own <= tok.reserved_template_kwargs()


@pytest.mark.parametrize("kwargs", [
    {"budget": "ten"},  # str + int: TypeError
    {"budget": [1]},
    {"budget": None},
    {"raise_exception": "not callable", "first_message_must_be_system": True},
])
def test_what_the_template_raises_on_the_variables_names_them(tok, kwargs):
    with pytest.raises(InvalidRequestError) as err:
        tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, template_kwargs=kwargs)
    assert err.value.param == "chat_template_kwargs", str(err.value)
    assert "chat_template_kwargs" in str(err.value)


def test_a_failure_of_the_messages_still_names_the_messages(tok):
    with pytest.raises(InvalidRequestError, match="first message must be system") as err:
        tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE,
                                template_kwargs={"first_message_must_be_system": True, "budget": 1})
    assert err.value.param == "chat_template_kwargs"  # without the variable the check does not run
    with pytest.raises(InvalidRequestError) as err:
        tok.apply_chat_template([{"role": "user", "content": {"not": "text"}}], chat_template=TEMPLATE,
                                template_kwargs={"budget": 1})
    assert err.value.param == "messages"


def test_good_variables_reach_the_template(tok):
    text = tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, template_kwargs={"budget": 1, "opts": {"level": 3}})
    assert text == "hi23"
