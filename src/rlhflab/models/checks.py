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
    """What is wrong with a save_pretrained directory, or None (weights in .bin files are not checked, only that
    there are some)."""
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
    if not files and not any(path.glob("*.bin")):  # a config.json alone: transformers' OSError traceback once the
        return "no weights there (model.safetensors or pytorch_model.bin)"  # run was made and had trained its stages
    for file in files:
        if not file.is_file():
            return f"{file.name} is missing"
        if problem := safetensors_damage(file):
            return problem
    return None


# What save_pretrained writes of a tokenizer (a fast one, a slow one's vocabulary or sentencepiece model).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


def tokenizer_damage(path: Path) -> str | None:
    """What keeps a directory from holding a saved tokenizer, or None."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return f"none of {', '.join(TOKENIZER_FILES[:3])}, ... there"
    return None


def check_pretrained(key: str, name_or_path: str | None, tokenizer: bool = False) -> None:
    """Fail before loading anything when a local model path is not an intact saved model (`tokenizer`: a saved
    tokenizer, which tokenizer.save_pretrained writes without a config.json: model.tokenizer)."""
    if name_or_path is None or not is_local_path(name_or_path):
        return
    path = Path(name_or_path).expanduser()
    if not path.exists():  # it said 'not an intact saved model (no config.json there)', as of an empty directory
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise ConfigError(f"{key}: no such directory '{name_or_path}'{where}; give a directory "
                          f"written by save_pretrained, a hub id, or null{'' if tokenizer else ' to build/train it'}")
    if tokenizer:  # the doc's fix for a tokenizer without a pad token, given as a folder, was refused for its config.json
        problem = tokenizer_damage(path) if path.is_dir() else f"'{name_or_path}' is a file"
        if problem:
            raise ConfigError(f"{key}: '{name_or_path}' is not a saved tokenizer ({problem}); give a directory written "
                              "by tokenizer.save_pretrained (or a model's), a hub id, or null for the model's own")
        return
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():  # memory=lora/hydra's policy/
        merged = path / "merged"
        fix = (f"give {Path(name_or_path) / 'merged'}, the merged model beside it" if (merged / "config.json").is_file() else
               "run with output.merge_lora=true and give its policy/merged, or merge it yourself (peft's "
               "merge_and_unload, then save_pretrained)")
        raise ConfigError(f"{key}: '{name_or_path}' is a LoRA adapter (adapter_config.json), not a whole model; {fix}")
    problem = model_dir_damage(path)
    if problem:
        raise ConfigError(f"{key}: '{name_or_path}' is not an intact saved model ({problem}); "
                          "give a directory written by save_pretrained, a hub id, or null to build/train it")


def architectures(name_or_path: str | None) -> list[str]:
    """The `architectures` of a saved model's config.json (a local directory, or a hub id in the local cache); []
    where there is none to read (a hub id not cached: its load says what is wrong)."""
    if name_or_path is None:
        return []
    if is_local_path(name_or_path):
        config = Path(name_or_path).expanduser() / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json")
        config = Path(cached) if isinstance(cached, str) else None
    if config is None or not config.is_file():
        return []
    return json.loads(config.read_text()).get("architectures") or []


def check_reward_head(key: str, name_or_path: str | None) -> None:
    """A reward model given ready-made must have its score head: a causal LM's checkpoint (GPT2LMHeadModel,
    LlamaForCausalLM) loads as a sequence classifier with a fresh, random one, and transformers' warning about it
    is quieted, so the run trained against noise. Read from its config.json, before anything loads."""
    found = architectures(name_or_path)
    if found and all(a.endswith(("ForCausalLM", "LMHeadModel")) for a in found):
        raise ConfigError(f"{key}: '{name_or_path}' is a language model ({', '.join(found)}) with no reward head, "
                          "which would be a random one; give a reward model (AutoModelForSequenceClassification, e.g. "
                          "what stage rm saved), or null to train one on task.preferences_path")


def check_language_model(key: str, name_or_path: str | None) -> None:
    """The mirror of check_reward_head: a reward model given as the policy (model.sft_path, model.name_or_path) loaded
    as a causal LM with a fresh, random LM head, and the run trained and saved it without a word."""
    found = architectures(name_or_path)
    if found and all(a.endswith("ForSequenceClassification") for a in found):
        raise ConfigError(f"{key}: '{name_or_path}' is a reward model ({', '.join(found)}) with no language-model head, "
                          "which would be a random one; give a causal LM (AutoModelForCausalLM, e.g. what stage sft "
                          "saved), and the reward model as model.reward_model_path")


def check_hub(key: str, name: str | None) -> None:
    """Before loading a hub id: it must be in the local Hugging Face cache, or the hub must answer.
    One line instead of a minute of retries and a traceback when neither holds."""
    if name is None or is_local_path(name):
        return
    from huggingface_hub import try_to_load_from_cache

    cached = any(isinstance(try_to_load_from_cache(name, f), str) for f in ("config.json", "tokenizer_config.json"))
    _cached_or_reachable(key, name, cached, "model", "local Hugging Face cache")


# The data files task=prompts reads, by their suffix, and the `datasets` builder that reads each.
DATA_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
DATA_SUFFIXES = tuple(DATA_BUILDERS)
# Files rlhflab does not read, named as files: a missing one is 'no such file', not a hub name to look up
OTHER_FILE_SUFFIXES = (".tsv", ".txt", ".gz", ".zip", ".xz", ".bz2", ".tar", ".arrow", ".xlsx", ".xls", ".yaml", ".yml")


def is_hub_dataset(name: str) -> bool:
    """A `datasets.load_dataset` hub name ('org/name'), not a data file, directory or path on this machine."""
    return not (is_local_path(name) or Path(name).suffix.lower() in DATA_SUFFIXES + OTHER_FILE_SUFFIXES)


def check_hub_dataset(key: str, name: str | None) -> None:
    """check_hub for a hub dataset: in datasets' own cache (where `load_dataset` reads it offline), or the hub
    answers. One line before any run exists, instead of datasets' retries after the MLflow run was made."""
    if name is None or not is_hub_dataset(name):
        return
    import datasets.config
    from datasets.naming import camelcase_to_snakecase

    # where datasets' CachedDatasetModuleFactory looks: <cache>/<org>___<name in snake case>/<config>/<version>/<hash>
    *org, last = name.split("/")
    root = Path(datasets.config.HF_DATASETS_CACHE).expanduser() / "___".join([*org, camelcase_to_snakecase(last)])
    cached = any(p.is_dir() for p in root.glob("*/*/*"))
    _cached_or_reachable(key, name, cached, "dataset", "local Hugging Face datasets cache")


def _cached_or_reachable(key: str, name: str, cached: bool, kind: str, cache: str) -> None:
    if cached:
        return
    import os

    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    fix = (f"download it where the hub is reachable (hf download {name}) or give a local directory" if kind == "model" else
           f"load it once where the hub is reachable (datasets.load_dataset('{name}')) or give a local file")
    offline = ("HF_HUB_OFFLINE",) + (("HF_DATASETS_OFFLINE",) if kind == "dataset" else ())
    for var in offline:
        if os.environ.get(var, "").lower() in ("1", "true", "yes"):
            raise ConfigError(f"{key}: '{name}' is not in the {cache} and {var} is set; {fix}")
    try:
        (HfApi().model_info if kind == "model" else HfApi().dataset_info)(name, timeout=10)
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}: no {kind} '{name}' on the Hugging Face hub (or it is private); check the name, or {fix}") from None
    except Exception as err:  # no network, DNS, proxy, timeout
        reason = str(err).splitlines()[0][:120]
        raise ConfigError(f"{key}: '{name}' is not in the {cache} and the hub cannot be reached ({reason}); {fix}") from None
