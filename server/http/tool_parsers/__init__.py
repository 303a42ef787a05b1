"""Tool parsers: find the tool calls in a model's free text (`tool_choice` "auto" with
`--enable-auto-tool-choice --tool-call-parser NAME`), found by name through the
`corectl_tool_parsers` hook."""
