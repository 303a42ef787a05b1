"""A chat request's images: counted and checked before the template renders, then fetched (http(s)
URLs) or decoded (data URLs), preprocessed by the model's image processor in worker threads (never
on the event loop, never in the engine) and merged into the rendered prompt."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
from corectl.engine.messages import EngineInfo
from corectl.multimodal.chat import data_url_bytes, image_sources
from corectl.multimodal.processing import ImageProcessing, decode_image

from ..errors import APIError
from .address_guard import guarded_client
from .fetch import fetch_image
from .local_files import read_local_image
from .settings import MediaSettings

# Images decoded and preprocessed at once across all requests (each holds a decoded image).
_THREADS = 4


class MediaIntake:
    """One per server; `check` before rendering a conversation, `prompt` after. `processor_kwargs`:
    the engine's `--mm-processor-kwargs`, under each request's `mm_processor_kwargs`."""

    def __init__(self, settings: MediaSettings, processor_kwargs: dict[str, Any] | None = None):
        self.settings = settings
        self.processor_kwargs = processor_kwargs
        self._limiter = anyio.CapacityLimiter(_THREADS)
        self._processing: ImageProcessing | None = None

    def check(self, messages: list[dict[str, Any]], info: EngineInfo) -> list[Any]:
        """The conversation's image sources, once the model reads images and there are few enough."""
        sources = image_sources(messages)
        if sources and info.image_token_id is None:
            raise APIError(400, f"this model ({info.architecture}) reads no images; send text only", "messages",
                           "images_not_supported")
        if len(sources) > self.settings.max_images:
            raise APIError(400, f"the prompt holds {len(sources)} images, over the limit of {self.settings.max_images} "
                           "(--limit-mm-per-prompt)", "messages", "too_many_images")
        return sources

    async def prompt(self, sources: list[Any], token_ids: list[int], info: EngineInfo,
                     processor_kwargs: dict[str, Any] | None = None) -> list[int] | dict:
        """The engine prompt: the token ids as they are without images, else with each image's
        placeholders widened and its pixels attached (`ImageProcessing.prompt`). A request's
        `processor_kwargs` are checked even when it holds no image."""
        if not sources and not processor_kwargs:
            return token_ids
        if info.image_token_id is None:
            raise APIError(400, f"mm_processor_kwargs sets image-processor options, and this model "
                           f"({info.architecture}) reads no images", "mm_processor_kwargs")
        processing = await self._processing_for(info)
        options = processing.options(processor_kwargs)
        if not sources:
            return token_ids
        async with guarded_client(self.settings) as client:
            images = [await self._image(client, source) for source in sources]
        return await anyio.to_thread.run_sync(processing.prompt, token_ids, images, options, limiter=self._limiter)

    async def _image(self, client: httpx.AsyncClient, source: Any):
        if not isinstance(source, str):
            raise APIError(400, "an image_url part holds {'url': '...'} (an http(s) or data: URL)", "messages",
                           "invalid_image_url")
        if source.startswith("data:"):
            data = data_url_bytes(source, self.settings.max_bytes)
        elif source.startswith("file:"):
            data = await anyio.to_thread.run_sync(read_local_image, source, self.settings, limiter=self._limiter)
        else:
            data = await fetch_image(client, source, self.settings)
        return await anyio.to_thread.run_sync(decode_image, data, self.settings.max_pixels, limiter=self._limiter)

    async def _processing_for(self, info: EngineInfo) -> ImageProcessing:
        if self._processing is None:
            # Imported with the first image: they pull transformers' config classes (and torch),
            # which a text-only API process never needs.
            from corectl.loaders.hf_config import load_hf_config
            from corectl.multimodal.processors import image_processing_for

            folder = Path(info.model_dir)
            hf_config, _ = await anyio.to_thread.run_sync(load_hf_config, folder, None)
            self._processing = await anyio.to_thread.run_sync(image_processing_for, folder, hf_config,
                                                              self.processor_kwargs)
        return self._processing
