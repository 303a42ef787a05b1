"""Which URLs a request may make the server fetch: http(s) only, to an allowed domain, and (unless
allowed) never to a loopback, private, link-local, multicast or reserved address.

The address check sits in the connection itself (`GuardedNetwork`, the network backend of
`guarded_client`'s connection pool): a host is resolved once, every address it resolves to is
checked, and the socket connects to one of those checked addresses, never to the name again. A
name that answers a public address to the check and a private one to the connection (DNS
rebinding) therefore cannot reach the private one; every redirect hop opens its connection the
same way. TLS still verifies the certificate against the URL's host name.
"""
from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import anyio
import httpcore
import httpx

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


async def checked_addresses(host: str, port: int, settings: MediaSettings) -> list[str]:
    """The addresses `host` resolves to, once every one of them is public (unless private ones
    are allowed); a 400 naming the first that is not."""
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise APIError(400, f"the image URL's host {host!r} does not resolve: {exc}", "messages",
                       "invalid_image_url") from exc
    addresses = list(dict.fromkeys(sockaddr[0].split("%")[0] for *_, sockaddr in infos))
    for text in addresses:
        address = ipaddress.ip_address(text)
        if not settings.allow_private and (not address.is_global or address.is_multicast):
            raise APIError(400, f"image URLs may not reach {address} ({host}): loopback, private and link-local "
                           "addresses are refused (--allow-private-media-addresses allows them)",
                           "messages", "media_address_not_allowed")
    return addresses


class GuardedNetwork(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to addresses `checked_addresses` passed."""

    def __init__(self, settings: MediaSettings):
        self._settings = settings
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options=None) -> httpcore.AsyncNetworkStream:
        refused: httpcore.ConnectError | None = None
        for address in await checked_addresses(host, port, self._settings):
            try:
                return await self._inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as exc:
                refused = exc
        raise refused or httpcore.ConnectError(f"{host} resolves to no address")

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options=None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("image URLs are fetched over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def guarded_client(settings: MediaSettings) -> httpx.AsyncClient:
    """An HTTP client whose every connection goes through `GuardedNetwork`; no proxy, no
    environment settings (a proxy would connect on the server's behalf, unchecked)."""
    transport = httpx.AsyncHTTPTransport(trust_env=False)
    # httpx takes no network backend, so its pool is replaced by one alike but for the backend.
    transport._pool = httpcore.AsyncConnectionPool(ssl_context=httpx.create_ssl_context(trust_env=False),
                                                   network_backend=GuardedNetwork(settings))
    return httpx.AsyncClient(transport=transport, timeout=settings.fetch_timeout, trust_env=False)
