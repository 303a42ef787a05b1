"""`--speculative-config` checked at the edge: vLLM's defaults, and one clear error for each
malformed or contradictory config."""
from __future__ import annotations

import pytest
from corectl import EngineConfig
from corectl.errors import ConfigError


def test_ngram_defaults_and_json_string_form():
    spec = EngineConfig.from_kwargs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').speculative_config
    assert (spec.method, spec.k, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 5, 5)
    one_bound = EngineConfig(speculative_config={"model": "[ngram]", "num_speculative_tokens": 2,
                                                 "prompt_lookup_max": 3}).speculative_config
    assert (one_bound.method, one_bound.prompt_lookup_min, one_bound.prompt_lookup_max) == ("ngram", 3, 3)
    draft = EngineConfig(speculative_config={"model": "path/to/draft", "num_speculative_tokens": 4}).speculative_config
    assert (draft.method, draft.model, draft.draft_tensor_parallel_size) == ("draft_model", "path/to/draft", 1)
    eagle = EngineConfig(speculative_config={"method": "eagle3", "model": "heads/e3", "num_speculative_tokens": 3})
    assert (eagle.speculative_config.method, eagle.speculative_config.model) == ("eagle3", "heads/e3")


def test_vllms_draft_loading_and_limit_fields_are_kept():
    spec = EngineConfig(speculative_config={
        "method": "draft_model", "model": "d", "num_speculative_tokens": 2, "revision": "v2", "quantization": "fp8",
        "max_model_len": 1024, "disable_by_batch_size": 8, "enforce_eager": False}).speculative_config
    assert (spec.revision, spec.quantization, spec.max_model_len, spec.disable_by_batch_size) == ("v2", "fp8", 1024, 8)


def test_a_draft_splits_as_the_target_unless_told_to_run_whole():
    spec = {"model": "path/to/draft", "num_speculative_tokens": 4}
    split = EngineConfig(tensor_parallel_size=4, speculative_config=spec).speculative_config
    whole = EngineConfig(tensor_parallel_size=4, speculative_config={**spec, "draft_tensor_parallel_size": 1})
    assert (split.draft_tensor_parallel_size, whole.speculative_config.draft_tensor_parallel_size) == (4, 1)
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 .*got 2"):
        EngineConfig(tensor_parallel_size=4, speculative_config={**spec, "draft_tensor_parallel_size": 2})


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "ngram", "num_speculative_tokens": 3', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "between 1 and 16, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "between 1 and 16, got 17"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method 'medusa'"),
    ({"num_speculative_tokens": 2}, "say which proposer"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "needs \"model\": the head's path"),
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
     "apply to method \"ngram\" only"),
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     r"draft_tensor_parallel_size must be 1 \(the whole draft on every rank\) or the target's "
     r"tensor_parallel_size 1 \(the draft split as the target is\), got 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) is larger than prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "at least 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "some/draft"}, "takes no model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "apply to method \"ngram\" only"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0},
     "got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown field `lookahead`"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be at least 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}, "prompt_lookup_max must be at least 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"}, "quantization does not apply"),
    ({"method": "ngram", "num_speculative_tokens": 2, "enforce_eager": True}, "enforce_eager is the engine's"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size must be"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "max_model_len": 0}, "max_model_len must"),
])
def test_each_bad_config_gives_one_clear_error(value, message):
    with pytest.raises(ConfigError, match=message) as info:
        EngineConfig.from_kwargs(speculative_config=value)
    assert "speculative_config" in str(info.value)
