"""Shared test setup. Triton's interpreter must be chosen before any kernel module imports triton."""
import ctypes
import ctypes.util
import gc
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
# Bytecode caches, even where the environment turns them off (PYTHONDONTWRITEBYTECODE, as some CI
# images do): the suite starts some 200 interpreters (servers, engine and rank processes, CLI runs)
# that would each compile corectl's source again, and each pytest worker would rewrite every test
# module's asserts again (collection: 23 s of CPU a worker without the caches, 15 s with them).
# Popped here, in the process that starts the xdist workers, so they and every process after them
# inherit it; __pycache__ is ignored by git.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False
# Under xdist every worker (and the engine processes it spawns, which inherit the variable) gets its
# share of the cores: torch's default of one thread per core in each worker oversubscribes them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))

import pytest  # noqa: E402

# A worker's peak with its engines, and the servers and engine processes it starts beside it.
_WORKER_GIB = 7


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core and one more, as memory allows. The workers spend part of their
    time waiting on processes they started (servers coming up, ranks, a browser); a third worker on
    two cores kept them busy: 10:22 against 11:08 for the whole suite on a 2-core machine, peak
    memory 17.5 against 14.3 GB of 24."""
    cores = len(os.sched_getaffinity(0))
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores + 1, int(memory_gib // _WORKER_GIB)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's fixtures are gone, hand the memory they freed back to the system: glibc keeps
    freed heap pages, so a worker that built a few engines grew to ~6 GB by the end of the suite (the
    servers and engine processes beside it need that memory on a 24 GB machine). Only past
    `_TRIM_ABOVE`: a full collection of a worker's heap takes ~0.2-0.5 s."""
    yield
    if (nextitem is None or nextitem.module is not item.module) and _resident_bytes() > _TRIM_ABOVE:
        gc.collect()
        _LIBC.malloc_trim(0)


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
_TRIM_ABOVE = 1536 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Modules sharing a session server run on one worker (support/xdist_groups.py)."""
    if config.getvalue("dist") == "loadscope":
        from support.xdist_groups import SessionServerScheduling

        return SessionServerScheduling(config, log)
    return None


@pytest.fixture(scope="module")
def isolated_env(tmp_path_factory):
    """For modules that build shape presets: presets write their config to a cache folder of the
    module's own, and no test may reach the hub."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORECTL_CACHE_DIR", str(tmp_path_factory.mktemp("corectl-cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded model converted to an HF directory (cached across runs in CORECTL_CACHE_DIR)."""
    from corectl.config import EngineConfig
    from corectl.loaders import resolve_model_source

    return resolve_model_source(EngineConfig()).model_dir


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory, default_model_dir):
    """A tiny random-weight Qwen2.5-VL checkpoint (tests/support/vision_models.py), built once."""
    from support.vision_models import build_qwen2_5_vl

    return build_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"), default_model_dir)


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory, default_model_dir):
    """A tiny random-weight Gemma 3 vision-language checkpoint (tests/support/vision_models.py), built once."""
    from support.vision_models import build_gemma3

    return build_gemma3(tmp_path_factory.mktemp("gemma3"), default_model_dir)


@pytest.fixture(scope="session")
def llm_fp32():
    """One fp32 engine on the embedded model, shared by the tests that only generate through it."""
    from corectl import LLM

    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory_gib=0.25, max_num_seqs=32)


@pytest.fixture(scope="session")
def llm_int4():
    """One engine on the embedded model's default CPU path (its GGUF 4-bit weights through the int4
    kernel), for tests that compare corectl with corectl (speculation on and off, batched and alone,
    a server and this process): a decode step costs a fifth of fp32's CPU. The kernel is row-invariant,
    so a prompt gets the same tokens alone and batched. Numerics against transformers stay on `llm_fp32`."""
    from corectl import LLM

    return LLM(max_model_len=1024, kv_cache_memory_gib=0.25, max_num_seqs=32)


@pytest.fixture
def cpu_with_fp8_reference(monkeypatch):
    """The CPU platform listing the FP8 torch reference kernel (dequantize math), which no
    built-in CPU lists: FP8 checkpoints then run end to end here."""
    import dataclasses

    from corectl.backends.cpu.platform import CPUPlatform

    caps = CPUPlatform().capabilities()
    monkeypatch.setattr(CPUPlatform, "capabilities",
                        lambda self: dataclasses.replace(caps, quantization_kernels=("fp8_reference",)))
