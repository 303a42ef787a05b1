"""The hardware-neutral platform contract. Backends implement it; core only calls it.

Core never asks "is this CUDA?": it asks a platform for its capabilities, for the device of a
tensor-parallel rank, for what confines a data-parallel engine's process to its devices and for
what Ray reserves per rank; the platform's worker, runner and attention backend do the
device-specific work. tests/test_architecture.py fails on a platform or device-type name in core.
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import EngineConfig
    from .distributed import DeviceCommunicator, TensorParallel
    from .worker import Worker


@dataclass(frozen=True)
class PlatformCaps:
    """What a platform's device can do. Core decides behaviour from these fields, never from a
    device's name; each comment says who reads the field."""

    # The compute dtypes the platform runs (`--dtype` names); an explicit `--dtype` must be one
    # of them (`Platform.resolve_dtype`).
    dtypes: tuple[str, ...] = ("float32",)
    # What `--dtype auto` takes when the checkpoint's dtype is not kept (`Platform.resolve_dtype`).
    default_dtype: str = "float32"
    # Host memory can be page-locked, so a host-to-device copy staged there runs asynchronously
    # instead of waiting for the device's queue: the model runner stages the sampler's per-step
    # tensors so (`corectl.sample.transfer.DeviceTarget`).
    pinned_memory: bool = False
    # The device runs queued work while the host goes on, so scheduling the next step before
    # reading this one's ids overlaps host and device (async scheduling's default, `EngineCore`).
    async_output: bool = False
    # How the sampler draws a random row's token: "exponential_race" (vocabulary-sized noise in
    # one parallel pass, for GPUs) or "inverse_cdf" (one number per row and a search, for CPUs),
    # handed to the runner's `Sampler` (`corectl.sample.random_sampling.draw_tokens`).
    sampling_draw: str = "exponential_race"
    # Without an explicit KV budget (`kv_cache_budget_bytes`) the worker sizes the KV cache from the
    # device's memory (`gpu_memory_utilization` of it, less the weights and a profiled step's peak),
    # not from a fixed default: `corectl plan` (`corectl.planning`) sizes it the same way.
    profiles_memory: bool = False
    # Kernel names quantization methods may bind to (`corectl.quantization`): "cpu_int4pack" (torch's
    # packed int4 GEMM on CPUs), "fp8_scaled_mm" (torch._scaled_mm, FP8 tensor cores), "w4a16" and
    # "w8a16" (worker-provided dequantize-in-the-GEMM kernels, `Worker.quantization_kernels`). A
    # method none of whose kernels is listed is refused at engine start (`QuantizationConfig.bind`).
    quantization_kernels: tuple[str, ...] = ()
    # How the `mp` executor starts rank processes (`corectl.executor.multiproc`): "spawn" (a fresh
    # interpreter each, for device runtimes that must not be initialised before a fork) or
    # "forkserver" (forked from one server process that imported torch, corectl and the model's config
    # class once, so a rank skips ~4 s of imports; for platforms without such a runtime).
    rank_start_method: str = "spawn"
    # The worker honours `EngineConfig.batch_invariant` (every kernel of the step computes a row the
    # same way whatever the batch); the engine refuses the flag on a platform without it.
    batch_invariance: bool = False


class Platform(abc.ABC):
    """A kind of hardware: how to detect it, what it supports, and which worker drives it.

    A plugin yields a ``PlatformSpec`` with the dotted path of its subclass
    (``corectl.plugins.hookspecs.corectl_platforms``). Discovery (``corectl.discovery``) imports
    the class, asks ``is_available()`` and instantiates the chosen one with no arguments. At
    engine start core then calls ``check_config``, ``resolve_dtype``, ``default_attention_backend``
    (unless ``--attention-backend`` names one), ``worker_cls``, ``capabilities`` and
    ``device_name``. An instance holds no state of its own and may be pickled to other processes
    (one per tensor-parallel rank), so every method may run more than once, anywhere.
    """

    #: The name of ``--platform``; it must equal the ``PlatformSpec`` name, and attention backends
    #: list it in ``AttentionBackendSpec.platforms`` to be allowed here.
    name: str = ""
    #: The torch device type the worker's tensors live on ("cpu", "cuda", "xpu", ...), as
    #: ``torch.get_device_module`` takes it: ``device_for_rank`` selects a rank's device through it
    #: by default, and it is the default of ``device_name``. Every platform sets it.
    device_type: str = ""
    #: The environment variable the device runtime reads for the devices a process may use
    #: ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ZE_AFFINITY_MASK", ...), through which
    #: ``confine_process_env`` gives each data-parallel engine its own devices. None: the
    #: platform's processes share one device (the host CPU), so an engine needs no confinement.
    visible_devices_env: str | None = None
    #: The device is the host's CPU itself: ``corectl plan --device cpu`` sizes for the available
    #: platform of highest priority that says so.
    on_host: bool = False

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> bool:
        """Whether this machine can run the platform.

        Called during discovery, for ``--platform auto`` on every platform in priority order and
        for a named platform before it is used, and by ``corectl plugins``. It must not raise (a
        missing or broken driver reads as False) and should stay cheap: ask the runtime whether a
        device exists, without allocating on it.
        """

    @abc.abstractmethod
    def capabilities(self) -> PlatformCaps:
        """What this machine's device can do, as a ``PlatformCaps``.

        Called only on the chosen platform, after ``is_available()`` returned True, so it may query
        the device (compute capability, CPU flags); it must return the same value on every call.
        Core reads it at engine start: ``resolve_dtype`` checks ``dtypes`` and ``default_dtype``,
        ``EngineCore`` turns async scheduling on by default where ``async_output`` is set,
        ``Worker.load_model`` hands it to the ``ModelRunner`` (``pinned_memory``,
        ``sampling_draw``), and ``corectl plan`` sizes the KV cache by ``profiles_memory``.
        """

    @abc.abstractmethod
    def worker_cls(self) -> type["Worker"]:
        """The ``corectl.worker.worker.Worker`` subclass that drives one device of this platform.

        Import it inside the method: discovery imports the platform's module on every start and in
        ``corectl plugins``, so that module must not import torch.cuda, Triton or the worker. Core
        builds one worker per rank as ``worker_cls()(config, platform, source, dtype=...,
        max_model_len=..., eos_token_id=..., attention_backend_cls=..., quantization=...)``
        (``WorkerSpec.build``; ``quantization`` is the bound ``QuantizationConfig`` or None),
        then calls ``load_model``, ``profile_num_kv_blocks``, ``init_kv_cache`` and ``warmup`` in
        that order, and ``launch`` once per step. A worker implements ``init_device`` and
        ``profile_num_kv_blocks``; it may override ``warmup``, ``layer_kernels``,
        ``quantization_kernels`` (callables for the kernel names its caps list) and ``runner_cls``,
        a ``ModelRunner`` subclass for how inputs reach the device, how results come back and
        whether steps replay captured graphs.
        """

    @abc.abstractmethod
    def default_attention_backend(self, model_config) -> str:
        """The name of the attention backend (a registered ``AttentionBackendSpec`` allowed on this
        platform) to use for a model when ``--attention-backend`` names none.

        ``model_config`` is the model's transformers config, so a platform may choose by head size
        or architecture. Discovery then checks that the backend exists and allows this platform.
        """

    def device_name(self) -> str:
        """A human-readable name of the device (``EngineInfo.device``: the startup log, benchmark
        results); the device type by default. Called on the chosen platform only, so it may query
        the device."""
        return self.device_type

    def distributed_backend(self) -> str:
        """The torch.distributed backend tensor-parallel ranks on this platform join ("gloo",
        "nccl", ...); core passes it to `init_process_group` and never names one itself."""
        from .errors import ConfigError

        raise ConfigError("tensor_parallel_size", f"platform {self.name!r} does not support tensor parallelism")

    def device_communicator(self, tp: "TensorParallel") -> "DeviceCommunicator | None":
        """An all-reduce of the platform's own for the tensor-parallel group `tp`'s small messages
        (``corectl.distributed.DeviceCommunicator``: what it takes, in place, the same bits on every
        rank, capturable in device graphs); messages it does not take go through the
        ``distributed_backend()`` collective. Every rank calls it once, together, right after joining
        its group (``attach_device_communicator``), so it may run collectives on ``tp.group`` (None:
        the default group) to agree on a result. None (the default): the collective takes every size.
        A platform returns None where its devices cannot serve one (no peer access), saying why."""
        return None

    def device_for_rank(self, local_rank: int):
        """Make device `local_rank` (among those this process sees) the current one, and return
        it as a ``torch.device``. The executors call it first thing in each tensor-parallel
        rank's process, before the rank joins its group: ``mp`` ranks pass their rank, Ray
        actors 0 (Ray confines each actor to its bundle's device). By default through torch's
        device module of ``device_type`` (``set_device``), which serves the device types torch
        knows (CUDA, XPU, ...); a platform whose ranks share one device (the CPU) overrides it."""
        import torch

        device = torch.device(self.device_type, local_rank)
        torch.get_device_module(self.device_type).set_device(device)
        return device

    def visible_devices(self) -> str | None:
        """The devices this process may use, as ``visible_devices_env`` lists them (comma
        separated); None: every device, numbered from 0 (or the variable is not set)."""
        return os.environ.get(self.visible_devices_env) if self.visible_devices_env else None

    def confine_process_env(self, device_ids: list[str]) -> dict[str, str]:
        """The environment variables that confine a new process to `device_ids` (entries of
        ``visible_devices``, or indices when that is None), set in it before it touches a device;
        its tensor-parallel ranks inherit them. Data parallelism gives each engine process its
        own run of devices so (``corectl.engine.dp``). By default ``visible_devices_env`` set to
        the ids; nothing where the platform has none."""
        return {self.visible_devices_env: ",".join(device_ids)} if self.visible_devices_env else {}

    def ray_resources_per_rank(self) -> dict[str, float]:
        """The Ray resources one tensor-parallel rank reserves (its placement group bundle, e.g.
        one GPU); the ``ray`` executor places each rank's actor on them. Ray's resource names are
        its own, so a platform that runs under Ray says which; by default it does not."""
        from .errors import ConfigError

        raise ConfigError("distributed_executor_backend", f"platform {self.name!r} does not say which Ray "
                          "resources a rank takes (Platform.ray_resources_per_rank); use the mp backend")

    def device_memory(self) -> int | None:
        """Bytes of memory on the device the engine would use (what `corectl plan` sizes for by
        default); None when the platform cannot tell."""
        return None

    def unavailable_reason(self) -> str:
        """Why ``is_available()`` is False, for the ``ConfigError`` a user sees when asking for this
        platform by name: say what hardware and software it needs."""
        return f"platform {self.name!r} is not available on this machine"

    def planned_capabilities(self, compute_capability: tuple[int, int]) -> PlatformCaps | None:
        """What a device of this platform with `compute_capability` (major, minor) can do, when that
        device is not on this machine: `corectl plan --device-capability` sizes for it (its dtype,
        the quantization kernels methods bind to). Must not query a device. None (the default): the
        platform cannot tell without its device."""
        return None

    def resolve_dtype(self, requested: str, model_dtype: str | None) -> str:
        """Pick the compute dtype from ``--dtype`` and the checkpoint's dtype, from
        ``capabilities()`` (`resolve_dtype` below). Platforms rarely override it."""
        return resolve_dtype(self.capabilities(), self.name, requested, model_dtype)

    def check_config(self, config: "EngineConfig") -> None:
        """Reject engine options the platform cannot honour by raising ``ConfigError`` (called
        once at engine start, before the model loads); accepts everything by default."""


def resolve_dtype(caps: PlatformCaps, platform: str, requested: str, model_dtype: str | None) -> str:
    """The compute dtype on a device of `caps`: an explicit request must be in ``dtypes``; 'auto'
    keeps a bf16 checkpoint when the platform runs bf16 and otherwise (fp32 or quantized
    checkpoints, as vLLM does) takes ``default_dtype``."""
    if requested != "auto":
        if requested not in caps.dtypes:
            from .errors import ConfigError

            raise ConfigError("dtype", f"platform {platform!r} supports {', '.join(caps.dtypes)}; got {requested!r}")
        return requested
    if model_dtype in caps.dtypes and model_dtype == "bfloat16":
        return model_dtype
    return caps.default_dtype
