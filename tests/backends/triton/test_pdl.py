"""Programmatic dependent launch is chosen per device: NVIDIA GPUs of compute capability 9.0 and
newer, unless CORECTL_PDL=0; elsewhere (the CPU interpreter here) kernels launch plainly."""
import torch
from corectl.backends.triton import pdl


def test_the_cpu_interpreter_launches_plainly():
    assert pdl.pdl_enabled(torch.device("cpu")) is False


def test_capable_devices_launch_with_pdl_unless_switched_off(monkeypatch):
    monkeypatch.setattr(pdl, "_capable", lambda device: True)
    monkeypatch.delenv("CORECTL_PDL", raising=False)
    assert pdl.pdl_enabled(torch.device("cuda", 0)) is True
    for off in ("0", "false", "no"):
        monkeypatch.setenv("CORECTL_PDL", off)
        assert pdl.pdl_enabled(torch.device("cuda", 0)) is False
