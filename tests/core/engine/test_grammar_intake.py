"""A request's grammar is checked off the async client's event loop, within a deadline (issue 27, defect 7):
a grammar backend whose check takes its time (a registered plugin, as third-party backends are)."""
import threading
import time

import anyio
import pytest
from corectl.engine.grammar_intake import GrammarIntake
from corectl.engine.messages import EngineInfo
from corectl.errors import InvalidRequestError
from corectl.plugins import PluginManager, StructuredOutputBackendSpec, hookimpl, reset_plugin_manager
from corectl.sampling_params import StructuredOutputsParams
from corectl.structured.xgrammar_backend import XGrammarBackend


class SlowCheckBackend(XGrammarBackend):
    """xgrammar, whose check of a regex "slow-<seconds>" takes that long, and which records where it ran."""

    threads: list[threading.Thread] = []
    loads: list[float] = []  # each element: how long that load_library call slept

    @classmethod
    def load_library(cls):
        cls.loads.append(1.5)
        time.sleep(1.5)  # longer than the fixture's 1 s deadline, as xgrammar's import can be on a loaded machine

    @classmethod
    def validate(cls, spec):
        cls.threads.append(threading.current_thread())
        if spec.regex and spec.regex.startswith("slow-"):
            time.sleep(float(spec.regex.removeprefix("slow-")))
        super().validate(spec)


class _Plugin:
    @hookimpl
    def corectl_structured_output_backends(self):
        yield StructuredOutputBackendSpec("slow-check", f"{__name__}:SlowCheckBackend")


@pytest.fixture
def intake():
    manager = PluginManager()
    manager.register(_Plugin(), name="slow-check")
    reset_plugin_manager(manager)
    info = EngineInfo(model="m", model_dir="/m", tokenizer_dir="/m", platform="cpu", device="cpu", dtype="float32",
                      max_model_len=64, num_kv_blocks=4, block_size=16, vocab_size=49152, architecture="Llama",
                      structured_outputs_backend="slow-check")
    XGrammarBackend.validate(StructuredOutputsParams(regex="a"))  # xgrammar imported: the deadline times checks only
    SlowCheckBackend.threads.clear()
    SlowCheckBackend.loads.clear()
    try:
        yield GrammarIntake(info, deadline_s=1.0)
    finally:
        reset_plugin_manager()


def test_the_check_runs_on_a_thread_while_the_loop_goes_on(intake):
    ticks = []

    async def main():
        async with anyio.create_task_group() as tg:
            async def tick():
                while True:
                    ticks.append(time.monotonic())
                    await anyio.sleep(0.01)
            tg.start_soon(tick)
            await intake.check(StructuredOutputsParams(regex="slow-0.3"))
            tg.cancel_scope.cancel()
        return threading.current_thread()

    loop_thread = anyio.run(main)
    assert SlowCheckBackend.threads and SlowCheckBackend.threads[0] is not loop_thread
    assert len(ticks) > 3  # the loop ran while the check slept


def test_a_check_past_the_deadline_is_a_400_that_states_the_limit(intake):
    with pytest.raises(InvalidRequestError, match=r"took longer than 1 s to check") as err:
        anyio.run(intake.check, StructuredOutputsParams(regex="slow-3"))
    assert err.value.param == "structured_outputs.regex"


def test_refusals_of_the_backend_pass_through(intake):
    with pytest.raises(InvalidRequestError, match="admits no string") as err:
        anyio.run(intake.check, StructuredOutputsParams(regex=r"[^\s\S]"))
    assert err.value.param == "structured_outputs.regex"


def test_the_library_loads_once_outside_the_deadline(intake):
    """The first checks wait for the backend's library (1.5 s, past the 1 s deadline) and pass; the
    library loads once for concurrent first checks, and the deadline then times checks alone."""
    async def main():
        async with anyio.create_task_group() as tg:
            for regex in ("a", "b", "c"):
                tg.start_soon(intake.check, StructuredOutputsParams(regex=regex))
        await intake.check(StructuredOutputsParams(regex="d"))

    anyio.run(main)
    assert SlowCheckBackend.loads == [1.5]
    assert len(SlowCheckBackend.threads) == 4
    # slow-2.5: a spec no other test checks (a check that passed is remembered process-wide).
    with pytest.raises(InvalidRequestError, match=r"took longer than 1 s to check"):
        anyio.run(intake.check, StructuredOutputsParams(regex="slow-2.5"))
