"""`file:` image URLs (vLLM's --allowed-local-media-path): read from one directory of the server's
file system and nowhere else. The path is resolved (symbolic links and `..` followed) before it is
compared with the directory, so no spelling of a path reaches past it; the file's size is checked
before it is read."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..errors import APIError
from .settings import MediaSettings


def read_local_image(url: str, settings: MediaSettings) -> bytes:
    """The bytes of a `file:` URL under `settings.local_media_path`; a 400 naming the rule otherwise."""
    if settings.local_media_path is None:
        raise APIError(400, "file: image URLs are refused: the server reads local images only under "
                       "--allowed-local-media-path", "messages", "invalid_image_url")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise APIError(400, f"a file: URL names no host (file:///path), got {parts.netloc!r}", "messages",
                       "invalid_image_url")
    root = Path(settings.local_media_path).resolve()
    try:
        path = Path(unquote(parts.path)).resolve(strict=True)
    except (OSError, RuntimeError):
        path = None
    if path is None or not path.is_relative_to(root) or not path.is_file():
        # The same answer whether the file is missing or outside: a request learns nothing of the rest.
        raise APIError(400, f"no image file {parts.path[:200]!r} under the server's --allowed-local-media-path",
                       "messages", "media_path_not_allowed")
    if path.stat().st_size > settings.max_bytes:
        raise APIError(400, f"the image is over the limit of {settings.max_bytes} bytes (--max-image-bytes)",
                       "messages", "image_too_large")
    return path.read_bytes()
