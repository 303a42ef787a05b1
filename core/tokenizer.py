"""The served model's tokenizer: encoding, decoding and chat templates, loaded from an HF-style directory.

transformers' fast tokenizer does the work; its Rust `tokenizers.Tokenizer` is kept at hand because
decoding goes straight through it, so `decode` is exactly the text the incremental detokenizer streams.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from transformers import TokenizersBackend

from .errors import ConfigError, InvalidRequestError, ModelNotFoundError
from .chat_content import normalise_messages

# Model types for which AutoTokenizer loads a folder whose tokenizer_config.json names
# TokenizersBackend as that class itself (tests/core/test_tokenizer_direct_load.py checks it; qwen2 is
# not one: AutoTokenizer overrides its hub class with Qwen2Tokenizer). Those folders, the embedded
# SmolLM2's among them, load without AutoTokenizer, which imports transformers' config classes and
# torch: seconds of CPU in an API process that needs neither.
DIRECT_MODEL_TYPES = frozenset({"llama", "qwen3"})


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
        self._reserved: frozenset[str] | None = None

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], chat_template: str | None = None) -> Tokenizer:
        """Load from a folder holding tokenizer.json / tokenizer_config.json.

        `chat_template`, a Jinja template or the path of a file holding one, replaces the model's own.
        """
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise ModelNotFoundError(f"tokenizer folder {str(folder)!r} does not exist")
        try:
            hf = _load_hf_tokenizer(folder)
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

    @functools.cached_property
    def added_token_ids(self) -> frozenset[int]:
        """Ids of the tokens added to the vocabulary (special tokens and the like)."""
        return frozenset(self.hf.get_added_vocab().values())

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        return self.hf.chat_template

    def info(self) -> dict[str, Any]:
        """The tokenizer's configuration as its folder states it (tokenizer_config.json), with its
        class and the chat template it renders with (vLLM's /tokenizer_info)."""
        config = _json_object(Path(self.path) / "tokenizer_config.json")
        return {**config, "tokenizer_class": config.get("tokenizer_class") or type(self.hf).__name__,
                "chat_template": self.chat_template}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids the tokenizer does not know (the model's vocabulary may be larger) decode to nothing."""
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            continue_final_message: bool = False,
                            template_kwargs: Mapping[str, Any] | None = None,
                            documents: list[dict[str, str]] | None = None, content_format: str = "auto") -> str:
        """Render a conversation to the prompt text the model was trained on.

        Message content may be a string or a list of OpenAI text parts. `chat_template` (a Jinja
        string, never a path: requests must not read server files) replaces the model's template for
        this call; `documents` are RAG documents for the templates that render them (others ignore
        them, as transformers does); `template_kwargs` reach the template as variables (e.g. `enable_thinking`): names
        the renderer sets itself are refused (`reserved_template_kwargs`), and whatever the render
        raises with them, where it renders without them, is their fault (a 400 naming
        `chat_template_kwargs`); any other failure is the messages'. `content_format` is one of
        `corectl.chat_content.CONTENT_FORMATS`.
        """
        if chat_template is None and self.hf.chat_template is None:
            raise InvalidRequestError(
                f"the model's tokenizer ({self.path}) has no chat template, so chat messages cannot be "
                "rendered; start corectl with --chat-template (a Jinja string or .jinja file) or send a "
                "plain prompt to the completions API", param="messages")
        template_kwargs = dict(template_kwargs or {})
        reserved = sorted(set(template_kwargs) & self.reserved_template_kwargs())
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}: the renderer sets "
                                      "them itself (from the request's own fields or the tokenizer)",
                                      param="chat_template_kwargs")
        messages = normalise_messages(messages, content_format)
        render = functools.partial(self.hf.apply_chat_template, messages, tools=tools, documents=documents,
                                   chat_template=chat_template,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, tokenize=False)
        try:
            return render(**template_kwargs)
        except Exception as exc:  # a template raises whatever its code does with what it is given
            raise self._render_error(exc, render, bool(template_kwargs)) from exc

    @staticmethod
    def _render_error(exc: Exception, render: Any, with_kwargs: bool) -> InvalidRequestError:
        if with_kwargs and _renders(render):
            return InvalidRequestError(f"the chat template cannot render with these chat_template_kwargs: "
                                       f"{_describe_error(exc)}", param="chat_template_kwargs")
        return InvalidRequestError(f"the chat template cannot render these messages: {_describe_error(exc)}",
                                   param="messages")

    def reserved_template_kwargs(self) -> frozenset[str]:
        """Names a request's template variables may not take: the renderer's own arguments (whatever
        this transformers version has), the variables it sets (`messages`) and the special tokens."""
        if self._reserved is None:
            parameters = inspect.signature(self.hf.apply_chat_template).parameters.values()
            own = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
            self._reserved = frozenset(own | {"messages", "conversations"} | set(self.hf.special_tokens_map))
        return self._reserved

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, chat_template: str | None = None,
                    template_kwargs: Mapping[str, Any] | None = None, continue_final_message: bool = False,
                    documents: list[dict[str, str]] | None = None, add_special_tokens: bool = False,
                    content_format: str = "auto") -> list[int]:
        """Token ids of the rendered conversation; the template writes its own special tokens
        (`add_special_tokens` adds the tokenizer's on top, as vLLM's field of that name does)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, chat_template,
                                        continue_final_message, template_kwargs, documents, content_format)
        return self.encode(text, add_special_tokens=add_special_tokens)


def _load_hf_tokenizer(folder: Path) -> Any:
    if _loads_directly(folder):
        return TokenizersBackend.from_pretrained(str(folder), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _loads_directly(folder: Path) -> bool:
    """Whether AutoTokenizer would pick TokenizersBackend for `folder` (see DIRECT_MODEL_TYPES)."""
    tokenizer_config, config = _json_object(folder / "tokenizer_config.json"), _json_object(folder / "config.json")
    return (tokenizer_config.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in tokenizer_config
            and (folder / "tokenizer.json").is_file() and config.get("model_type") in DIRECT_MODEL_TYPES
            and "auto_map" not in config and "tokenizer_class" not in config)


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when it is missing or not an object (AutoTokenizer then decides)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _renders(render: Any) -> bool:
    """Whether the render succeeds without the request's template variables."""
    try:
        render()
    except Exception:
        return False
    return True


def _describe_error(exc: Exception) -> str:
    text = str(exc).strip()
    if isinstance(exc, jinja2.TemplateError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _read_template(value: str) -> str:
    # Every Jinja template that renders messages has a `{{` or `{%`; anything else must name a file.
    if "{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError("chat_template", f"{value!r} is neither a Jinja template nor a readable file")
    return path.read_text(encoding="utf-8")
