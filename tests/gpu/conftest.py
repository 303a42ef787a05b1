"""The GPU suite: real kernels at real sizes, bf16 parity with transformers, CUDA graphs.

Every module skips itself without CUDA. Run the suite in its own pytest process
(`python -m pytest tests/gpu`): tests/conftest.py turns Triton's interpreter on for the CPU kernel
tests, and Triton fixes a kernel's mode when its module is imported. So when only this folder is
requested the interpreter is switched off here, before any kernel module loads; in a session
mixing suites the GPU tests skip, saying why.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.gpu import ARCHITECTURES, build_checkpoint

GPU_DIR = Path(__file__).parent.resolve()


def pytest_configure(config):
    if not torch.cuda.is_available():
        return
    root = config.invocation_params.dir
    targets = [(root / arg.split("::")[0]).resolve() for arg in config.args]
    if targets and all(t == GPU_DIR or GPU_DIR in t.parents for t in targets):
        os.environ["TRITON_INTERPRET"] = "0"


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    from corectl.backends.triton.attention import decode_attention
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(decode_attention._decode_kernel, InterpretedFunction):
        pytest.skip("the Triton kernels were loaded for the CPU interpreter (TRITON_INTERPRET=1) by another "
                    "suite in this session: run `python -m pytest tests/gpu` on its own")


@pytest.fixture(scope="session", params=sorted(ARCHITECTURES))
def checkpoint(request, tmp_path_factory) -> Path:
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
