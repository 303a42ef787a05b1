"""The image preprocessing of a served model: the model family's own `ImageProcessing`, chosen from
its config (Gemma 3 wraps each image in extra tokens and may cut it into crops), over the
checkpoint's transformers image processor."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InvalidRequestError
from .gemma3_processing import Gemma3ImageProcessing
from .inputs import is_multimodal
from .processing import ImageProcessing, checked_options


def image_processing_for(model_dir: Path | None, hf_config,
                         defaults: Mapping[str, Any] | None = None) -> ImageProcessing | None:
    """`defaults`: the engine's `mm_processor_kwargs`, under every request's own."""
    if not is_multimodal(hf_config) or model_dir is None:
        return None
    # transformers' image stack costs seconds to import; text-only servers never pay it.
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"the model folder {model_dir} holds no image processor config "
                                  f"(preprocessor_config.json), so images cannot be read: {exc}",
                                  param="messages", code="images_not_supported") from exc
    if _processing_class(hf_config) is Gemma3ImageProcessing:
        return Gemma3ImageProcessing(processor, hf_config, model_dir, defaults)
    return ImageProcessing(processor, hf_config, defaults)


def check_processor_kwargs(hf_config, kwargs: Mapping[str, Any] | None) -> None:
    """The engine's `mm_processor_kwargs` (`--mm-processor-kwargs`), checked at start-up against the
    options this model's image processor takes."""
    if not kwargs:
        return
    if not is_multimodal(hf_config):
        raise ConfigError("mm_processor_kwargs", "this model reads no images, so it has no image processor to "
                          "pass options to")
    try:
        checked_options(_processing_class(hf_config).OPTIONS, kwargs)
    except InvalidRequestError as exc:
        raise ConfigError("mm_processor_kwargs", str(exc).removeprefix("mm_processor_kwargs: ")) from exc


def _processing_class(hf_config) -> type[ImageProcessing]:
    return Gemma3ImageProcessing if getattr(hf_config, "model_type", None) == "gemma3" else ImageProcessing
