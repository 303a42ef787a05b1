"""Fetching an image URL under the server's limits: redirects followed by hand (each hop's URL
passes the domain rule again, and its connection the address guard: `guarded_client`), the body read in pieces and cut off at the byte limit, the whole fetch
bounded by one deadline."""
from __future__ import annotations

from urllib.parse import urljoin

import anyio
import httpx

from ..errors import APIError
from .address_guard import check_url
from .settings import MediaSettings

_REDIRECTS = (301, 302, 303, 307, 308)


async def fetch_image(client: httpx.AsyncClient, url: str, settings: MediaSettings) -> bytes:
    """The body of an image URL, fetched with `client` (`address_guard.guarded_client`); a 400
    naming the limit it broke."""
    try:
        with anyio.fail_after(settings.fetch_timeout):
            return await _follow(client, url, settings)
    except TimeoutError:
        raise APIError(400, f"fetching the image at {url[:200]!r} took over {settings.fetch_timeout:g} s "
                       "(--media-fetch-timeout)", "messages", "media_fetch_timeout") from None
    except httpx.HTTPError as exc:
        raise APIError(400, f"the image at {url[:200]!r} cannot be fetched: {type(exc).__name__}: {exc}",
                       "messages", "media_fetch_failed") from None


async def _follow(client: httpx.AsyncClient, url: str, settings: MediaSettings) -> bytes:
    for _ in range(settings.max_redirects + 1):
        check_url(url, settings)
        async with client.stream("GET", url, follow_redirects=False) as response:
            if response.status_code in _REDIRECTS and "location" in response.headers:
                url = urljoin(url, response.headers["location"])
                continue
            if response.status_code != 200:
                raise APIError(400, f"the image URL answered HTTP {response.status_code}", "messages",
                               "media_fetch_failed")
            _check_type(response.headers.get("content-type", ""))
            return await _read_body(response, settings.max_bytes)
    raise APIError(400, f"the image URL redirects more than {settings.max_redirects} times", "messages",
                   "media_fetch_failed")


def _check_type(content_type: str) -> None:
    mime = content_type.split(";")[0].strip().lower()
    if mime and not mime.startswith("image/") and mime != "application/octet-stream":
        raise APIError(400, f"the image URL serves {mime!r}, not an image", "messages", "unsupported_media_type")


async def _read_body(response: httpx.Response, max_bytes: int) -> bytes:
    body = bytearray()
    async for piece in response.aiter_bytes():
        body += piece
        if len(body) > max_bytes:
            raise APIError(400, f"the image is over the limit of {max_bytes} bytes (--max-image-bytes)",
                           "messages", "image_too_large")
    return bytes(body)
