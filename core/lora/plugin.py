"""The built-in LoRA resolvers, registered through the `corectl` entry-point group like any other."""
from __future__ import annotations

from corectl.plugins import LoRAResolverSpec, hookimpl


@hookimpl
def corectl_lora_resolvers():
    yield LoRAResolverSpec("filesystem", "corectl.lora.resolvers:FilesystemResolver",
                           description="<--lora-resolver-root>/<name> holding adapter_config.json")
    yield LoRAResolverSpec("hub", "corectl.lora.resolvers:HubResolver",
                           description="a name shaped org/name, downloaded from the Hugging Face hub")
