"""The cache of built models and stage outputs: named by what determines them, written once, checked on load.

An entry is `<cache_dir>/<kind>/<name>-<key>`, the key a hash of everything that
determines the result (the data, the settings, the seeds, and the identity of its
inputs, never a path inside the cache, so a copied cache still hits). It is built in
a unique temporary directory and renamed into place, under a lock that a second run
needing the same entry waits on, and it carries a manifest of its files' sizes and
hashes. A damaged or partial entry is reported in one line and rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhflab import distributed
from rlhflab.errors import ConfigError, writing
from rlhflab.models.checks import model_dir_damage

log = logging.getLogger(__name__)

MANIFEST = "rlhflab_manifest.json"
CACHE_FIX = "make room on that disk, or set cache_dir= (or RLHFLAB_CACHE) to a directory on one with room"
HASH_LIMIT = 2**31  # files above 2 GiB are checked by size only (hashing them would cost seconds per load)


@dataclass(frozen=True)
class Saved:
    """A from_pretrained directory and the identity later cache keys build on (not its location)."""

    path: Path | str
    identity: str

    def __str__(self) -> str:
        return str(self.path)


def config_key(*parts: Any) -> str:
    """A short stable hash of JSON-able parts."""
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path) -> None:
    entries = {}
    for path in _files(root):
        size = path.stat().st_size
        entries[str(path.relative_to(root))] = {"size": size, "sha256": _sha256(path) if size <= HASH_LIMIT else None}
    (root / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def damage(root: Path) -> str | None:
    """What is wrong with a cache entry (missing manifest, a file of another size or hash, a
    damaged model directory), or None when it is whole."""
    manifest = root / MANIFEST
    if not manifest.is_file():
        return "no manifest: a partial or foreign entry"
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return "its manifest is unreadable"
    for name, want in entries.items():
        path = root / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{name} is {size} bytes, {want['size']} were written"
        if want["sha256"] and _sha256(path) != want["sha256"]:
            return f"{name} does not match its hash"
    return model_dir_damage(root) if (root / "config.json").exists() else None


@contextmanager
def locked(path: Path, what: str):
    """An exclusive lock beside `path` (held by one process at a time; others wait, saying so)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.parent / f".{path.name}.lock", "w")
    except OSError as err:  # the first write under cache_dir: a place os.access calls writable (root, /proc/x) that
        # is not, or a file where the cache keeps a folder (a traceback, after the run was made)
        where = next((p for p in (path.parent, *path.parent.parents) if p.exists()), path.parent)
        why = f"'{where}' is a file" if where.is_file() else f"cannot write '{path.parent}' ({err.strerror or err})"
        raise ConfigError(f"cache_dir: {why}; give a directory you can write (cache_dir=<dir>, or RLHFLAB_CACHE)") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another run is building %s; waiting for it", what, path.name)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached(cache_dir: Path, kind: str, name: str, key: str, what: str, build: Callable[[Path], None]) -> Path:
    """The entry `<cache_dir>/<kind>/<name>-<key>`: loaded when whole, else built by `build(tmp_dir)`
    (which writes a complete entry into tmp_dir) and renamed into place. `what` names it in the log.

    With several ranks (Lightning's DDP/FSDP), every rank runs `build` (its training is collective)
    into a directory of its own, rank 0 alone publishes the entry, and the others wait for it. Rank 0
    decides hit or miss; before the process group exists (the first stage, whose training starts the
    other ranks) a launched rank reaches the same decision because rank 0 publishes nothing until
    that training, which needs it, is over.
    """
    path = Path(cache_dir).resolve() / kind / f"{name}-{key}"  # absolute: a saved adapter records its base's path
    if not distributed.is_main():
        hit = distributed.broadcast(None) if distributed.initialized() else (path.exists() and damage(path) is None)
        if hit:
            return path
        _build_elsewhere(path, build, what)
        distributed.barrier()  # rank 0 has published the entry
        return path
    with locked(path, what):
        whole = path.exists() and damage(path) is None
        if distributed.initialized():
            distributed.broadcast(whole)
        if whole:
            log.info("%s: cached, loading %s", what, path)
            return path
        if path.exists():
            log.warning("%s: the cached entry %s is damaged (%s); rebuilding it", what, path, damage(path))
            shutil.rmtree(path)
        with writing(what, path, CACHE_FIX):
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
            try:
                build(tmp)
                write_manifest(tmp)
                tmp.rename(path)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    distributed.barrier()  # the other ranks (started by build's training) may load it now
    return path


def _build_elsewhere(path: Path, build: Callable[[Path], None], what: str) -> None:
    """Another rank's share of a build: the same training, its own output thrown away."""
    with writing(what, path, CACHE_FIX):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.rank.", dir=path.parent))
        try:
            build(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
