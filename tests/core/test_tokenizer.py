"""Tokenizer wrapper on SmolLM2's real tokenizer: encode/decode, special ids, chat templates."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from corectl.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from corectl.tokenizer import Tokenizer
from transformers import AutoTokenizer

SYSTEM_DEFAULT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "Émile a mangé une crème brûlée à Noël.",
    "日本語のテキストと中文文本",
    "emoji 😀👍🏽🇫🇷 and ZWJ 👩‍👩‍👧",
    "def f(x):\n\treturn x ** 2  # square\n\n\n",
    "<|im_start|>user\nliteral special tokens in text<|im_end|>",
]


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """transformers' own tokenizer of the embedded model: the reference and the source of the folder. Read
    from the loader's converted folder, whose tokenizer transformers wrote from the GGUF (test_loaders holds
    that equal to transformers' reading of the GGUF, which costs seconds of parsing per read); saved again
    it gives the same files as the GGUF's reading saved."""
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def tok_dir(reference, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    reference.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture
def no_template_dir(tok_dir, tmp_path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(tok, reference, text):
    ids = tok.encode(text)
    assert ids == reference.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens(tok):
    assert tok.eos_token_id == 2 and tok.convert_ids_to_tokens([2]) == ["<|im_end|>"]
    assert tok.bos_token_id == 1 and tok.convert_ids_to_tokens([1]) == ["<|im_start|>"]
    assert set(tok.all_special_ids) == {0, 1, 2}
    assert tok.vocab_size == 49152
    ids = [1] + tok.encode("user\nhi", add_special_tokens=False) + [2]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_unknown_ids_decode_to_nothing(tok):
    # A model's embedding may have more rows than the tokenizer has tokens (padding for kernels).
    assert tok.decode([tok.vocab_size + 7] + tok.encode("ok")) == "ok"


def test_chat_template_renders_chatml(tok, reference):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages)
    assert text == (SYSTEM_DEFAULT + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.encode_chat(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.eos_token_id) == 2


def test_multi_turn_with_system(tok):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_text_parts_render_like_a_string(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    null = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert "<|im_start|>assistant\n<|im_end|>" in tok.apply_chat_template(null, add_generation_prompt=False)


# Renders a string content as S:<text>, a list of parts as P:<text> (or P:<image>) per part.
PARTS_TEMPLATE = ("{% for m in messages %}{% if m.content is string %}S:{{ m.content }}{% else %}"
                  "{% for p in m.content %}P:{{ p.text if p.type == 'text' else '<image>' }}{% endfor %}"
                  "{% endif %};{% endfor %}")


@pytest.mark.parametrize("content_format, expected", [
    ("auto", "S:first\nsecond;S:plain;S:;"),
    ("string", "S:first\nsecond;S:plain;S:;"),
    ("openai", "P:firstP:second;P:plain;;"),
])
def test_content_formats_give_templates_strings_or_parts(tok, content_format, expected):
    messages = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
                {"role": "assistant", "content": "plain"}, {"role": "user", "content": None}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False, chat_template=PARTS_TEMPLATE,
                                   content_format=content_format) == expected


def test_images_need_a_content_format_that_carries_parts(tok):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}},
                                          {"type": "text", "text": "what is it?"}]}]
    for content_format in ("auto", "openai"):
        assert tok.apply_chat_template(image, add_generation_prompt=False, chat_template=PARTS_TEMPLATE,
                                       content_format=content_format) == "P:<image>P:what is it?;"
    with pytest.raises(InvalidRequestError, match="--chat-template-content-format auto or openai"):
        tok.apply_chat_template(image, chat_template=PARTS_TEMPLATE, content_format="string")
    with pytest.raises(ConfigError, match="chat_template_content_format"):
        tok.apply_chat_template(image, chat_template=PARTS_TEMPLATE, content_format="parts")


@pytest.mark.parametrize("content", [
    [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}, {"type": "input_audio"}],
    [{"type": "text"}],
    ["bare string part"],
    42,
])
def test_unsupported_content_is_a_request_error(tok, content):
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content") as info:
        tok.apply_chat_template([{"role": "user", "content": content}])
    assert info.value.param == "messages"


def test_message_must_be_an_object(tok):
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}, "oops"])


def test_missing_template_is_a_request_error(no_template_dir):
    bare = Tokenizer.from_dir(no_template_dir)
    assert bare.chat_template is None
    with pytest.raises(InvalidRequestError, match="has no chat template.*--chat-template") as info:
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.param == "messages"
    assert bare.encode("still encodes") == Tokenizer.from_dir(no_template_dir).encode("still encodes")


def test_template_override_string_and_file(no_template_dir, tok_dir, tmp_path_factory):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    inline = Tokenizer.from_dir(no_template_dir, chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    assert inline.apply_chat_template(messages) == "[user] hi\n"
    path = tmp_path_factory.mktemp("templates") / "plain.jinja"
    path.write_text(template)
    assert Tokenizer.from_dir(tok_dir, chat_template=str(path)).apply_chat_template(messages) == "[user] hi\n"


def test_template_override_bad_path(tok_dir):
    with pytest.raises(ConfigError, match="chat_template.*neither a Jinja template nor a readable file"):
        Tokenizer.from_dir(tok_dir, chat_template="/nonexistent/template.jinja")


def test_per_call_template_tools_and_kwargs(tok):
    template = ("{% for t in tools %}<tool>{{ t['function']['name'] }}</tool>{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    shout = tok.apply_chat_template(messages, tools=tools, chat_template=template, template_kwargs={"shout": True})
    assert shout == "<tool>get_weather</tool>hi!"
    assert tok.apply_chat_template(messages, chat_template=template, tools=[]) == "hi"
    # The model's own template is untouched by a per-call one.
    assert tok.apply_chat_template(messages).startswith(SYSTEM_DEFAULT)


def test_template_error_is_a_request_error(tok):
    template = ("{% if messages[0]['role'] != 'system' %}"
                "{{ raise_exception('first message must be system') }}{% endif %}")
    with pytest.raises(InvalidRequestError, match="first message must be system"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template)


def test_missing_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="cannot load a tokenizer"):
        Tokenizer.from_dir(tmp_path)
