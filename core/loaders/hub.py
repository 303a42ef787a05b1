"""Hugging Face Hub checkpoints: download (or find in the local hub cache) only the files we use."""
from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .. import envs
from ..errors import ModelNotFoundError
from .checkpoint_files import INDEX_FILE, index_shards

TOKENIZER_PATTERNS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.json",
    "*.jinja",
]
CONFIG_PATTERNS = ["config.json", "generation_config.json", INDEX_FILE, *TOKENIZER_PATTERNS]


def download_model(repo_id: str, revision: str | None, cache_dir: str | None, with_weights: bool) -> Path:
    """Snapshot folder with config, tokenizer and (when `with_weights`) the safetensors weights."""
    snapshot = _snapshot(repo_id, revision, cache_dir, CONFIG_PATTERNS)
    if not with_weights:
        return snapshot
    index = snapshot / INDEX_FILE
    # Fetch only the shards the index names: some repos carry a second copy of the weights.
    patterns = index_shards(index) if index.is_file() else ["*.safetensors"]
    # The snapshot folder is named by its commit, which pins the weights to the config just fetched.
    return _snapshot(repo_id, snapshot.name, cache_dir, patterns)


def download_adapter(repo_id: str, cache_dir: str | None) -> Path:
    """Snapshot folder of a PEFT adapter repo: its config and weights (the pickle file only to name it)."""
    return _snapshot(repo_id, None, cache_dir, ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"])


def download_tokenizer(repo_id: str, cache_dir: str | None) -> Path:
    return _snapshot(repo_id, None, cache_dir, TOKENIZER_PATTERNS)


def _snapshot(repo_id: str, revision: str | None, cache_dir: str | None, patterns: list[str]) -> Path:
    offline = envs.hub_offline()
    where = f"{repo_id}@{revision or 'main'}"
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns, local_files_only=offline
            )
        )
    except HFValidationError as exc:
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither an existing local path nor a hub id like 'org/name': {exc}"
        ) from exc
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path, and {where} is not in the hub cache "
            f"({cache_dir or 'default HF cache'}) while {why}: download it where the hub is reachable "
            f"(`huggingface-cli download {repo_id}`) or pass a local directory"
        ) from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local path, and the hub has no {where} "
            "(check the id and revision; gated or private repos need `huggingface-cli login`)"
        ) from exc
    except HfHubHTTPError as exc:
        raise ModelNotFoundError(f"downloading {where} from the hub failed: {exc}") from exc
