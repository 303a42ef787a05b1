"""Session servers shared by test modules whose tests need the same flags (a pytest plugin: a module
takes them with `pytest_plugins = ["support.server_a_fixtures"]`, so each starts once per session, or
once per pytest-xdist worker, however many modules use it; a fixture imported into two modules would
start twice). A `corectl serve` costs ~15 s of CPU to become ready."""
from __future__ import annotations

from pathlib import Path

import pytest
from support.server import SMALL_ENGINE, ServerProcess

TOOLS_TEMPLATE = Path(__file__).parents[2] / "examples" / "chat_templates" / "smollm2_tools.jinja"


@pytest.fixture(scope="session")
def tools_server():
    """The ChatML tools template of examples/, the hermes tool parser (auto tool choice) and the
    deepseek_r1 reasoning parser, and no Responses store (test_structured_api, and
    test_responses_api's store-disabled test). The tools prompt is long: more context and cache
    than the other servers, so requests run together."""
    proc = ServerProcess(*SMALL_ENGINE, "--max-model-len", "1024", "--kv-cache-memory", "0.15",
                         "--chat-template", str(TOOLS_TEMPLATE), "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1",
                         "--responses-store-max-entries", "0").wait_ready()
    yield proc
    assert proc.stop() == 0
