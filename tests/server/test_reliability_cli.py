"""Malformed inputs to `corectl plan` and `corectl serve` (issue 27, defect 4): a zero device memory, a
truncated or corrupt GGUF, a config.json that is not an object are one clear line and exit code 2."""
from __future__ import annotations

import subprocess
import sys

import pytest
from corectl.server.cli.main import main
from support.models import smollm2_gguf


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad-models")
    data = smollm2_gguf().read_bytes()[:1 << 20]
    (folder / "truncated.gguf").write_bytes(data)
    corrupt = bytearray(data[:4096])
    corrupt[8:16] = b"\xff" * 8  # the tensor count
    (folder / "corrupt.gguf").write_bytes(bytes(corrupt))
    (folder / "list").mkdir()
    (folder / "list" / "config.json").write_text("[1, 2]")
    (folder / "list" / "model.safetensors").write_bytes(b"")
    return folder


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("corectl: error: "), err
    return err


@pytest.mark.parametrize("args, message", [
    (["--device-memory", "0GiB"], "device_memory: must be a positive size"),
    (["--device", "cpu", "--device-memory", "0GiB"], "device_memory: must be a positive size"),
])
def test_plan_with_zero_device_memory(capsys, args, message):
    # A preset: the memory check is the same for every model, and it follows reading the model, which
    # for the default GGUF's header takes seconds.
    assert main(["plan", "llama-tiny", *args]) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize("name, message", [
    ("truncated.gguf", "is not a readable GGUF file"),
    ("corrupt.gguf", "is not a readable GGUF file"),
    ("list", "not an object of model settings"),
])
def test_plan_of_a_malformed_model(capsys, bad_models, name, message):
    assert main(["plan", str(bad_models / name)]) == 2
    assert message in one_line_error(capsys)


def test_serve_of_a_malformed_model_is_the_same_one_line(bad_models):
    result = subprocess.run([sys.executable, "-m", "corectl.server.cli", "serve", str(bad_models / "list"),
                             "--port", "0"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("corectl: error: ") and "not an object of model settings" in last, result.stderr
    assert "Traceback" not in result.stderr
