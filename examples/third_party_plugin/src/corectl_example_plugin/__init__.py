"""An example third-party corectl plugin: Gemma models and the `cpu_reference` platform.

Nothing here is imported while corectl lists plugins except `plugin.py`, which only yields spec
records; the model, platform and attention modules load when an engine uses them.
"""
