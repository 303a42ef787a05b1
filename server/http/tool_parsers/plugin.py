"""The built-in tool parsers, registered through the `corectl` entry-point group like any other."""
from __future__ import annotations

from corectl.plugins import ToolParserSpec, hookimpl


@hookimpl
def corectl_tool_parsers():
    base = "corectl.server.http.tool_parsers.builtin"
    yield ToolParserSpec("hermes", f"{base}:HermesToolParser",
                         description="<tool_call>{json}</tool_call> (Hermes, Qwen2.5, Qwen3)")
    yield ToolParserSpec("llama3_json", f"{base}:Llama3JsonToolParser",
                         description="JSON calls as the whole output, or after <|python_tag|> (Llama 3.x)")
    yield ToolParserSpec("mistral", f"{base}:MistralToolParser", description="[TOOL_CALLS][{json}, ...] (Mistral)")
    yield ToolParserSpec("openai", f"{base}:HarmonyToolParser",
                         description="harmony's messages to functions.<name> (gpt-oss)")
