"""Fixtures shared by the quantization tests."""
from __future__ import annotations

import dataclasses

import pytest
from corectl.backends.cpu.platform import CPUPlatform


@pytest.fixture
def cpu_with_fp8_reference(monkeypatch):
    """The CPU platform listing the FP8 torch reference kernel (dequantize math), which no
    built-in CPU lists: FP8 checkpoints then run end to end here."""
    caps = CPUPlatform().capabilities()
    monkeypatch.setattr(CPUPlatform, "capabilities",
                        lambda self: dataclasses.replace(caps, quantization_kernels=("fp8_reference",)))
