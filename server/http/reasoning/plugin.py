"""The built-in reasoning parsers, registered through the `corectl` entry-point group like any other."""
from __future__ import annotations

from corectl.plugins import ReasoningParserSpec, hookimpl


@hookimpl
def corectl_reasoning_parsers():
    base = "corectl.server.http.reasoning.builtin"
    yield ReasoningParserSpec("qwen3", f"{base}:Qwen3ReasoningParser",
                              description="<think>...</think> when the output opens with <think> (Qwen3, QwQ)")
    yield ReasoningParserSpec("deepseek_r1", f"{base}:DeepSeekR1ReasoningParser",
                              description="reasoning up to </think>, opened by the template (DeepSeek-R1)")
    yield ReasoningParserSpec("openai_gptoss", f"{base}:HarmonyReasoningParser",
                              description="harmony's analysis channel (gpt-oss)")
