"""Malformed model files (issue 27, defect 4): any bytes in a config.json or a GGUF file give a model
config or a clear CorectlError, never another exception (hypothesis, a bounded number of examples)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from corectl.errors import CorectlError
from corectl.loaders.gguf_cache import read_gguf_header
from corectl.loaders.hf_config import load_hf_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)


def read_config(data: bytes):
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_bytes(data)
        try:
            return load_hf_config(Path(folder), None)[0]
        except CorectlError as exc:
            assert str(exc)
            return exc


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "holds a JSON list, not an object"),
    ('"llama"', "holds a JSON str, not an object"),
    ("{not json", "cannot read a model config"),
    ('{"model_type": ["llama"]}', "model_type ['llama']"),
])
def test_a_config_that_is_not_an_object_of_settings_is_a_clear_error(text, message):
    error = read_config(text.encode())
    assert isinstance(error, CorectlError) and message in str(error)


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_as_config_json_give_a_config_or_a_clear_error(data):
    read_config(data)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(LLAMA) + ["rope_scaling", "torch_dtype", "head_dim"]), json_values,
                       max_size=6))
def test_a_llama_config_with_any_field_values_gives_a_config_or_a_clear_error(fields):
    read_config(json.dumps({**LLAMA, **fields}).encode())


def tiny_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("context_length", 128), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("head_count", 2), ("head_count_kv", 1)]:
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    path = tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    assert read_gguf_header(path).hf_config.hidden_size == 8  # the file as written reads
    return path.read_bytes()


def read_gguf(data: bytes):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "model.gguf")
        path.write_bytes(data)
        try:
            return read_gguf_header(path).hf_config
        except CorectlError as exc:
            assert str(exc)
            return exc


def test_a_truncated_gguf_is_a_clear_error(gguf_bytes):
    for size in (0, 3, 24, len(gguf_bytes) // 2, len(gguf_bytes) - 1):
        error = read_gguf(gguf_bytes[:size])
        assert isinstance(error, CorectlError), size


@FUZZ
@given(st.data())
def test_any_truncation_or_corruption_of_a_gguf_gives_a_config_or_a_clear_error(gguf_bytes, data):
    corrupt = bytearray(gguf_bytes[:data.draw(st.integers(0, len(gguf_bytes)))])
    for _ in range(data.draw(st.integers(0, 4))):
        if corrupt:
            corrupt[data.draw(st.integers(0, len(corrupt) - 1))] = data.draw(st.integers(0, 255))
    read_gguf(bytes(corrupt))


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_as_a_gguf_give_a_clear_error(data):
    read_gguf(b"GGUF" + data)
