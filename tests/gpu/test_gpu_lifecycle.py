"""An engine that is deleted gives its GPU memory back, so a process can build another one."""
import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)

from corectl import LLM  # noqa: E402

GIB = 2 ** 30


def _live_cuda_tensors() -> list[str]:
    """What still holds device memory, with the types that refer to each tensor (for the failure message)."""
    live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    live.sort(key=lambda t: -t.numel() * t.element_size())
    return [f"{tuple(t.shape)} {t.dtype} held by {[type(r).__name__ for r in gc.get_referrers(t)][:4]}"
            for t in live[:8]]


def test_a_deleted_engine_frees_its_gpu_memory():
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    llm = LLM(model="qwen3-0.6b", load_format="dummy", enforce_eager=True, gpu_memory_utilization=0.3)
    assert torch.cuda.memory_allocated() - before > GIB  # the weights and the KV cache
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() - before
    assert left < 64 * 2 ** 20, (f"{left / GIB:.3f} GiB still allocated after the engine was deleted: "
                                 + "; ".join(_live_cuda_tensors()))
