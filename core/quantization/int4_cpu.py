"""Groups of integer weights on CPUs: affine int4 (kernel "cpu_int4pack": AWQ, GPTQ, GGUF's Q4 types)
and exact int8 groups (a GGUF Q8_0 head, `pack_int8`).

The GEMM is `int4_cpu_kernel.c` (with `int4_cpu_amx.c` included where the CPU has AMX), built once per
machine with the host's C compiler (`cc -O3 -march=native -fopenmp`, a few seconds) into the cache
folder and called through ctypes on torch's OpenMP threads. It takes fp32 activations and fp16 scales
and mins, shares each unpacked weight tile among a block of rows, and computes every output element by
the same operations whatever the number of rows: a request's greedy tokens do not depend on what else
is in its batch. With AVX512-VNNI it multiplies int16 activation codes (a step per group of inputs,
taken as two int8 halves) by the integer codes exactly, by vpdpbusd, and by AMX's tdpbsud for blocks of
12-16 rows; elsewhere fp32 activations by weights dequantized in fp32 (the kernel's header;
`grouped_layout()` says which, and `_tiled` packs for it). Measured in docs/performance.md (CPU
section, issue 30).

Where no C compiler is found (a slim container), int4 layers run torch's kernel instead: bf16
activations and a bf16 (scale, zero at code 8) pair per group; `int4_linear` tells the two layouts
apart by the dtype of `scale_zero` (fp16: ours, bf16: torch's). The packed weight is [N, K/2]
uint8 either way (two codes a byte).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .. import envs

logger = logging.getLogger(__name__)

TILE = 16  # outputs per tile of the kernel's layout (L in int4_cpu_kernel.c)
TORCH_ACT_DTYPE = torch.bfloat16  # torch's int4 GEMM is vectorised for bf16 activations only
_SOURCE = Path(__file__).with_name("int4_cpu_kernel.c")
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and flags (a cache shared across machines
    must not hand one CPU another's build)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "|".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def _local_includes(source: Path) -> list[Path]:
    """The files beside `source` that it includes (`#include "name"`): part of what a build is keyed by."""
    return [source.with_name(name) for name in re.findall(r'^#include "([^"]+)"', source.read_text(), re.MULTILINE)]


def build_library(source: Path, arch: str = "native") -> ctypes.CDLL | None:
    """The C file `source` built for `-march=arch` into the cache folder (once per source, compiler,
    flags and CPU) and loaded, or None where it cannot be built (no C compiler, or it failed)."""
    flags = (*_FLAGS, f"-march={arch}")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler (cc): %s is not built, torch's operators serve instead", source.name)
        return None
    code = source.read_bytes() + b"".join(path.read_bytes() for path in _local_includes(source))
    key = hashlib.sha256(code + " ".join((compiler, *flags, _cpu_identity())).encode()).hexdigest()[:16]
    target = envs.cache_dir() / "cpu_kernels" / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed into place, so processes building at once never load a half file.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        built = subprocess.run([compiler, *flags, "-o", partial, str(source)], capture_output=True, text=True)
        if built.returncode != 0:
            os.unlink(partial)
            logger.warning("%s did not build (%s): torch's operators serve instead\n%s", source.name, compiler,
                           built.stderr[-2000:])
            return None
        os.replace(partial, target)
    return ctypes.CDLL(str(target))


@functools.lru_cache(maxsize=None)
def kernel_library(arch: str = "native") -> ctypes.CDLL | None:
    """The kernel built for `-march=arch` (the host's CPU; tests build an older one for the loop
    other CPUs run), or None where it cannot be built (then torch's int4 GEMM serves: slower at
    batch > 1 and not batch-invariant)."""
    lib = build_library(_SOURCE, arch)
    if lib is None:
        return None
    lib.grouped_gemm.restype = None
    lib.grouped_layout.restype = ctypes.c_int
    lib.grouped_gemm.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int]
    return lib


def _tiled(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout (int4_cpu_kernel.c's header) of codes [N, K] (uint8 for 4 bits, int8 for 8)
    and scales and mins [N, K/g]."""
    n, k = codes.shape
    tiles = n // TILE
    if kernel_library().grouped_layout() == 1:  # vpdpbusd's quads: 64 bytes per 8 (4-bit) or 4 inputs
        if bits == 4:
            octets = codes.to(torch.uint8).view(tiles, TILE, k // 8, 2, 4)  # [.., c, half, t]: input 8c + 4 half + t
            packed = (octets[..., 0, :] | (octets[..., 1, :] << 4)).permute(0, 2, 1, 3)
        else:  # unsigned, q + 128 (the kernel takes the offset back out of its integer sums)
            packed = (codes.to(torch.int16) + 128).to(torch.uint8).view(tiles, TILE, k // 4, 4).permute(0, 2, 1, 3)
    elif bits == 4:
        pairs = codes.to(torch.uint8).view(tiles, TILE, k // 2, 2)
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).transpose(1, 2)
    else:
        packed = codes.to(torch.int8).view(tiles, TILE, k).transpose(1, 2).view(torch.uint8)
    pair = torch.stack([scales.float(), mins.float()]).view(2, tiles, TILE, -1)
    return packed.contiguous().view(n, k * bits // 8), pair.permute(1, 3, 0, 2).to(torch.float16).contiguous()


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros_at_8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scale_zero) from codes [N, K] in [0, 16), per-group scales [N, K/g] and
    the weight value at code 8 per group [N, K/g]."""
    group = codes.shape[1] // scales.shape[1]
    # Groups of 16 inputs: the int16 loop quantizes activations 16 at a time.
    if kernel_library() is not None and codes.shape[0] % TILE == 0 and group % 16 == 0:
        # The kernel computes with w = q * scale + min: the min is exact in fp32 from the zero at 8.
        return _tiled(codes, scales, zeros_at_8.float() - 8 * scales.float(), bits=4)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scale_zero = torch.stack([scales.t(), zeros_at_8.t()], dim=-1).to(TORCH_ACT_DTYPE).contiguous()
    return packed, scale_zero


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scale_zero) for `int8_linear` from int8 codes [N, K] (N a multiple of 16)
    and per-group scales [N, K/g]; needs the kernel (`kernel_library()`)."""
    return _tiled(codes, scales, torch.zeros_like(scales), bits=8)


def register_int4pack(layer: torch.nn.Module, codes: torch.Tensor, scales: torch.Tensor,
                      zeros_at_8: torch.Tensor) -> None:
    """Pack (as `pack_int4`) and keep the result as the layer's buffers `packed_weight` and
    `scale_zero`: buffers, so the model's tensors count them (`corectl plan` compares), but
    left out of state dicts (the checkpoint holds another layout)."""
    packed, scale_zero = pack_int4(codes, scales, zeros_at_8)
    layer.register_buffer("packed_weight", packed, persistent=False)
    layer.register_buffer("scale_zero", scale_zero, persistent=False)


def int4pack_bytes(out_features: int, in_features: int, group: int) -> int:
    """Bytes `pack_int4` returns for an [N, K] weight in groups of `group` inputs: two codes a
    byte, and a (scale, min) pair of 2-byte floats per group and output (either layout)."""
    return out_features * in_features // 2 + in_features // group * out_features * 2 * 2


def _grouped_gemm(bits: int, x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor,
                  group: int) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype. A decode step makes ~120 of these calls: each torch
    operator left out (no-op casts and copies, a view of a 2-D result) is microseconds of its host time."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.float().contiguous()
    m, k = rows.shape
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    kernel_library().grouped_gemm(bits, m, n, k, group, rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                                  scale_zero.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    if scale_zero.dtype == torch.float16:
        out = _grouped_gemm(4, x, packed, scale_zero, group)
    else:
        rows = x.reshape(-1, x.shape[-1]).to(TORCH_ACT_DTYPE)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group, scale_zero)
        out = out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
    """x @ W.T for W packed by `pack_int8`."""
    return _grouped_gemm(8, x, packed, scale_zero, group)
