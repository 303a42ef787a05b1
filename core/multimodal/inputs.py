"""The record of one image in a prompt, as it travels from the client to the worker.

An image arrives preprocessed (the model's published image processor ran on the client side,
off the engine loop): its pixel values, the patch grid they form, the run of placeholder tokens
the prompt holds for it, and a content hash. The hash keys the worker's encoder cache and joins
the prefix-cache hash of every KV block the placeholders touch, so the same text with another
image never shares K/V.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec
import numpy as np

if TYPE_CHECKING:  # the API process builds these records without torch; only the worker reads pixels
    import torch

# Chat content parts that hold an image: OpenAI's, and vLLM's offline forms.
IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


class MultiModalInput(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One image: its placeholder tokens are prompt positions `offset` .. `offset + length - 1`.

    `pixel_values` are the processor's float32 values (little-endian bytes) of shape
    `pixel_shape`; `grid_thw` is the (temporal, height, width) patch grid the tower sees
    (Qwen2.5-VL's variable resolution).
    """

    hash: str
    offset: int
    length: int
    pixel_values: bytes
    pixel_shape: list[int]
    grid_thw: list[int] = []
    modality: str = "image"

    @classmethod
    def build(cls, pixels: np.ndarray, grid_thw: list[int], offset: int, length: int) -> MultiModalInput:
        values = np.ascontiguousarray(pixels, dtype="<f4")
        return cls(content_hash(values, grid_thw), offset, length, values.tobytes(), list(values.shape),
                   [int(g) for g in grid_thw])

    def pixels(self) -> torch.Tensor:
        """The pixel values as a float32 tensor on the host."""
        import torch

        return torch.frombuffer(bytearray(self.pixel_values), dtype=torch.float32).view(self.pixel_shape)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def __repr__(self) -> str:
        # Without the pixels: logs (`--log-prompts`) and tracebacks name the image, not megabytes.
        return (f"MultiModalInput(hash={self.hash!r}, offset={self.offset}, length={self.length}, "
                f"pixel_shape={self.pixel_shape}, grid_thw={self.grid_thw})")

    @property
    def hash_bytes(self) -> bytes:
        return bytes.fromhex(self.hash)


def is_multimodal(hf_config) -> bool:
    """Whether a checkpoint's config is a vision-language model's (it has a vision tower)."""
    return getattr(hf_config, "vision_config", None) is not None


def content_hash(pixels: np.ndarray, grid_thw: list[int]) -> str:
    """A stable 128-bit digest of what the encoder sees: the processed pixels and their grid."""
    digest = hashlib.blake2b(digest_size=16, person=b"corectl-image")
    digest.update(np.asarray(list(pixels.shape) + list(grid_thw), dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(pixels, dtype="<f4").tobytes())
    return digest.hexdigest()


def overlapping(items: list[MultiModalInput], start: int, end: int) -> list[MultiModalInput]:
    """The images whose placeholders meet positions start .. end - 1."""
    return [item for item in items if item.offset < end and start < item.end]
