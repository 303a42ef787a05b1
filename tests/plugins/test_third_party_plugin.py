"""The example third-party plugin (examples/third_party_plugin), installed the way users install one.

Its entry point is found, `corectl plugins` lists what it adds, discovery stays lazy, and its Gemma
model decodes token-exactly like transformers on its `cpu_reference` platform.
"""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.discovery import resolve_platform
from corectl.errors import ConfigError
from corectl.plugins import get_plugin_manager, reset_plugin_manager
from support.models import build_random_checkpoint, held_bytes, hf_greedy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "third_party_plugin"
PACKAGE = "corectl_example_plugin"
DIST = "corectl-example-plugin"
PLUGIN = "example"
NEW_TOKENS = 24
LOGPROB_TOL = 1e-3


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _env_with(site: Path) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """Install the example into a private folder put on sys.path, never into the venv, so the
    other test modules keep seeing only the built-in plugins once this module is done."""
    root = tmp_path_factory.mktemp("example_plugin")
    # Building from a copy keeps build/ and egg-info out of the source tree.
    source = shutil.copytree(EXAMPLE, root / "source",
                             ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
          "--no-index", "--target", str(site), str(source)])
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    reset_plugin_manager()
    yield site
    sys.path.remove(str(site))
    for name in [m for m in sys.modules if m.partition(".")[0] == PACKAGE]:
        del sys.modules[name]
    importlib.invalidate_caches()
    reset_plugin_manager()


def test_cli_lists_the_plugin_with_its_package(plugin_site):
    corectl = Path(sys.executable).with_name("corectl")
    out = _run([str(corectl), "plugins"], env=_env_with(plugin_site)).stdout
    rows = {tuple(line.split()[:4]) for line in out.splitlines()}
    assert ("platform", "cpu_reference", PLUGIN, DIST) in rows, out
    assert ("model", "GemmaForCausalLM", PLUGIN, DIST) in rows, out
    assert ("attention", "torch_eager", PLUGIN, DIST) in rows, out
    assert ("quantization", "rtn_int4", PLUGIN, DIST) in rows, out
    assert ("platform", "cpu", "cpu", "corectl") in rows, out


def test_discovery_imports_no_model_or_kernel_code(plugin_site):
    script = (
        "import sys; from corectl.plugins import PluginManager; pm = PluginManager(); "
        "pm.platforms(); pm.model_architectures(); pm.attention_backends(); pm.quantization_methods(); "
        f"print(sorted(m for m in sys.modules if m.startswith('{PACKAGE}')))"
    )
    out = _run([sys.executable, "-c", script], env=_env_with(plugin_site)).stdout
    assert out.strip() == f"['{PACKAGE}', '{PACKAGE}.plugin']"


def test_reference_platform_is_selected_only_by_name(plugin_site):
    pm = get_plugin_manager()
    assert pm.provider(PLUGIN) == DIST
    assert pm.platforms()["cpu_reference"].priority < pm.platforms()["cpu"].priority
    assert resolve_platform("auto").name != "cpu_reference"
    platform = resolve_platform("cpu_reference")
    assert platform.capabilities().dtypes == ("float32",)
    assert platform.resolve_dtype("auto", "bfloat16") == "float32"
    with pytest.raises(ConfigError, match="cpu_reference"):
        platform.resolve_dtype("bfloat16", None)


def _build_gemma_checkpoint(folder: Path, tokenizer_dir: Path) -> Path:
    """A small random Gemma with MQA and head_dim != hidden / heads, plus the embedded model's tokenizer."""
    from transformers import AutoModelForCausalLM, GemmaConfig

    config = GemmaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=512, initializer_range=0.5,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # transformers starts the (1 + w) norm offsets at zero; random ones test the offset.
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    for item in tokenizer_dir.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(item, folder / item.name)
    return folder


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, default_model_dir):
    return _build_gemma_checkpoint(tmp_path_factory.mktemp("gemma"), default_model_dir)


@pytest.fixture(scope="module")
def gemma_reference(gemma_dir):
    """Prompts and transformers' greedy continuations (eager attention, as the reference backend)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32, attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (5, 17, 40, 64)]
    return prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize(("platform", "backend", "dtype"), [
    ("cpu_reference", None, "auto"),          # the plugin's platform, its default backend
    ("cpu", "torch_eager", "float32"),        # the plugin's backend on the built-in platform
])
def test_gemma_greedy_matches_transformers(plugin_site, gemma_dir, gemma_reference, platform, backend, dtype):
    # A 48-token budget splits the longer prompts into chunks that attend to cached pages.
    llm = LLM(str(gemma_dir), platform=platform, attention_backend=backend, dtype=dtype,
              kv_cache_memory_gib=0.05, max_num_batched_tokens=48)
    assert (llm.engine.info.platform, llm.engine.info.architecture) == (platform, "GemmaForCausalLM")
    assert llm.engine.info.dtype == "float32"
    prompts, expected = gemma_reference
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out, (tokens, logprobs) in zip(outputs, expected):
        assert out.outputs[0].token_ids == tokens
        got = [next(iter(pos.values())).logprob for pos in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < LOGPROB_TOL
    again = llm.generate(prompts[2:], params, use_tqdm=False)      # warm prefix cache
    assert [o.outputs[0].token_ids for o in again] == [t for t, _ in expected[2:]]


def test_quantization_method_from_a_plugin_serves_its_4bit_weights(plugin_site, tmp_path, default_model_dir):
    """`--quantization rtn_int4` comes from the plugin's hook; the engine decodes the greedy tokens
    of the dense model of the weights it quantized (or diverges at near-ties of that model)."""
    from support.quant_checkpoints import greedy_divergences, random_prompts
    from safetensors.torch import load_file, save_file

    rtn = importlib.import_module(f"{PACKAGE}.quantization")
    dense = build_random_checkpoint("llama", tmp_path / "dense", default_model_dir, seed=3, hidden_size=128,
                                    intermediate_size=256, initializer_range=0.1)
    reference = shutil.copytree(dense, tmp_path / "reference")
    tensors = load_file(dense / "model.safetensors")
    save_file({name: rtn.rtn_int4_dequantized(t) if name.endswith("_proj.weight") else t
               for name, t in tensors.items()}, str(reference / "model.safetensors"))
    engine = {"dtype": "float32", "kv_cache_memory_gib": 0.05, "max_model_len": 128}
    llm = LLM(str(dense), quantization="rtn_int4", **engine)
    assert llm.engine.info.quantization == "rtn_int4 (cpu_int4pack)"
    layer = llm.engine.executor.worker.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(layer.quant_method, rtn.RTNInt4Method) and not hasattr(layer, "weight")
    greedy_divergences(llm, LLM(str(reference), **engine), random_prompts())


def test_plan_sizes_a_plugin_method_as_it_serves(plugin_site, tmp_path, default_model_dir, monkeypatch):
    """The plugin's `served_bytes` (packed int4, from dense weights loaded first) is what the plan
    counts, and the engine then holds exactly that."""
    from corectl.backends.cpu import worker as cpu_worker
    from corectl.config import EngineConfig
    from corectl.planning import plan_deployment

    monkeypatch.setattr(cpu_worker, "prepack_linears", lambda model, dtype: 0)
    dense = build_random_checkpoint("llama", tmp_path / "dense", default_model_dir, seed=3, hidden_size=128,
                                    intermediate_size=256)
    engine = {"model": str(dense), "quantization": "rtn_int4", "dtype": "float32", "kv_cache_memory_gib": 0.05,
              "max_model_len": 128}
    plan = plan_deployment(EngineConfig(**engine), device="cpu")
    assert plan.quantization == "rtn_int4 (cpu_int4pack)"
    assert plan.weight_bytes + plan.buffer_bytes == held_bytes(LLM(**engine))
    assert plan.loading_weight_bytes_per_rank > plan.weight_bytes_per_rank  # loaded dense, then packed


def test_a_plugin_that_fails_to_import_is_skipped_and_listed_as_such(tmp_path):
    """One broken third-party package must not take the others down: it is named, skipped, and
    `corectl plugins` shows it unavailable with its error."""
    site = tmp_path / "site"
    (site / "broken_plugin").mkdir(parents=True)
    (site / "broken_plugin" / "__init__.py").write_text('raise ImportError("boom from broken_plugin")\n')
    dist_info = site / "broken_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[corectl]\nbroken = broken_plugin\n")
    corectl = Path(sys.executable).with_name("corectl")
    done = _run([str(corectl), "plugins"], env=_env_with(site))
    rows = {tuple(line.split()[:4]) for line in done.stdout.splitlines()}
    assert ("plugin", "broken", "broken", "broken-plugin") in rows and ("platform", "cpu", "cpu", "corectl") in rows
    assert "no: failed to load (ImportError: boom from broken_plugin)" in done.stdout
    assert "CORECTL_DISABLE_PLUGINS=broken" in done.stderr and "Traceback" not in done.stderr
