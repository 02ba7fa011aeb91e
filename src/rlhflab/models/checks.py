"""Checks of model paths that need no model library: one line before anything loads (light to import)."""

from __future__ import annotations

from pathlib import Path

from rlhflab.errors import ConfigError


def is_local_path(name_or_path: str) -> bool:
    """Hub ids look like 'org/name'; anything starting with '/', '.' or '~' or existing locally is a path."""
    return name_or_path.startswith(("/", ".", "~")) or Path(name_or_path).exists()


def check_pretrained(key: str, name_or_path: str | None) -> None:
    """Fail before loading anything when a local model path is not a saved model."""
    if name_or_path is None or not is_local_path(name_or_path):
        return
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{key}: '{name_or_path}' is not a saved model (no config.json there); "
            f"give a directory written by save_pretrained, a hub id, or null to build/train it"
        )
