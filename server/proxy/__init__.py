"""`corectl proxy`: one OpenAI endpoint in front of prefill and decode instances (disaggregated serving)."""
