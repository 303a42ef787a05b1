"""The limits on what a request may make the server fetch and decode (`corectl serve` flags)."""
from __future__ import annotations

from dataclasses import dataclass

from corectl.multimodal.chat import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_PIXELS


@dataclass(frozen=True)
class MediaSettings:
    """`allowed_domains`: hosts (and their subdomains) http(s) image URLs may name; none (the
    default) refuses every URL unless `allow_any_domain`. `allow_private` lets URLs reach loopback,
    private, link-local and other non-public addresses (off: every address a host resolves to, at
    every redirect hop, must be public). `max_images`: images per prompt (vLLM's
    --limit-mm-per-prompt '{"image": N}'). `local_media_path`: the directory whose files `file:`
    URLs may name (vLLM's --allowed-local-media-path); None refuses them."""

    max_images: int = 4
    allowed_domains: tuple[str, ...] = ()
    allow_any_domain: bool = False
    allow_private: bool = False
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    fetch_timeout: float = 10.0
    max_redirects: int = 3
    local_media_path: str | None = None
