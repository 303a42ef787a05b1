"""`corectl plan` against the CUDA worker: the KV capacity planned from the config alone is the one
the worker measures by profiling, within 10%.

Each engine is measured in a process of its own, as `corectl serve` runs one: in the test process,
memory that engines of earlier tests leave to the CUDA context (library workspaces, compiled
kernels) would count as non-torch memory of this one (2.3 GiB more, measured on an H100). The
worker counts every byte in use on the device that its allocator does not hold, other processes'
included, while the plan assumes an empty device: after the rest of tests/gpu the test process
still holds about 3 GiB (its context, libraries' workspaces, cached kernels), so the comparison
adds the blocks that memory would hold to the measured ones. The child's own context is in the
plan; the parent's, counted twice this way, is a few hundred MiB, inside the tolerance."""
import gc
import json
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl.config import EngineConfig  # noqa: E402
from corectl.planning import plan_deployment  # noqa: E402

_MEASURE = """
import json, sys
from corectl import LLM
info = LLM(**json.loads(sys.argv[1])).engine.info
print(json.dumps({"platform": info.platform, "dtype": info.dtype, "num_kv_blocks": info.num_kv_blocks,
                  "kv_capacity_tokens": info.kv_capacity_tokens, "max_model_len": info.max_model_len}))
"""


def _measured(args: dict) -> dict:
    """The engine's figures, plus `in_use`: bytes the device held (this process and any other)
    when it started."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    done = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(args)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "in_use": total - free}


@pytest.mark.parametrize("options", [
    {},
    # A third of the device and a 4x token budget: activations weigh more against the KV cache.
    {"gpu_memory_utilization": 0.3, "max_num_batched_tokens": 8192, "max_model_len": 4096},
], ids=["defaults", "budget-8192-utilization-0.3"])
def test_plan_agrees_with_the_measured_kv_capacity(options):
    args = {"model": "qwen3-0.6b", "load_format": "dummy", "enforce_eager": True, **options}
    plan = plan_deployment(EngineConfig(**args))
    info = _measured(args)
    block_bytes = plan.block_size * plan.kv_bytes_per_token
    on_empty_device = info["num_kv_blocks"] + info["in_use"] // block_bytes
    measured_fixed = plan.usable_bytes - on_empty_device * block_bytes
    print(f"\n{options}: planned {plan.num_kv_blocks} KV blocks, measured {info['num_kv_blocks']} with "
          f"{info['in_use'] / 2**30:.2f} GiB already in use ({on_empty_device} on an empty device); "
          f"weights + activations + non-torch planned {plan.fixed_bytes / 2**30:.3f} GiB, "
          f"measured {measured_fixed / 2**30:.3f} GiB")
    assert plan.device == info["platform"] and plan.dtype == info["dtype"] and plan.profiles_memory
    assert abs(plan.num_kv_blocks - on_empty_device) <= 0.1 * on_empty_device
    assert info["kv_capacity_tokens"] == info["num_kv_blocks"] * plan.block_size
    assert plan.max_concurrency == pytest.approx(on_empty_device * plan.block_size / info["max_model_len"], rel=0.1)


def test_an_explicit_kv_budget_sets_the_cache_and_the_plan():
    """--kv-cache-memory-bytes on a GPU: the cache is that many bytes whatever gpu_memory_utilization
    says (the plan too), and a budget past what the device has left is one clear error."""
    args = {"model": "qwen3-0.6b", "load_format": "dummy", "enforce_eager": True, "gpu_memory_utilization": 0.2,
            "kv_cache_memory_bytes": 3 * 2**30}
    plan = plan_deployment(EngineConfig(**args))
    block_bytes = plan.block_size * plan.kv_bytes_per_token
    assert plan.num_kv_blocks == 3 * 2**30 // block_bytes and plan.problem is None
    assert _measured(args)["num_kv_blocks"] == plan.num_kv_blocks
    too_big = {**args, "kv_cache_memory_bytes": 2 * torch.cuda.get_device_properties(0).total_memory}
    done = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(too_big)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode != 0 and "kv_cache_memory_bytes" in done.stderr and "does not fit" in done.stderr
