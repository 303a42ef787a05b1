"""The CPU platform: torch eager execution over the paged KV cache."""
