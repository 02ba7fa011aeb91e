"""Checks of saved model directories that need no model library (light to import).

A damaged directory (unparsable config.json, a truncated or zero-length
safetensors file) is named in one line before anything tries to load it,
instead of surfacing as a SafetensorError traceback half a minute later.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhflab.errors import ConfigError


def is_local_path(name_or_path: str) -> bool:
    """Hub ids look like 'org/name'; anything starting with '/', '.' or '~' or existing locally is a path."""
    return name_or_path.startswith(("/", ".", "~")) or Path(name_or_path).exists()


def safetensors_damage(path: Path) -> str | None:
    """What is wrong with a safetensors file (its header and size disagree), or None."""
    size = path.stat().st_size
    if size < 8:
        return f"{path.name} is truncated ({size} bytes)"
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if 8 + n > size:
            return f"{path.name} is truncated (header of {n} bytes, file of {size})"
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return f"{path.name} has an unreadable header"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{path.name} is {size} bytes, its header describes {8 + n + end}"
    return None


def model_dir_damage(path: Path) -> str | None:
    """What is wrong with a save_pretrained directory, or None (weights in .bin files are not checked)."""
    config = path / "config.json"
    if not config.is_file():
        return "no config.json there"
    try:
        json.loads(config.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"config.json is not valid JSON ({err})"
    index = path / "model.safetensors.index.json"
    files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() \
        else sorted(path.glob("*.safetensors"))
    for file in files:
        if not file.is_file():
            return f"{file.name} is missing"
        if problem := safetensors_damage(file):
            return problem
    return None


def check_pretrained(key: str, name_or_path: str | None) -> None:
    """Fail before loading anything when a local model path is not an intact saved model."""
    if name_or_path is None or not is_local_path(name_or_path):
        return
    problem = model_dir_damage(Path(name_or_path).expanduser())
    if problem:
        raise ConfigError(f"{key}: '{name_or_path}' is not an intact saved model ({problem}); "
                          "give a directory written by save_pretrained, a hub id, or null to build/train it")


def check_hub(key: str, name: str | None) -> None:
    """Before loading a hub id: it must be in the local Hugging Face cache, or the hub must answer.
    One line instead of a minute of retries and a traceback when neither holds."""
    if name is None or is_local_path(name):
        return
    import os

    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(name, "config.json"), str) or isinstance(
        try_to_load_from_cache(name, "tokenizer_config.json"), str
    ):
        return
    fix = f"download it where the hub is reachable (hf download {name}) or give a local directory"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ConfigError(f"{key}: '{name}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {fix}")
    try:
        HfApi().model_info(name, timeout=10)
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}: no model '{name}' on the Hugging Face hub (or it is private); check the name, or {fix}") from None
    except Exception as err:  # no network, DNS, proxy, timeout
        reason = str(err).splitlines()[0][:120]
        raise ConfigError(f"{key}: '{name}' is not in the local Hugging Face cache and the hub cannot be reached ({reason}); {fix}") from None
