"""The OpenAI-compatible HTTP server and the `corectl` command line."""
