"""A third-party platform gets tensor and data parallelism from the `Platform` contract alone.

`HostAcceleratorPlatform` is written the way a plugin writes one (a `PlatformSpec` and an
attention backend registered with the plugin manager, corectl's CPU worker reused as the example
plugin reuses it): the host CPU presented as an accelerator whose runtime confines a process to
its devices through `HOST_ACCEL_VISIBLE_DEVICES`. It sets only what the contract asks of every
platform; rank device selection and data-parallel confinement are the base class's defaults, and
nothing in core names it.
"""
from __future__ import annotations

import pytest
import torch
from corectl import LLM, SamplingParams
from corectl.config import EngineConfig
from corectl.discovery import resolve_platform
from corectl.engine.dp import EngineProcessInit
from corectl.errors import ConfigError
from corectl.platform import Platform, PlatformCaps
from corectl.plugins import AttentionBackendSpec, PlatformSpec, get_plugin_manager, hookimpl, reset_plugin_manager
from support.models import build_random_checkpoint

NAME = "host_accel"
VISIBLE = "HOST_ACCEL_VISIBLE_DEVICES"


class HostAcceleratorPlatform(Platform):
    name = NAME
    device_type = "cpu"
    visible_devices_env = VISIBLE

    @classmethod
    def is_available(cls) -> bool:
        return True

    def capabilities(self) -> PlatformCaps:
        return PlatformCaps(dtypes=("float32",), default_dtype="float32", sampling_draw="inverse_cdf")

    def distributed_backend(self) -> str:
        return "gloo"

    def worker_cls(self):
        from corectl.backends.cpu.worker import CPUWorker

        return CPUWorker

    def default_attention_backend(self, model_config) -> str:
        return f"{NAME}_sdpa"


class HostAcceleratorPlugin:
    @hookimpl
    def corectl_platforms(self):
        yield PlatformSpec(NAME, f"{__name__}:HostAcceleratorPlatform", priority=-20)

    @hookimpl
    def corectl_attention_backends(self):
        yield AttentionBackendSpec(f"{NAME}_sdpa", "corectl.backends.cpu.attention:TorchSDPABackend",
                                   platforms=(NAME,))


@pytest.fixture(scope="module")
def registered():
    get_plugin_manager().register(HostAcceleratorPlugin(), name=NAME)
    yield resolve_platform(NAME)
    reset_plugin_manager()


def test_a_rank_gets_its_device_through_the_platform(registered):
    assert registered.device_for_rank(1) == torch.device("cpu", 1)
    with pytest.raises(ConfigError, match="ray_resources_per_rank"):
        registered.ray_resources_per_rank()


def test_each_data_parallel_engine_is_confined_by_the_platforms_variable(registered, monkeypatch):
    config = EngineConfig(platform=NAME, data_parallel_size=2, tensor_parallel_size=2)
    monkeypatch.delenv(VISIBLE, raising=False)
    assert [EngineProcessInit(i, config).env for i in range(2)] == [{VISIBLE: "0,1"}, {VISIBLE: "2,3"}]
    monkeypatch.setenv(VISIBLE, "4,5,6,7")
    init = EngineProcessInit(1, config)
    assert init.env == {VISIBLE: "6,7"}
    with pytest.raises(ConfigError, match="data_parallel_size"):
        EngineProcessInit(2, config.replace(data_parallel_size=3))  # needs 8 and 9 of the 4 listed
    assert EngineProcessInit(0, config.replace(data_parallel_size=1)).env == {}
    init()  # in the engine's process, before any device is touched
    assert registered.visible_devices() == "6,7"


def test_a_platform_that_claims_no_batch_invariance_refuses_the_flag(registered):
    with pytest.raises(ConfigError, match="^batch_invariant: platform 'host_accel' has no batch-invariant kernels"):
        LLM(platform=NAME, batch_invariant=True)


@pytest.mark.slow
def test_tensor_parallel_ranks_on_a_third_party_platform_match_one_rank(registered, tmp_path, default_model_dir):
    folder = build_random_checkpoint("llama", tmp_path / "llama", default_model_dir)
    prompts = [[(7 * i + 3 * j) % 40000 + 100 for j in range(9 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    # One rank runs in this process, two in rank processes ("mp", the default above one rank).
    for size in (1, 2):
        llm = LLM(str(folder), platform=NAME, tensor_parallel_size=size, dtype="float32", max_model_len=128,
                  kv_cache_memory_gib=0.01)
        try:
            assert llm.engine.info.platform == NAME
            tokens.append([list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.engine.executor.shutdown()
    assert tokens[0] == tokens[1]
