"""Tokenizer.from_dir loads a TokenizersBackend folder of a llama/qwen2/qwen3 model without
AutoTokenizer (which imports torch): the same class and the same behaviour as AutoTokenizer's."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from corectl import tokenizer as tokenizer_module
from corectl.tokenizer import DIRECT_MODEL_TYPES, Tokenizer
from transformers import AutoTokenizer

TEXT = "Émile says hi 😀 <|im_start|>user\nliteral<|im_end|>"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def _tokenizer_folder(default_model_dir: Path, folder: Path, model_type: str) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


@pytest.mark.parametrize("model_type", sorted(DIRECT_MODEL_TYPES))
def test_direct_load_is_what_autotokenizer_loads(default_model_dir, tmp_path, model_type):
    folder = _tokenizer_folder(default_model_dir, tmp_path, model_type)
    reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert tokenizer_module._loads_directly(folder)
    tok = Tokenizer.from_dir(folder)
    assert type(tok.hf) is type(reference)
    assert tok.encode(TEXT) == reference.encode(TEXT)
    assert tok.decode(reference.encode(TEXT), skip_special_tokens=False) == reference.decode(reference.encode(TEXT))
    assert tok.apply_chat_template(MESSAGES) == reference.apply_chat_template(MESSAGES, tokenize=False,
                                                                              add_generation_prompt=True)
    assert (tok.eos_token_id, tok.bos_token_id, tok.vocab_size) == (reference.eos_token_id, reference.bos_token_id,
                                                                     len(reference))
    assert tok.hf.special_tokens_map == reference.special_tokens_map
    assert tok.hf.get_added_vocab() == reference.get_added_vocab()
    assert tok.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert repr(tok.hf.init_kwargs) == repr(reference.init_kwargs)


def test_other_folders_go_through_autotokenizer(default_model_dir, tmp_path):
    """A model type outside the list (qwen2: AutoTokenizer swaps in Qwen2Tokenizer), or a folder
    naming its own tokenizer class, is AutoTokenizer's to load."""
    folder = _tokenizer_folder(default_model_dir, tmp_path, "qwen2")
    assert not tokenizer_module._loads_directly(folder)
    assert type(Tokenizer.from_dir(folder).hf) is type(AutoTokenizer.from_pretrained(str(folder)))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert not tokenizer_module._loads_directly(folder)


def test_api_process_imports_no_torch(default_model_dir):
    """What the API process imports (the CLI, the app, the engine process's client side) and its
    tokenizer load leave torch unimported: torch alone costs each `corectl serve` seconds of CPU."""
    code = ("import sys; import corectl.server.cli.main, corectl.server.cli.serve, corectl.server.http.app, "
            "corectl.engine.remote, corectl.loaders.default_model; from corectl.tokenizer import Tokenizer; "
            f"Tokenizer.from_dir({str(default_model_dir)!r}); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('transformers.models.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
