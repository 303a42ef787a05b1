"""Images inside chat messages: finding them in OpenAI-style content parts, and reading the ones
a caller hands over directly (data: URLs and PIL images; fetching http(s) URLs is the server's
business, under its own limits: `corectl.server.http.media`).

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   # OpenAI's form
    {"type": "image_pil", "image_pil": <PIL.Image>}                            # vLLM's offline form
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidRequestError
from .inputs import IMAGE_PART_TYPES
# Largest image (width x height) decoded by default: 32 Mpx, above an 8K frame.
DEFAULT_MAX_PIXELS = 32 * 2 ** 20
DEFAULT_MAX_IMAGE_BYTES = 20 * 2 ** 20


def image_sources(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Each image part's source in message order: a URL string, or the image object given."""
    sources = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in IMAGE_PART_TYPES:
                sources.append(_part_source(part, kind))
    return sources


def _part_source(part: Mapping[str, Any], kind: str) -> Any:
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, Mapping):
        value = value.get("url")
    if value is None:
        raise InvalidRequestError(f"an {kind!r} content part needs its {kind!r} field", param="messages")
    return value


def data_url_bytes(url: str, max_bytes: int) -> bytes:
    """The bytes of a `data:image/...;base64,` URL; another media type is refused."""
    header, comma, payload = url.partition(",")
    mime, _, encoding = header.removeprefix("data:").partition(";")
    if not comma or not url.startswith("data:"):
        raise InvalidRequestError("an image data URL reads data:image/<type>;base64,<data>", param="messages",
                                  code="invalid_image_url")
    if not mime.startswith("image/"):
        raise InvalidRequestError(f"the data URL holds {mime or 'no media type'!r}, not an image (image/png, "
                                  "image/jpeg, ...)", param="messages", code="unsupported_media_type")
    if encoding != "base64":
        raise InvalidRequestError("image data URLs must be base64 encoded (data:image/<type>;base64,...)",
                                  param="messages", code="invalid_image_url")
    if len(payload) * 3 // 4 > max_bytes:
        raise InvalidRequestError(f"the image is over the limit of {max_bytes} bytes (--max-image-bytes)",
                                  param="messages", code="image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(f"the image data URL is not valid base64: {exc}", param="messages",
                                  code="invalid_image_url") from exc


def local_image(source: Any, max_pixels: int = DEFAULT_MAX_PIXELS):
    """An RGB PIL image from a PIL image or a data URL (the offline `LLM.chat`'s sources)."""
    from PIL import Image

    from .processing import check_pixels, decode_image

    if isinstance(source, Image.Image):
        check_pixels(source.size, max_pixels)
        return source.convert("RGB")
    if isinstance(source, str) and source.startswith("data:"):
        return decode_image(data_url_bytes(source, DEFAULT_MAX_IMAGE_BYTES), max_pixels)
    raise InvalidRequestError("offline chat takes images as PIL images or data: URLs; fetch other URLs first",
                              param="messages")
