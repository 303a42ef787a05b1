"""Message content as chat templates read it (vLLM's --chat-template-content-format).

"string" joins a message's text parts into one string (paragraphs, as vLLM renders them); "openai"
always gives the list of parts, `{"type": "text", "text": ...}` and `{"type": "image"}`, for
templates that loop over them; "auto" gives a string unless images need the list (a vision-language
model's template renders each `{"type": "image"}` as its placeholder). Kept apart from the tokenizer
so the command line can name the formats without importing transformers.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ConfigError, InvalidRequestError
from .multimodal.inputs import IMAGE_PART_TYPES

CONTENT_FORMATS = ("auto", "string", "openai")


def normalise_messages(messages: Sequence[Mapping[str, Any]], content_format: str) -> list[Mapping[str, Any]]:
    """Each message's `content` in `content_format` (`CONTENT_FORMATS`)."""
    if content_format not in CONTENT_FORMATS:
        raise ConfigError("chat_template_content_format", f"must be one of {', '.join(CONTENT_FORMATS)}, "
                          f"got {content_format!r}")
    out: list[Mapping[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object with 'role' and 'content'",
                                      param="messages")
        content = message.get("content")
        if isinstance(content, str) and content_format != "openai":
            out.append(message)
        else:
            out.append({**message, "content": _content(content, i, content_format)})
    return out


def _content(content: Any, index: int, content_format: str) -> str | list[dict[str, str]]:
    """Text parts joined into one string, or the parts as a list in which each image is
    `{"type": "image"}`, which a vision-language model's template renders as its image placeholder."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    images = isinstance(content, list) and any(_kind(part) in IMAGE_PART_TYPES for part in content)
    if images and content_format == "string":
        raise InvalidRequestError(f"messages[{index}] holds images, which this server's chat template content "
                                  "format ('string') cannot carry: serve with --chat-template-content-format "
                                  "auto or openai", param="messages")
    if content_format == "openai":
        return [] if content is None else _parts(content, index)
    return _parts(content, index) if images else _content_text(content, index)


def _parts(content: Any, index: int) -> list[dict[str, str]]:
    return [{"type": "image"} if _kind(part) in IMAGE_PART_TYPES else {"type": "text", "text": _part_text(part, index)}
            for part in _part_list(content, index)]


def _part_list(content: Any, index: int) -> list:
    if not isinstance(content, list):
        raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts",
                                  param="messages")
    return content


def _kind(part: Any) -> str | None:
    return part.get("type") if isinstance(part, Mapping) else None


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    # Parts are separate paragraphs of one message, as vLLM renders them.
    return "\n".join(_part_text(part, index) for part in _part_list(content, index))


def _part_text(part: Any, index: int) -> str:
    if _kind(part) != "text" or not isinstance(part.get("text"), str):
        raise InvalidRequestError(
            f"messages[{index}].content: parts are text ({{'type': 'text', 'text': ...}}) or images "
            f"({{'type': 'image_url', ...}}), got {_kind(part)!r}", param="messages")
    return part["text"]
