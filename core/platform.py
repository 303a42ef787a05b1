"""The hardware-neutral platform contract. Backends implement it; core only calls it.

Core never asks "is this CUDA?": it asks a platform for its capabilities.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import EngineConfig
    from .worker import Worker


@dataclass(frozen=True)
class PlatformCaps:
    """What a platform can do; core decides behaviour from these flags."""

    dtypes: tuple[str, ...] = ("float32",)
    default_dtype: str = "float32"
    graphs: bool = False
    pinned_memory: bool = False
    profiles_memory: bool = False
    fp8: bool = False
    # The device runs queued work while the host goes on, so scheduling the next step before
    # reading this one's ids overlaps host and device (async scheduling's default).
    async_output: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)


class Platform(abc.ABC):
    """A kind of hardware: how to detect it, what it supports, and which worker drives it."""

    name: str = ""
    device_type: str = "cpu"

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> bool:
        """Whether this machine can run the platform. Must not raise."""

    @abc.abstractmethod
    def capabilities(self) -> PlatformCaps:
        ...

    @abc.abstractmethod
    def worker_cls(self) -> type["Worker"]:
        ...

    @abc.abstractmethod
    def default_attention_backend(self, model_config) -> str:
        """Name of the attention backend (a registered AttentionBackendSpec) to use for a model."""

    def device_name(self) -> str:
        return self.device_type

    def unavailable_reason(self) -> str:
        return f"platform {self.name!r} is not available on this machine"

    def resolve_dtype(self, requested: str, model_dtype: str | None) -> str:
        """Pick the compute dtype: an explicit request must be supported; 'auto' keeps a 16-bit
        checkpoint dtype the platform runs well and otherwise (fp32 or quantized checkpoints, as
        vLLM does) takes the platform default."""
        caps = self.capabilities()
        if requested != "auto":
            if requested not in caps.dtypes:
                from .errors import ConfigError

                raise ConfigError(
                    "dtype", f"platform {self.name!r} supports {', '.join(caps.dtypes)}; got {requested!r}"
                )
            return requested
        if model_dtype in caps.dtypes and model_dtype == "bfloat16":
            return model_dtype
        return caps.default_dtype

    def check_config(self, config: "EngineConfig") -> None:
        """Reject options the platform cannot honour (called once at engine start)."""
