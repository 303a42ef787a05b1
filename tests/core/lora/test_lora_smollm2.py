"""LoRA on the embedded SmolLM2: token-exact against transformers + peft on the dequantized fp32
weights, and on the GGUF int4 weights as served on CPUs (the adapter adds to whatever the base
projection computed)."""
from __future__ import annotations

import pytest
from corectl import LLM, LoRARequest, SamplingParams
from support.adapters import save_adapter
from support.models import hf_greedy

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_adapter(default_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-lora") / "adapter"
    model = save_adapter(default_model_dir, folder, rank=8, seed=7, lora_alpha=4)
    return LoRARequest("smol", 1, str(folder)), model


def test_fp32_greedy_matches_peft(default_model_dir, smollm2_adapter):
    lora, reference_model = smollm2_adapter
    llm = LLM(str(default_model_dir), dtype="float32", enable_lora=True, max_model_len=256, kv_cache_memory_gib=0.05)
    prompt = llm.get_tokenizer().encode("The capital of France is")
    expected = hf_greedy(reference_model, prompt, GREEDY.max_tokens)[0]
    out = llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == expected


def test_readme_lora_example(smollm2_adapter):
    """README's LoRA example runs as written (the embedded GGUF served 4-bit, the adapter added to
    its int4 projections), its placeholder path replaced by a real adapter: the adapter changes the
    answer."""
    import contextlib
    import io
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "LoRARequest" in b]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace("path/to/sql-adapter", smollm2_adapter[0].lora_path), "README.md", "exec"), {})
    adapted, base = eval(printed.getvalue())
    assert adapted and base and adapted != base
