"""The offline LLM's default SamplingParams come from the model's generation_config.json (vLLM's
`generation_config`: "auto", "vllm" or a folder), on a small random Qwen3 checkpoint."""
from __future__ import annotations

import json

import pytest
from corectl import LLM, SamplingParams
from corectl.errors import ConfigError
from corectl.generation_config import check_generation_overrides, generation_defaults
from support.models import build_random_checkpoint

ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory_gib=0.02)
MODEL_DEFAULTS = {"temperature": 0.0, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.3, "max_new_tokens": 3}
PROMPT = [1, 15, 27, 300, 41]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_dir):
    folder = build_random_checkpoint("qwen3", tmp_path_factory.mktemp("genconfig"), default_model_dir)
    (folder / "generation_config.json").write_text(json.dumps({**MODEL_DEFAULTS, "eos_token_id": 2}))
    return folder


def test_generate_without_params_takes_the_model_defaults(checkpoint):
    llm = LLM(str(checkpoint), **ENGINE)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.repetition_penalty,
            defaults.max_tokens) == (0.0, 5, 0.9, 1.3, 3)
    implicit = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
    explicit = llm.generate([PROMPT], SamplingParams(temperature=0.0, top_k=5, top_p=0.9, repetition_penalty=1.3,
                                                     max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(implicit.token_ids) == 3 and implicit.token_ids == explicit.token_ids
    chat = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0].outputs[0]
    assert len(chat.token_ids) <= 3 and (len(chat.token_ids) == 3 or chat.finish_reason == "stop")


def test_vllm_and_folder_sources(checkpoint, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "temperature": 0.5}))
    assert generation_defaults(str(tmp_path), str(checkpoint)) == {"max_tokens": 5, "temperature": 0.5}
    assert generation_defaults("vllm", str(checkpoint)) == {}
    assert generation_defaults("auto", str(tmp_path / "no-such-model")) == {}
    with pytest.raises(ConfigError, match="generation_config"):
        LLM(str(checkpoint), generation_config="nowhere/at/all", **ENGINE)  # refused before the engine loads


def test_overrides_set_fields_over_the_source(checkpoint):
    """vLLM's override_generation_config: its keys over the model's file ("auto") or alone ("vllm")."""
    llm = LLM(str(checkpoint), override_generation_config={"max_new_tokens": 2, "top_k": 7}, **ENGINE)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 7, 2)
    assert len(llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids) == 2
    assert generation_defaults("vllm", str(checkpoint), {"temperature": 0.25}) == {"temperature": 0.25}


@pytest.mark.parametrize(("overrides", "message"), [
    ('{"temp": 1}', "'temp' is not a sampling default"),
    ({"temperature": -1}, "temperature must be in"),
    ({"top_k": "x"}, "top_k must be a number"),
    ("[1]", "must be a JSON object"),
    ("{oops", "not valid JSON"),
])
def test_bad_overrides_are_refused_before_the_engine_loads(overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        check_generation_overrides(overrides)
    assert caught.value.field == "override_generation_config"
