"""`corectl plan` against the CUDA worker: the KV capacity planned from the config alone is the one
the worker measures by profiling, within 10%.

Each engine is measured in a process of its own, as `corectl serve` runs one: in the test process,
memory that engines of earlier tests leave to the CUDA context (library workspaces, compiled
kernels) would count as non-torch memory of this one (2.3 GiB more, measured on an H100). The
worker counts every byte in use on the device that its allocator does not hold, other processes'
included, so the test process first returns its own cached blocks (about 3 GiB after the rest of
tests/gpu); its CUDA context stays (a few hundred MiB, inside the tolerance)."""
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
    gc.collect()
    torch.cuda.empty_cache()
    done = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(args)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("options", [
    {},
    # A third of the device and a 4x token budget: activations weigh more against the KV cache.
    {"gpu_memory_utilization": 0.3, "max_num_batched_tokens": 8192, "max_model_len": 4096},
], ids=["defaults", "budget-8192-utilization-0.3"])
def test_plan_agrees_with_the_measured_kv_capacity(options):
    args = {"model": "qwen3-0.6b", "load_format": "dummy", "enforce_eager": True, **options}
    plan = plan_deployment(EngineConfig(**args))
    info = _measured(args)
    measured_fixed = plan.usable_bytes - info["num_kv_blocks"] * plan.block_size * plan.kv_bytes_per_token
    print(f"\n{options}: planned {plan.num_kv_blocks} KV blocks, measured {info['num_kv_blocks']}; "
          f"weights + activations + non-torch planned {plan.fixed_bytes / 2**30:.3f} GiB, "
          f"measured {measured_fixed / 2**30:.3f} GiB")
    assert plan.device == info["platform"] and plan.dtype == info["dtype"] and plan.profiles_memory
    assert abs(plan.num_kv_blocks - info["num_kv_blocks"]) <= 0.1 * info["num_kv_blocks"]
    assert plan.max_concurrency == pytest.approx(info["kv_capacity_tokens"] / info["max_model_len"], rel=0.1)
