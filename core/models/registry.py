"""Maps a checkpoint's `architectures` to a model class through the plugin manager."""
from __future__ import annotations

from corectl.plugins import get_plugin_manager, import_dotted

from ..errors import ConfigError


def resolve_model_class(hf_config) -> type:
    archs = list(getattr(hf_config, "architectures", None) or [])
    specs = get_plugin_manager().model_architectures()
    for arch in archs:
        if arch in specs:
            return import_dotted(specs[arch].path)
    raise ConfigError(
        "model",
        f"architecture {archs or '(none given)'} is not supported; registered architectures: "
        f"{', '.join(sorted(specs))} (a plugin can add more, see `corectl plugins`)",
    )
