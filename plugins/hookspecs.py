"""Hook specifications for corectl plugins.

A plugin is a module (or object) registered under the entry-point group ``corectl``::

    [project.entry-points.corectl]
    my_accel = "my_package.corectl_plugin"

and implementing any of the hooks below with ``@corectl.plugins.hookimpl``. Each hook yields
frozen spec records holding dotted paths; corectl imports the target only when it is used, so
listing plugins stays cheap and never initialises a device runtime. The built-in platforms (cpu,
cuda, rocm), models, the xgrammar structured-output backend, the quantization methods and the API
server's tool and reasoning parsers register through the same entry points.
"""
from __future__ import annotations

from collections.abc import Iterable

import pluggy

from .specs import (
    AttentionBackendSpec,
    KVConnectorSpec,
    LoRAResolverSpec,
    ModelSpec,
    PlatformSpec,
    QuantizationMethodSpec,
    ReasoningParserSpec,
    StructuredOutputBackendSpec,
    ToolParserSpec,
)

PROJECT = "corectl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def corectl_platforms() -> Iterable[PlatformSpec]:
    """Yield the hardware platforms this plugin provides.

    A platform's class must implement ``corectl.platform.Platform``: ``is_available()`` must not
    raise on machines without the hardware.
    """


@hookspec
def corectl_model_architectures() -> Iterable[ModelSpec]:
    """Yield model implementations, keyed by the Hugging Face ``architectures`` name they serve.

    The worker builds the model as ``model_cls(hf_config, max_positions=..., dtype=...)``:
    ``hf_config`` is the transformers config, ``max_positions`` the engine's max_model_len (the
    rotary table's length) and ``dtype`` the torch compute dtype, which is also the default dtype
    while the constructor runs, on the target device. The class must implement ``load_weights``
    and the forward signature of ``corectl.models.base.CausalLM``.
    """


@hookspec
def corectl_attention_backends() -> Iterable[AttentionBackendSpec]:
    """Yield attention backends and the platforms they run on.

    The class must implement ``corectl.attention.AttentionBackend``.
    """


@hookspec
def corectl_structured_output_backends() -> Iterable[StructuredOutputBackendSpec]:
    """Yield grammar backends for structured outputs (JSON schema, regex, choice, EBNF).

    The class must implement ``corectl.structured.backend.StructuredOutputBackend``: it is built
    in the engine process from the tokenizer folder, and its matchers fill xgrammar's bitmask
    layout (int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed).
    """


@hookspec
def corectl_quantization_methods() -> Iterable[QuantizationMethodSpec]:
    """Yield quantization methods (weight formats and the kernels that compute with them).

    The class must subclass ``corectl.quantization.base.QuantizationConfig``: a frozen dataclass
    with a ``name``, the ``kernels`` it runs on (best first; the platform's
    ``PlatformCaps.quantization_kernels`` decides which one binds), ``from_checkpoint`` (the
    checkpoint's ``quantization_config`` dict, or None for on-the-fly quantization) and
    ``linear_method(prefix, layer)`` returning a ``LinearMethod`` per linear layer.
    """


@hookspec
def corectl_tool_parsers() -> Iterable[ToolParserSpec]:
    """Yield tool parsers for the API server (``--tool-call-parser NAME``).

    The class must implement ``corectl.server.http.tool_parsers.base.ToolParser``: built per response
    choice as ``cls(tokenizer)``, it turns the model's text into content and OpenAI tool calls,
    incrementally (``feed``) for streams. It runs in the API server's process, on text only.
    """


@hookspec
def corectl_reasoning_parsers() -> Iterable[ReasoningParserSpec]:
    """Yield reasoning parsers for the API server (``--reasoning-parser NAME``).

    The class must implement ``corectl.server.http.reasoning.base.ReasoningParser``: built per response
    choice as ``cls(tokenizer)``, it splits the model's text into reasoning and content,
    incrementally (``feed``) for streams. It runs in the API server's process, on text only.
    """


@hookspec
def corectl_lora_resolvers() -> Iterable[LoRAResolverSpec]:
    """Yield LoRA resolvers for the API server (``--lora-resolver NAME``).

    The class must subclass ``corectl.lora.resolvers.LoRAResolver``: built once as
    ``cls(options)``, its ``resolve(base_model_name, lora_name)`` returns a local folder holding the
    PEFT adapter a request names, or None. It runs in a worker thread of the API server's process.
    """


@hookspec
def corectl_kv_connectors() -> Iterable[KVConnectorSpec]:
    """Yield KV connectors (``--kv-transfer-config '{"kv_connector": NAME, ...}'``).

    The class must subclass ``corectl.kv_transfer.base.KVConnector`` and name its two halves:
    ``scheduler_cls`` (a ``KVConnectorScheduler``, in the engine process: how many prompt tokens of
    a request it can load, which blocks to save, progress per request) and ``worker_cls`` (a
    ``KVConnectorWorker``, one per rank: saves and loads blocks of the KV tensors, asynchronously,
    and reports the loads done or failed). See docs/distributed.md, "Connector plugins".
    """
