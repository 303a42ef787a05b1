"""vLLM's kv_cache_memory_bytes (`--kv-cache-memory-bytes`, human-readable as vLLM's): the KV cache is
that many bytes on any platform, refused below one sequence or beside `--kv-cache-memory`."""
from __future__ import annotations

import argparse

import pytest
from corectl import LLM
from corectl.config import EngineConfig
from corectl.errors import ConfigError
from corectl.server.cli.engine_args import human_readable_int
from support.models import build_random_checkpoint

ENGINE = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_dir):
    return build_random_checkpoint("llama", tmp_path_factory.mktemp("kv-bytes"), default_model_dir)


def test_the_cache_gets_the_bytes_asked(checkpoint):
    def blocks(**budget) -> int:
        return LLM(str(checkpoint), **budget, **ENGINE).engine.info.num_kv_blocks

    one = blocks(kv_cache_memory_bytes=300_000)
    assert blocks(kv_cache_memory_gib=300_000 / 2**30) == one
    assert blocks(kv_cache_memory_bytes=600_000) in (2 * one, 2 * one + 1)


def test_too_few_bytes_for_one_sequence_are_refused_naming_the_flag(checkpoint):
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes: .* fewer than one sequence of max_model_len=64"):
        LLM(str(checkpoint), kv_cache_memory_bytes=4096, **ENGINE)


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache_memory_bytes=0), "must be a positive integer"),
    (dict(kv_cache_memory_bytes=2**20, kv_cache_memory_gib=1.0), "not both"),
])
def test_bad_budgets_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**options)


@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("1k", 1000), ("1K", 1024), ("25.6k", 25_600), ("8G", 8 * 2**30), ("8g", 8 * 10**9),
    (" 2M ", 2 * 2**20), ("1t", 10**12), ("1.005k", 1005), ("-1", -1),
])
def test_human_readable_integers_read_as_vllm_reads_them(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "2.5", "eight", "8GB", "k", ""])
def test_other_spellings_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)
