"""Executors: how the engine core starts its tensor-parallel ranks and feeds them (see base.py)."""
from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from ..models.parallel import check_tensor_parallel
from ..models.pipeline import check_pipeline_parallel, resolve_layer_partition
from ..models.registry import resolve_model_class
from ..loaders.source import ModelSource
from ..spec_decode.draft_model import check_draft_tokenizer, check_draft_vocabulary, draft_source
from .base import Executor, StepHandle, WorkerSpec

__all__ = ["Executor", "StepHandle", "WorkerSpec", "create_executor", "executor_backend"]


def executor_backend(config) -> str:
    """"in_process", "mp" or "ray": the configured backend, else the engine's own process for one
    rank and "mp" above it."""
    if config.distributed_executor_backend is not None:
        return config.distributed_executor_backend
    return "mp" if config.world_size > 1 else "in_process"


def _check_draft(config, target: ModelSource) -> None:
    """Refused here, naming the way out, rather than inside every rank as it loads: a draft model
    with another vocabulary or tokenizer than the target's, and a draft model or head split as the
    target is that does not split over as many ranks."""
    spec = config.speculative_config
    if spec is None or spec.model is None:
        return
    draft = draft_source(config, load_format="dummy")
    if spec.method == "draft_model":
        name = config.model or "default"
        check_draft_vocabulary(spec.model, draft.hf_config.vocab_size, name, target.hf_config.vocab_size)
        check_draft_tokenizer(spec.model, draft.tokenizer_dir, name, target.tokenizer_dir)
    if spec.draft_tensor_parallel_size == 1:
        return
    try:
        check_tensor_parallel(draft.hf_config, spec.draft_tensor_parallel_size)
    except ConfigError as exc:
        raise ConfigError("speculative_config", f"the draft {spec.model!r} is split as the target is, and "
                          f"{exc.message}; or set draft_tensor_parallel_size 1 to hold it whole on every rank") from None


def create_executor(spec: WorkerSpec) -> Executor:
    """Start the ranks the config asks for (raises ConfigError when the model cannot be split so)."""
    config, hf = spec.config, spec.source.hf_config
    check_tensor_parallel(hf, config.tensor_parallel_size)
    _check_draft(config, spec.source)
    partition = resolve_layer_partition(config)
    if config.pipeline_parallel_size > 1:
        check_pipeline_parallel(hf, resolve_model_class(hf), config, partition)
    if partition is not None:
        # Ranks on other machines do not see this process's environment: the config carries it.
        spec = dataclasses.replace(spec, config=config.replace(pipeline_layer_partition=",".join(map(str, partition))))
    backend = executor_backend(spec.config)
    if backend == "in_process":
        from .in_process import InProcessExecutor

        return InProcessExecutor(spec)
    if backend == "mp":
        from .multiproc import MultiprocExecutor

        return MultiprocExecutor(spec)
    try:
        from .ray_executor import RayExecutor
    except ImportError as exc:
        raise ConfigError("distributed_executor_backend",
                          f"the ray backend needs Ray ({exc}): pip install 'corectl[ray]'") from None
    return RayExecutor(spec)
