"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a decode step.

A kernel launched with PDL may start while the kernel before it in the stream is still running:
its programs are placed once every program of that kernel has started, so they are resident and
waiting when it ends, instead of paying a launch after it (about a microsecond between graph nodes,
repeated by ten kernels a layer in a batch-1 step). The waiting is explicit: every kernel here
calls `grid_dependency` before its first load or store (the step's buffers, caches and partial
sums are written and read by the kernels around it; graph memory pools reuse them across layers),
which waits for the previous kernel to finish and flush, then lets the next kernel launch. Only
reads of what no kernel of the step writes (parameters, the rotary caches, the step's positions)
come before it, so their latency overlaps the kernel before (rms_norm.py, rotary.py).
Without PDL the same call compiles to nothing, so the interpreter and other GPUs run the kernels
unchanged. Kernels that do not wait (torch's, cuBLAS's) are launched without PDL and keep the
stream's ordinary ordering, so mixing them is safe.

`CORECTL_PDL=0` turns it off, to measure what it is worth.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from corectl import envs


@functools.lru_cache(maxsize=None)
def _capable(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (9, 0))


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: an NVIDIA GPU of compute capability 9.0 or
    newer, unless CORECTL_PDL=0."""
    return envs.pdl_enabled() and _capable(device)


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch (PDL launches only)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
