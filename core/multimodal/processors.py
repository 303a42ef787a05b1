"""The image preprocessing of a served model: the model family's own `ImageProcessing`, chosen from
its config (Gemma 3 wraps each image in extra tokens), over the checkpoint's transformers image
processor."""
from __future__ import annotations

from pathlib import Path

from ..errors import InvalidRequestError
from .gemma3_processing import Gemma3ImageProcessing
from .inputs import is_multimodal
from .processing import ImageProcessing


def image_processing_for(model_dir: Path | None, hf_config) -> ImageProcessing | None:
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
    if getattr(hf_config, "model_type", None) == "gemma3":
        return Gemma3ImageProcessing(processor, hf_config, model_dir)
    return ImageProcessing(processor, hf_config)
