"""The served model's tokenizer: encoding, decoding and chat templates, loaded from an HF-style directory.

transformers' fast tokenizer does the work; its Rust `tokenizers.Tokenizer` is kept at hand because
decoding goes straight through it, so `decode` is exactly the text the incremental detokenizer streams.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from transformers import AutoTokenizer

from .errors import ConfigError, InvalidRequestError, ModelNotFoundError


class Tokenizer:
    """Encode, decode and render chat templates for one model.

        tok = Tokenizer.from_dir("path/to/hf_dir")
        ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
        text = tok.decode(ids)
    """

    def __init__(self, hf_tokenizer: Any, path: str):
        if not hasattr(hf_tokenizer, "backend_tokenizer"):
            raise ModelNotFoundError(
                f"{path} holds no fast tokenizer; corectl needs a tokenizer.json (save the tokenizer with "
                "transformers' fast tokenizer to create one)")
        self.hf = hf_tokenizer
        self.backend_tokenizer: tokenizers.Tokenizer = hf_tokenizer.backend_tokenizer
        self.path = path

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], chat_template: str | None = None) -> Tokenizer:
        """Load from a folder holding tokenizer.json / tokenizer_config.json.

        `chat_template`, a Jinja template or the path of a file holding one, replaces the model's own.
        """
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise ModelNotFoundError(f"tokenizer folder {str(folder)!r} does not exist")
        try:
            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelNotFoundError(f"cannot load a tokenizer from {str(folder)!r} (point --tokenizer at a folder "
                                     f"with tokenizer.json and tokenizer_config.json): {exc}") from exc
        if chat_template is not None:
            hf.chat_template = _read_template(chat_template)
        return cls(hf, str(folder))

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (the model may have more rows)."""
        return len(self.hf)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return self.hf.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids the tokenizer does not know (the model's vocabulary may be larger) decode to nothing."""
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            **template_kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on.

        Message content may be a string or a list of OpenAI text parts. `chat_template` (a Jinja
        string, never a path: requests must not read server files) replaces the model's template for
        this call; `template_kwargs` reach the template as variables (e.g. `enable_thinking`).
        """
        if chat_template is None and self.hf.chat_template is None:
            raise InvalidRequestError(
                f"the model's tokenizer ({self.path}) has no chat template, so chat messages cannot be "
                "rendered; start corectl with --chat-template (a Jinja string or .jinja file) or send a "
                "plain prompt to the completions API", param="messages")
        try:
            return self.hf.apply_chat_template(
                _normalise_messages(messages), tools=tools, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the chat template cannot render these messages: {exc}",
                                      param="messages") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, chat_template: str | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered conversation; the template writes its own special tokens."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, chat_template, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _read_template(value: str) -> str:
    # Every Jinja template that renders messages has a `{{` or `{%`; anything else must name a file.
    if "{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError("chat_template", f"{value!r} is neither a Jinja template nor a readable file")
    return path.read_text(encoding="utf-8")


def _normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Templates concatenate `content` as a string; flatten OpenAI text parts and a null content."""
    out: list[Mapping[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object with 'role' and 'content'",
                                      param="messages")
        content = message.get("content")
        out.append(message if isinstance(content, str) else {**message, "content": _content_text(content, i)})
    return out


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if not isinstance(content, list):
        raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts",
                                  param="messages")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                f"got {kind!r}", param="messages")
        texts.append(part["text"])
    # Parts are separate paragraphs of one message, as vLLM renders them.
    return "\n".join(texts)
