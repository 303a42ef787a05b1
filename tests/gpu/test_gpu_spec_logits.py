"""W11's verify steps: an LM head whose rows go to cuBLAS writes fp32 logits directly
(`corectl.models.llama.fp32_logits`), the products unrounded, where the switch off rounds them to
the model dtype first."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from corectl.models.llama import fp32_logits
from corectl.models.parallel import ParallelLMHead

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_lm_head_writes_unrounded_fp32_logits_at_verify_rows(monkeypatch):
    torch.manual_seed(0)
    head = ParallelLMHead(512, 4000).to("cuda", torch.bfloat16)
    # 64 requests x (k + 1 = 5) rows: the GEMM path, not a decode GEMV.
    hidden = torch.randn(320, 512, device="cuda", dtype=torch.bfloat16)
    exact = hidden.double() @ head.weight.double().t()
    with torch.inference_mode():
        logits = fp32_logits(head, hidden)
        monkeypatch.setenv("CORECTL_LOGITS_FP32_GEMM", "0")
        rounded = fp32_logits(head, hidden)
    assert logits.dtype == rounded.dtype == torch.float32
    assert torch.equal(rounded, F.linear(hidden, head.weight).float())
    # fp32 accumulation's error only: far below bf16's rounding of each logit (8 bits of mantissa).
    assert (logits.double() - exact).abs().max() < (rounded.double() - exact).abs().max() / 20
