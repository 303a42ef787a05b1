"""Engine options that vLLM takes as JSON text on its command line (speculative, KV transfer and
compilation configs): the text decoded, or one ConfigError naming the option."""
from __future__ import annotations

import json
from typing import Any

from .errors import ConfigError


def decode_json_option(field: str, value: Any) -> Any:
    """`value` decoded when it is JSON text; any other value as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(field, f"not valid JSON ({exc.msg} at character {exc.pos}): {value!r}") from None
