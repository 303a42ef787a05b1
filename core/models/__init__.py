"""Model implementations and the architecture registry (found through plugins)."""
