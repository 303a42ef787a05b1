"""The OpenAI-compatible HTTP server: the Litestar app, its routes, and the tool and reasoning parsers."""
