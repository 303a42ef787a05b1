"""Which URLs a request may make the server fetch: http(s) only, to an allowed domain, and (unless
allowed) never to a loopback, private, link-local, multicast or reserved address. The host is
resolved here and every address it resolves to is checked, at every redirect hop; a name that
resolves differently between this check and the connection (DNS rebinding) is not caught.
"""
from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import anyio

from ..errors import APIError
from .settings import MediaSettings


def check_url(url: str, settings: MediaSettings) -> str:
    """The URL's host, once its scheme and domain are allowed; a 400 naming the rule otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise APIError(400, f"image URLs must be http(s) or data: URLs, not {parts.scheme or 'a bare path'!r}",
                       "messages", "invalid_image_url")
    host = (parts.hostname or "").lower()
    if not host:
        raise APIError(400, f"the image URL {url[:200]!r} names no host", "messages", "invalid_image_url")
    if not settings.allow_any_domain and not any(host == d or host.endswith("." + d) for d in settings.allowed_domains):
        raise APIError(400, f"image URLs may not name {host!r}: the server fetches only from "
                       "--allowed-media-domains (or any domain with --allow-any-media-domain)",
                       "messages", "media_domain_not_allowed")
    return host


async def check_addresses(host: str, port: int | None, settings: MediaSettings) -> None:
    """Every address `host` resolves to is public (unless private ones are allowed)."""
    if settings.allow_private:
        return
    try:
        infos = await anyio.getaddrinfo(host, port or 443, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise APIError(400, f"the image URL's host {host!r} does not resolve: {exc}", "messages",
                       "invalid_image_url") from exc
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if not address.is_global or address.is_multicast:
            raise APIError(400, f"image URLs may not reach {address} ({host}): loopback, private and link-local "
                           "addresses are refused (--allow-private-media-addresses allows them)",
                           "messages", "media_address_not_allowed")
