"""The Worker contract and the generic implementation platforms build on.

A platform subclasses `Worker` and supplies what is hardware specific: the device, how many KV
blocks fit, and optional warm-up (graph capture). Model construction, weight loading, KV-cache
allocation and step execution are shared.
"""
from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..attention import AttentionBackend, KVCacheLayout
from ..config import EngineConfig
from ..distributed import get_pp, get_tp, shard_range, viewed_whole
from ..errors import ConfigError
from ..kv_transfer.base import KVCacheAccess, KVConnectorWorker
from ..kv_transfer.factory import worker_connector
from ..lora.manager import AdapterManager
from ..lora.shapes import BaseModelShape
from ..models.base import CausalLM
from ..models.bert import read_separator
from ..models.kernels import LayerKernels, install_layer_kernels
from ..models.layers import Attention
from ..models.pipeline import stage_layers
from ..models.registry import resolve_model_class
from ..multimodal.profile import EncodedBatch, encode, worst_case_images
from ..platform import Platform
from ..pooling import pooling_architectures, pooling_weights
from ..quantization.base import KernelTable, QuantizationConfig
from ..quantization.scope import bind_linear_methods, process_loaded_weights, quantization_scope
from ..sample.random_sampling import RaceKernel
from ..sampling_params import SamplingParams
from ..step_messages import CachedRequestData, GrammarBitmask, NewRequestData, SchedulerOutput
from ..spec_decode.draft_model import DraftModelProposer, draft_source
from ..spec_decode.eagle import EagleProposer
from ..spec_decode.eagle_heads import EAGLE_METHODS, prepare_head
from .inflight import InflightStep
from .model_runner import ModelRunner
from .pipeline_stage import PipelineStage
from .pooler import Pooler
from .sleep import OffloadedTensors, SleepState, release_device_memory

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV tensors' dtype under each `--kv-cache-dtype` but "auto" (the model's dtype).
_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float16": "float16"}


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    num_params: int
    # The window every attention layer keeps to (tokens), None when some layer attends to the
    # whole context: the KV manager frees blocks before a request's window only when set.
    sliding_window: int | None = None
    # The KV tensors' dtype name when `--kv-cache-dtype` sets one (an FP8 or fp16 cache), else None.
    kv_cache_dtype: str | None = None
    # This rank's pipeline stage holds layers first_layer .. first_layer + num_layers - 1.
    first_layer: int = 0
    # The most tokens of one image whose tokens attend to each other both ways (Gemma 3), which the
    # scheduler never splits across steps; None: images attend causally, chunks may split them.
    bidirectional_image_tokens: int | None = None
    # Tensors per token and layer in the cache: 2 (keys, values), or 1 (MLA's latent, `KVCacheLayout`).
    kv_parts: int = 2
    # Whether the model encodes images (`encode_images`): a checkpoint's vision config alone does not
    # say so (a Llama 4 checkpoint served text-only keeps one).
    reads_images: bool = False

    def kv_bytes_per_block(self, block_size: int) -> int:
        itemsize = getattr(torch, self.kv_cache_dtype).itemsize if self.kv_cache_dtype else _DTYPES[self.dtype].itemsize
        return self.kv_parts * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


_INIT_LOCK = threading.RLock()


@contextlib.contextmanager
def _no_random_init():
    """torch.nn's layers draw random initial weights as they are built; here every parameter is
    then filled from the checkpoint or by `fill_dummy_weights` (loading refuses a model that leaves
    one unfilled), so the draws are skipped: they cost about a second of CPU per engine even for a
    135M-parameter model. The functions are module attributes shared by every thread, so builds
    take turns (engines of one process may start in threads): interleaved, one could restore
    another's stand-ins and leave initialisation off for good."""
    with _INIT_LOCK:
        names = [name for name in dir(torch.nn.init) if name.endswith("_") and not name.startswith("_")]
        originals = {name: getattr(torch.nn.init, name) for name in names}
        for name in names:
            setattr(torch.nn.init, name, _keep)
        try:
            yield
        finally:
            for name, function in originals.items():
                setattr(torch.nn.init, name, function)


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


class Worker(abc.ABC):
    runner_cls: type[ModelRunner] = ModelRunner

    def __init__(self, config: EngineConfig, platform: Platform, source, *, dtype: str,
                 max_model_len: int, eos_token_id: int | None, attention_backend_cls: type[AttentionBackend],
                 quantization: QuantizationConfig | None = None):
        self.config = config
        self.platform = platform
        self.source = source
        self.dtype = dtype
        self.torch_dtype = _DTYPES[dtype]
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.attention_backend_cls = attention_backend_cls
        self.quantization = quantization
        self.device = self.init_device()
        self.runner: ModelRunner | None = None
        self.model_info: ModelInfo | None = None
        # The draft model's shape (draft-model speculation), for its KV cache.
        self._draft_info: ModelInfo | None = None
        self._num_kv_blocks = 0
        self._sleep = SleepState()
        # The worker half of a KV connector (`corectl.kv_transfer`), built with the KV cache.
        self.kv_connector: KVConnectorWorker | None = None

    @abc.abstractmethod
    def init_device(self) -> torch.device:
        """Prepare the device (threads, streams) and return it."""

    @abc.abstractmethod
    def profile_num_kv_blocks(self) -> int:
        """How many KV blocks fit after weights and peak activations."""

    def kv_block_bytes(self) -> int:
        """The bytes a KV block takes out of the KV budget: the target's block, and with a draft model
        or head the draft's too, whose cache holds a block for each of the target's (`init_kv_cache`;
        its spare block per sequence slot comes on top)."""
        per_block = self.model_info.kv_bytes_per_block(self.config.block_size)
        if self.runner.drafter is None:
            return per_block
        return per_block + self._draft_info.kv_bytes_per_block(self.config.block_size)

    def load_model(self) -> ModelInfo:
        hf = self.source.hf_config
        pooling = self.config.runner == "pooling"
        model = self._build_model(hf, pooling)
        # A classifier made from the LM head (a decoder reranker) reads the head on the way.
        self.source.load_weights(model, self.quantization,
                                 getattr(model, "pooling_weights", pooling_weights) if pooling else None)
        if self.quantization is not None:
            process_loaded_weights(model)
        _after_loading(model)
        model.eval()
        lora = self._attach_lora(model, hf) if self.config.enable_lora else None
        install_layer_kernels(model, self.layer_kernels())
        info = _model_info(hf, model, self.dtype, self.config.kv_cache_dtype)
        backend = self.attention_backend_cls(
            info.num_heads, info.num_kv_heads, info.head_dim, self.torch_dtype, self.device, self.config.block_size
        )
        self.runner = self.runner_cls(model, backend, self.device, self.config.block_size,
                                      hf.vocab_size, self.eos_token_id, self.platform.capabilities(),
                                      logprobs_mode=self.config.logprobs_mode, race=self.race_kernel())
        self.runner.lora = lora
        spec = self.config.speculative_config
        drafts_on_first = spec is not None and spec.method == "draft_model"
        if get_pp().world_size > 1:
            self.runner.attach_stage(PipelineStage(hf.hidden_size, self.torch_dtype, self.device,
                                                   getattr(model, "pipeline_streams", 2), drafts_on_first))
        if pooling:
            self.runner.pooler = Pooler(self.config.pooling_type, getattr(model, "classify", None))
        if drafts_on_first and get_pp().is_first:
            self.runner.drafter = self._load_drafter(hf, spec.model)
        elif spec is not None and spec.method in EAGLE_METHODS:
            self.runner.drafter = self._load_eagle(model, hf, spec.method, spec.model)
        self.runner.drafts_alone = self.runner.drafter is not None and self._draft_alone() and get_tp().world_size > 1
        self.model_info = info
        return info

    def _load_drafter(self, hf, draft: str) -> DraftModelProposer:
        """The draft model of speculative decoding, with a runner of its own (its vocabulary and
        tokenizer checked against the target's before any rank started: `create_executor`)."""
        source = draft_source(self.config)
        draft_hf = source.hf_config
        # The first of several stages drafts with every layer of the draft; at draft tensor-parallel
        # size 1 every rank holds and runs all of it.
        with viewed_whole(alone=self._draft_alone()):
            model = self._build_draft(resolve_model_class(draft_hf), source)
            runner = self._draft_runner(model, draft_hf)
        return DraftModelProposer(runner, self.config.block_size)

    def _draft_alone(self) -> bool:
        return self.config.speculative_config.draft_tensor_parallel_size == 1

    def _load_eagle(self, model: torch.nn.Module, hf, method: str, head: str) -> EagleProposer:
        """An EAGLE / EAGLE-3 head over the target's hidden states, with a runner of its own;
        refused when it was made for another target (corectl.spec_decode.eagle_heads)."""
        source = draft_source(self.config)
        head_cls = prepare_head(method, source, model, hf, head, self.config.model or "default")
        # At draft tensor-parallel size 1 every rank holds the head's own layers whole; the
        # target's embedding and LM head it reads stay split.
        with viewed_whole(alone=self._draft_alone()):
            runner = self._draft_runner(self._build_draft(head_cls, source), source.hf_config)
        return EagleProposer(runner, model, hf.hidden_size, self.config.block_size)

    def _build_draft(self, model_cls: type[torch.nn.Module], source) -> torch.nn.Module:
        """A draft model or head, dense, in the target's dtype, with its weights."""
        model = build_model(model_cls, source.hf_config, self.torch_dtype, self.device, self.max_model_len)
        source.load_weights(model)
        _after_loading(model)
        model.eval()
        install_layer_kernels(model, self.layer_kernels())
        return model

    def _draft_runner(self, model: torch.nn.Module, draft_hf) -> ModelRunner:
        """A runner of the draft's own (its paged cache, input building, attention backend); the
        draft's shape sizes that cache (`init_kv_cache`)."""
        info = _model_info(draft_hf, model, self.dtype)
        backend = self.attention_backend_cls(info.num_heads, info.num_kv_heads, info.head_dim, self.torch_dtype,
                                             self.device, self.config.block_size)
        self._draft_info = info
        return self.runner_cls(model, backend, self.device, self.config.block_size, draft_hf.vocab_size, None,
                               self.platform.capabilities())

    def _attach_lora(self, model: torch.nn.Module, hf) -> AdapterManager:
        """Wrap the model's projections for LoRA; the manager owns the adapters from then on."""
        cfg = self.config
        kernels = self.layer_kernels()
        return AdapterManager(
            model, BaseModelShape.of(hf, cfg.max_lora_rank), max_loras=cfg.max_loras,
            max_cpu_loras=cfg.max_cpu_loras or cfg.max_loras,
            max_tokens=max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
            dtype=self.torch_dtype if cfg.lora_dtype == "auto" else _DTYPES[cfg.lora_dtype], device=self.device,
            download_dir=cfg.download_dir, stack_a=kernels is not None and kernels.lora_stacked_linear is not None)

    def _build_model(self, hf, pooling: bool) -> torch.nn.Module:
        """The model on the device. A pooling model reads hidden states only (corectl.pooling): it
        has no LM head."""
        model_cls = resolve_model_class(pooling_architectures(hf) if pooling else hf)
        if getattr(model_cls, "is_encoder", False):
            read_separator(hf, self.source.tokenizer_dir)
        model = build_model(model_cls, hf, self.torch_dtype, self.device, self.max_model_len,
                            self.quantization, self.quantization_kernels())
        if pooling:
            model.lm_head = None
        return model

    def quantization_kernels(self) -> KernelTable:
        """Kernels (name -> callable) this platform provides to quantization methods beyond torch's
        own ops; their names are listed in `PlatformCaps.quantization_kernels`. None by default."""
        return {}

    def init_kv_cache(self, num_blocks: int) -> None:
        self._num_kv_blocks = num_blocks
        info = self.model_info
        shape = self.runner.backend.kv_cache_shape(num_blocks, self.config.block_size, info.num_kv_heads, info.head_dim,
                                                   info.kv_parts)
        dtype = getattr(torch, info.kv_cache_dtype) if info.kv_cache_dtype else self.torch_dtype
        # Layers index the list: earlier pipeline stages' layers get an empty placeholder.
        caches = [torch.empty(0, dtype=dtype, device=self.device)] * info.first_layer
        caches += [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(info.num_layers)]
        self.runner.set_kv_caches(caches)
        if self.kv_connector is None:
            self.kv_connector = worker_connector(self.config, KVCacheAccess(
                # This rank's layers, read at each use: sleep mode replaces the tensors.
                lambda: [cache for cache in self.runner.kv_caches if cache.numel()], self.config.block_size,
                lambda tensors: self.runner.fetch_to_host(tensors), self.platform.capabilities().pinned_memory,
                self.platform.distributed_backend()))
        if self.runner.drafter is not None:
            # As many blocks as the target's and one per sequence slot: the draft never runs out first.
            draft, num_draft_blocks = self._draft_info, num_blocks + self.config.max_num_seqs
            shape = self.runner.drafter.runner.backend.kv_cache_shape(num_draft_blocks, self.config.block_size,
                                                                      draft.num_kv_heads, draft.head_dim, draft.kv_parts)
            self.runner.drafter.set_kv_caches(
                [torch.zeros(shape, dtype=self.torch_dtype, device=self.device) for _ in range(draft.num_layers)],
                num_draft_blocks)

    def warmup(self) -> None:
        """Compile or capture ahead of serving; nothing to do by default."""

    def layer_kernels(self) -> LayerKernels | None:
        """Fused kernels for the model's layers (see corectl.models.kernels); None keeps the torch code."""
        return None

    def race_kernel(self) -> RaceKernel | None:
        """The sampler's one-pass exponential race (`corectl.sample.random_sampling.RaceKernel`), for
        a platform whose `sampling_draw` is "exponential_race"; None keeps the torch form."""
        return None

    def run_dummy_step(self, num_tokens: int, num_seqs: int) -> None:
        """Run one full step (forward, logits, sampling) on synthetic prefills through the real
        runner path, to measure peak activation memory or warm kernels up. Uses blocks from the
        start of the KV cache, which must be allocated and hold at least that many tokens.

        No sequence is longer than max_model_len (positions past it have no rotary entry): more
        sequences than `num_seqs` are used when that is needed to cover `num_tokens`."""
        num_seqs = max(num_seqs, -(-num_tokens // self.max_model_len))
        per_seq = max(1, num_tokens // num_seqs)
        blocks_per_seq = -(-per_seq // self.config.block_size)
        vocab = self.model_info.vocab_size
        new = [
            NewRequestData(
                req_id=f"dummy-{i}", token_ids=[(7 * i + j) % vocab for j in range(per_seq)],
                num_prompt_tokens=per_seq, sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
                block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), num_computed_tokens=0,
            )
            for i in range(num_seqs)
        ]
        ids = [n.req_id for n in new]
        self.runner.execute_model(SchedulerOutput(new, CachedRequestData(), {i: per_seq for i in ids},
                                                  per_seq * num_seqs, []))
        self.runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, ids))

    @contextlib.contextmanager
    def worst_case_encoding(self) -> Iterator[EncodedBatch | None]:
        """A vision-language model's largest encoder batch of one step (corectl.multimodal.profile),
        encoded on entry and held until the block ends, so that a dummy step run inside it peaks as
        a real step does: the tower's outputs alive while the language model runs. None for a
        text-only model, one whose folder has no image processor, or a pipeline stage after the
        first (which holds no tower)."""
        images = []
        if self.runner.multimodal is not None and get_pp().is_first:
            images = worst_case_images(self.source.hf_config, self.source.model_dir,
                                       self.config.max_num_batched_tokens, self.max_model_len)
        if not images:
            yield None
            return
        encoded = encode(self.runner.multimodal.model, images)
        try:
            yield encoded
        finally:
            encoded.outputs.clear()

    def sleep(self, level: int) -> None:
        """Free the KV cache and move the weights to host memory (level 1) or drop them (level 2)
        (corectl.worker.sleep); the engine holds no request meanwhile."""
        self._sleep.check_sleep(level, self.config.enable_lora)
        self.runner.set_kv_caches([])
        self._sleep.kv_asleep = True
        if level == 1:
            self._sleep.offloaded = OffloadedTensors(self.runner.model)
        else:
            self.runner = None
        self._sleep.weights_level = level
        release_device_memory()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache; warm-up runs again once both are back."""
        tags = self._sleep.wake_tags(tags)
        if "weights" in tags and self._sleep.weights_level:
            if self._sleep.weights_level == 1:
                self._sleep.offloaded.restore()
                self._sleep.offloaded = None
            else:
                self.load_model()
            self._sleep.weights_level = 0
        if "kv_cache" in tags and self._sleep.kv_asleep:
            if self._sleep.weights_level == 2:
                raise ConfigError("tags", "the weights were dropped (level 2): wake them up before the KV cache")
            self.init_kv_cache(self._num_kv_blocks)
            self._sleep.kv_asleep = False
        if not self._sleep.asleep:
            self.warmup()

    def launch(self, sched: SchedulerOutput) -> InflightStep:
        """Queue a step; its output comes with `result()` (see corectl.worker.inflight). The KV
        connector's work goes first: loads land and saves read their blocks before the forward pass."""
        report = None
        if sched.kv_transfer is not None and self.kv_connector is not None:
            report = self.kv_connector.step(sched.kv_transfer, idle=sched.is_empty)
        step = self.runner.launch(sched)
        step.kv_transfer = report
        return step

    def sample_pending(self, bitmask: GrammarBitmask | None) -> None:
        """Sample the launched step that waits for its grammar masks (`grammar_pending`)."""
        self.runner.sample_pending(bitmask)


def build_model(model_cls: type[torch.nn.Module], hf, dtype: torch.dtype, device: torch.device | str,
                max_model_len: int, quantization: QuantizationConfig | None = None,
                kernels: KernelTable | None = None) -> torch.nn.Module:
    """`model_cls` built on `device` (the worker's, or "meta" for `corectl plan`); under a
    quantization config each linear layer gets its method, which creates its parameters."""
    with _default_dtype(dtype), torch.device(device), _no_random_init(), quantization_scope(quantization, kernels):
        model = model_cls(hf, max_positions=max_model_len, dtype=dtype)
        if quantization is not None:
            bind_linear_methods(model, quantization, dtype, torch.device(device))
    return model


def _after_loading(model: torch.nn.Module) -> None:
    if isinstance(model, CausalLM):
        model.after_loading()


def _model_info(hf, model: torch.nn.Module, dtype: str, kv_cache_dtype: str = "auto") -> ModelInfo:
    """The model as this rank holds it: its share of the heads under tensor parallelism, its
    stage's layers under pipeline parallelism."""
    num_heads = hf.num_attention_heads
    tp = get_tp()
    layers = stage_layers(hf.num_hidden_layers)
    # A model whose cache rows are not its config's KV heads (DeepSeek's latent MLA) gives its own.
    layout = getattr(model, "kv_cache_layout", None) or KVCacheLayout(
        shard_range(getattr(hf, "num_key_value_heads", None) or num_heads, tp.rank, tp.world_size)[1],
        getattr(hf, "head_dim", None) or hf.hidden_size // num_heads)
    return ModelInfo(
        architecture=type(model).__name__,
        num_layers=len(layers),
        first_layer=layers.start,
        num_heads=num_heads // tp.world_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        kv_parts=layout.parts,
        vocab_size=hf.vocab_size,
        dtype=dtype,
        num_params=sum(p.numel() for p in model.parameters()),
        sliding_window=uniform_sliding_window(model),
        bidirectional_image_tokens=getattr(model, "bidirectional_image_tokens", None),
        reads_images=hasattr(model, "encode_images"),
        kv_cache_dtype=_KV_DTYPES.get(kv_cache_dtype),
    )


def uniform_sliding_window(model: torch.nn.Module) -> int | None:
    """The largest window of the model's attention layers if every one has a window, else None."""
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    if not windows or None in windows:
        return None
    return max(windows)
