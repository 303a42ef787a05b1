"""A speculative draft's share of a deployment plan (`corectl plan --speculative-config ...`): the
draft model's or EAGLE head's weights on a rank, and its KV cache, which holds a block for each of
the target's, so a block of the budget counts both (`Worker.kv_block_bytes`). Built on the meta
device as the worker builds it: dense, in the target's dtype, every layer of a draft model on the
first pipeline stage only, split over the ranks or whole on each (`draft_tensor_parallel_size`)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .config import EngineConfig
from .distributed import get_pp, viewed_whole
from .models.registry import resolve_model_class
from .planning_weights import ModelWeights, planned_model, rank_share, size_weights
from .spec_decode.draft_model import check_draft_vocabulary, draft_source
from .spec_decode.eagle_heads import prepare_head
from .worker.worker import _DTYPES, ModelInfo, _model_info


@dataclass(frozen=True)
class DraftShape:
    name: str
    info: ModelInfo
    weights: ModelWeights
    # Whole on every rank (draft_tensor_parallel_size 1 beside a split target); else split as the target.
    whole: bool

    def bytes_per_rank(self, target_tp: int) -> tuple[int, int]:
        """(served weight and buffer bytes, KV cache bytes a token) of one rank's share beside a
        target at `target_tp` ranks."""
        tp = 1 if self.whole else target_tp
        _, served, per_token = rank_share(self.info, self.weights, tp)
        return served + self.weights.buffer_bytes_per_rank(tp), per_token


def draft_shape(config: EngineConfig, target: nn.Module, target_hf, dtype: str,
                max_model_len: int) -> DraftShape | None:
    """The draft this stage's rank holds under `config.speculative_config`; None for n-gram
    lookup, no speculation, or a draft model on a pipeline stage after the first."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram" or (spec.method == "draft_model" and not get_pp().is_first):
        return None
    draft_model = spec.method == "draft_model"
    # A head's tensor names complete its config (`prepare_head`); a draft model needs its config only.
    source = draft_source(config, load_format="dummy" if draft_model else config.load_format)
    hf, target_name = source.hf_config, config.model or "default"
    if draft_model:
        check_draft_vocabulary(spec.model, hf.vocab_size, target_name, target_hf.vocab_size)
        model_cls = resolve_model_class(hf)
    else:
        model_cls = prepare_head(spec.method, source, target, target_hf, spec.model, target_name)
    with viewed_whole():
        model = planned_model(model_cls, hf, _DTYPES[dtype], max_model_len, None, ())
        info = _model_info(hf, model, dtype)
    whole = spec.draft_tensor_parallel_size == 1 and config.tensor_parallel_size > 1
    return DraftShape(spec.model, info, size_weights(model, info.head_dim), whole)
