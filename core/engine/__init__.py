"""The engine: a synchronous core (scheduler + worker), the async actor around it, and its client."""
