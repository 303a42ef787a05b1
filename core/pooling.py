"""Pooling models: how a decoder LM is run for embeddings instead of text (vLLM's `--runner pooling`).

A pooling engine runs every request as *prefill only*: the prompt's hidden states (no LM head) are
pooled into one vector when its last chunk has run, and the request ends there. What pools is
decided once, when the engine starts (`resolve_pooling`), from the flags or the checkpoint:

- `runner`: "generate", "pooling", or "auto": pooling when the checkpoint is a sentence-transformers
  model (`modules.json` lists a Pooling module), names a bare backbone (`Qwen3Model`, `BertModel`)
  or a sequence classifier (`*ForSequenceClassification`).
- A sequence classifier (a model class with `classify`) pools the token its head reads
  (`classifier_pooling`) and its vectors are the head's logits (`PoolingInfo.task == "classify"`);
  a class with `prepare_classifier` first completes the config from the tokenizer beside the
  checkpoint (a decoder reranker's `classifier_from_token`).
- `pooling_type`: LAST (the last prompt token's hidden state: Qwen3-Embedding, decoder embedders),
  MEAN (the mean over every prompt token) or CLS (the first token's); the flag wins, then
  `1_Pooling/config.json`, else CLS for an encoder (BERT) and LAST for a decoder.
- `normalize`: L2-normalise the vector; the flag wins, then whether `modules.json` lists a
  Normalize module, else True (vLLM's default for embedding models).

The worker pools raw fp32 vectors; the client (`finish_embedding`) truncates them to the
request's Matryoshka `dimensions` and normalises them, so a long input split into chunks
(`--embed-chunking`) can average raw chunk vectors before the same finishing step.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np

from .errors import ConfigError, InvalidRequestError

RUNNERS = ("auto", "generate", "pooling")
# vLLM's older spelling: `--task embed` is `--runner pooling`.
RUNNER_ALIASES = {"embed": "pooling"}
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' 1_Pooling/config.json flag -> our pooling type.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# Architectures the auto runner pools: bare backbones (`Qwen3Model`, `BertModel`) and classifiers.
_POOLING_SUFFIXES = ("Model", "ForSequenceClassification")
# Most inputs one embeddings request (or `LLM.embed` call under a server) may carry.
MAX_EMBED_INPUTS = 2048


@dataclass(frozen=True)
class PoolingInfo:
    """What a pooling engine makes, as clients need to know it (in `EngineInfo.pooling`).

    `hidden_size` is the length of a pooled vector; `matryoshka_dimensions` lists the sizes a
    vector may be truncated to (empty: any size up to `hidden_size`), and `is_matryoshka` says
    whether truncation is meaningful for this model at all (the HF config's `is_matryoshka` or
    `matryoshka_dimensions`, as vLLM reads them; set them with `--hf-overrides`).
    """

    pooling_type: str
    normalize: bool
    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    # "embed", or "classify": a sequence classifier whose vectors are its `hidden_size` class
    # logits, named by `labels` (the config's id2label); one label makes a cross-encoder's score.
    task: str = "embed"
    labels: tuple[str, ...] = ()
    # An encoder-only model (BERT): prompts run whole, without a KV cache (EngineConfig.encoder_only).
    encoder: bool = False


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request options of an embedding (vLLM's `PoolingParams`).

    dimensions: truncate the vector to this many leading components (Matryoshka models only).
    normalize: L2-normalise the vector; None takes the model's default (`PoolingInfo.normalize`).
    """

    dimensions: int | None = None
    normalize: bool | None = None


@dataclass(frozen=True)
class _SentenceTransformers:
    pooling_type: str | None
    normalize: bool


def read_sentence_transformers(model_dir: Path) -> _SentenceTransformers | None:
    """The pooling a sentence-transformers checkpoint declares (`modules.json`), or None."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    modules = json.loads(modules_path.read_text())
    types = {m.get("type"): m for m in modules}
    if _ST_POOLING not in types:
        return None
    config_path = model_dir / types[_ST_POOLING].get("path", "1_Pooling") / "config.json"
    pooling_type = None
    if config_path.is_file():
        flags = json.loads(config_path.read_text())
        chosen = [mode for key, mode in _ST_MODES.items() if flags.get(key)]
        others = sorted(k for k, v in flags.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES)
        if others or len(chosen) > 1:
            raise ConfigError("pooling_type", f"{config_path} asks for {', '.join(others or chosen)}; corectl pools "
                              f"with one of {', '.join(POOLING_TYPES)}: pass --pooling-type to choose")
        pooling_type = chosen[0] if chosen else None
    return _SentenceTransformers(pooling_type, _ST_NORMALIZE in types)


def resolve_pooling(config, model_dir: Path, hf_config, resolve_model_class: Callable[[object], type]
                    ) -> PoolingInfo | None:
    """What the engine pools, or None for a generative engine (see the module docstring);
    `resolve_model_class` maps a config to the model class (the registry's)."""
    st = read_sentence_transformers(model_dir)
    runner = config.runner
    if runner == "auto":
        archs = getattr(hf_config, "architectures", None) or []
        runner = "pooling" if st is not None or any(a.endswith(_POOLING_SUFFIXES) for a in archs) else "generate"
    if runner == "generate":
        return None
    model_cls = resolve_model_class(pooling_architectures(hf_config))
    encoder = getattr(model_cls, "is_encoder", False)
    if hasattr(model_cls, "classify"):
        if hasattr(model_cls, "prepare_classifier"):
            model_cls.prepare_classifier(hf_config, None if config.skip_tokenizer_init else model_dir)
        return _classifier(config, hf_config, model_cls, encoder)
    pooling_type = (config.pooling_type or (st.pooling_type if st is not None else None)
                    or ("CLS" if encoder else "LAST"))
    normalize = config.normalize if config.normalize is not None else (st.normalize if st is not None else True)
    dims = getattr(hf_config, "matryoshka_dimensions", None) or ()
    return PoolingInfo(pooling_type, normalize, hf_config.hidden_size,
                       is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False) or dims),
                       matryoshka_dimensions=tuple(sorted(dims)), encoder=encoder)


def _classifier(config, hf_config, model_cls: type, encoder: bool) -> PoolingInfo:
    """A sequence classifier pools as its head reads (CLS for encoders, LAST for decoders) and
    returns raw logits, never normalised."""
    pooling_type = model_cls.classifier_pooling
    if config.pooling_type not in (None, pooling_type):
        raise ConfigError("pooling_type", f"{model_cls.__name__} classifies the {pooling_type} token; "
                          f"--pooling-type {config.pooling_type} does not apply to it")
    num_labels = hf_config.num_labels
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
    return PoolingInfo(pooling_type, False, num_labels, task="classify", labels=labels, encoder=encoder)


def pooling_architectures(hf_config) -> SimpleNamespace:
    """A config to resolve the model class by: a bare backbone (`Qwen3Model`) runs on the class of
    its causal LM (`Qwen3ForCausalLM`), whose head a pooling engine drops."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return SimpleNamespace(architectures=[name for a in archs for name in (a, a.removesuffix("Model") + "ForCausalLM")])


def pooling_weights(weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """A checkpoint's tensors as a headless model loads them: the LM head is dropped, and a
    backbone saved alone (`layers.0...`, as Qwen3-Embedding is) takes the causal LM's `model.` prefix."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        # `score.`: a decoder classifier's head, beside its backbone.
        yield (name if name.startswith(("model.", "score.")) else "model." + name), tensor


def check_pooling_params(params: PoolingParams, info: PoolingInfo) -> None:
    """Raise InvalidRequestError naming `dimensions` when the model cannot truncate as asked."""
    dims = params.dimensions
    if dims is None:
        return
    if not info.is_matryoshka:
        raise InvalidRequestError("this model does not support matryoshka representation: dimensions cannot be "
                                  "set (a model that supports it says so with is_matryoshka or "
                                  "matryoshka_dimensions in its config; see --hf-overrides)", param="dimensions")
    if not 1 <= dims <= info.hidden_size:
        raise InvalidRequestError(f"dimensions must be in [1, {info.hidden_size}], got {dims}", param="dimensions")
    if info.matryoshka_dimensions and dims not in info.matryoshka_dimensions:
        raise InvalidRequestError(f"this model supports dimensions {list(info.matryoshka_dimensions)}, not {dims}",
                                  param="dimensions")


def finish_embedding(raw: np.ndarray, params: PoolingParams, info: PoolingInfo) -> np.ndarray:
    """A pooled fp32 vector as the request asked for it: truncated to `dimensions`, then normalised
    (Matryoshka vectors are normalised after truncation)."""
    vector = raw[: params.dimensions] if params.dimensions is not None else raw
    normalize = info.normalize if params.normalize is None else params.normalize
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32, copy=False)


def vector_from_bytes(data: bytes) -> np.ndarray:
    """A pooled vector as it crosses the engine boundary: little-endian float32."""
    return np.frombuffer(data, dtype="<f4").astype(np.float32)
